"""Test setup: 8 simulated CPU devices, set before JAX is imported anywhere."""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "").replace(
    "--xla_force_host_platform_device_count=8", "") + " --xla_force_host_platform_device_count=8").strip()
# The suite compiles far more than it runs (hundreds of small programs), so LLVM's optimisation of
# the CPU backend's generated code is turned down: about a third less CPU time. Matmuls and convs
# call precompiled library kernels, so the real-model tests run at the same speed. The flag is
# inherited by every subprocess the tests start (notebook kernels, CLIs, jax.distributed workers);
# a level set in XLA_FLAGS by whoever runs the tests wins.
O0 = "--xla_backend_optimization_level=0"
if "xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
  os.environ["XLA_FLAGS"] += " " + O0
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("MPLBACKEND", "Agg")

import importlib.util  # noqa: E402
import pathlib  # noqa: E402

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


# Tests that run in processes of their own (notebook kernels, README blocks): the longest single
# tests of the suite.
SPREAD = ("tests/colab/", "tests/test_readme.py")


def pytest_collection_modifyitems(config, items):
  has_gpu = any(d.platform == "gpu" for d in jax.devices()) if os.environ.get("JAX_PLATFORMS") != "cpu" else False
  skip = pytest.mark.skip(reason="needs a GPU")
  for item in items:
    if "gpu" in item.keywords and not has_gpu:
      item.add_marker(skip)
  # Under `-n 2 --dist worksteal`, longest first, so that no long test starts last while the other
  # worker idles: the tests that start processes of their own, then the real model's tests, then
  # the rest in file order.
  def rank(item):
    if item.nodeid.startswith(SPREAD):
      return 0
    return 1 if "smollm2" in getattr(item, "fixturenames", ()) else 2
  items.sort(key=rank)  # stable: file order within each rank


def pytest_configure(config):
  # A test whose xdist worker dies (a segfault in XLA:CPU's compiler) is rerun once on a fresh
  # worker, and listed at the end: see tests/_xdist_crash.py.
  path = pathlib.Path(__file__).with_name("_xdist_crash.py")
  spec = importlib.util.spec_from_file_location("jaxsys_tests_xdist_crash", path)
  plugin = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(plugin)
  config.pluginmanager.register(plugin, "jaxsys-xdist-crash")


@pytest.fixture(scope="session")
def devices():
  devs = jax.devices()
  assert len(devs) == 8, f"expected 8 simulated devices, got {len(devs)}"
  return devs


SMOLLM2 = "smollm2-135m-instruct"


def _smollm2_path():
  from jaxsys.models.llm.interop import pretrained
  path = pretrained.find(SMOLLM2)
  if path is None:
    pytest.skip(f"SmolLM2-135M-Instruct is not installed: run `jaxsys fetch {SMOLLM2}`")
  return path


@pytest.fixture(scope="session")
def smollm2_path():
  """The installed SmolLM2-135M-Instruct GGUF file (the test skips when it is not installed)."""
  return _smollm2_path()


@pytest.fixture(scope="session")
def smollm2_tokenizer():
  """The real SmolLM2 tokenizer (from the GGUF; converted once, then read from the cache)."""
  from jaxsys.models.llm.interop.gguf import load_tokenizer
  return load_tokenizer(_smollm2_path())


@pytest.fixture(scope="session")
def smollm2(smollm2_tokenizer):
  """``(model, tokenizer)``: the real SmolLM2-135M-Instruct in float32, loaded once per test
  process (each xdist worker that runs one of its tests loads it once)."""
  from jaxsys.models import from_gguf
  import jax.numpy as jnp
  return from_gguf(_smollm2_path(), jnp.float32), smollm2_tokenizer
