"""Test setup: 8 simulated CPU devices, set before JAX is imported anywhere."""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "").replace(
    "--xla_force_host_platform_device_count=8", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("MPLBACKEND", "Agg")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


def pytest_collection_modifyitems(config, items):
  has_gpu = any(d.platform == "gpu" for d in jax.devices()) if os.environ.get("JAX_PLATFORMS") != "cpu" else False
  skip = pytest.mark.skip(reason="needs a GPU")
  for item in items:
    if "gpu" in item.keywords and not has_gpu:
      item.add_marker(skip)


@pytest.fixture(scope="session")
def devices():
  devs = jax.devices()
  assert len(devs) == 8, f"expected 8 simulated devices, got {len(devs)}"
  return devs


SMOLLM2 = "smollm2-135m-instruct"


def _smollm2_path():
  from jaxsys.models import pretrained
  path = pretrained.find(SMOLLM2)
  if path is None:
    pytest.skip(f"SmolLM2-135M-Instruct is not installed: run `jaxsys fetch {SMOLLM2}`")
  return path


@pytest.fixture(scope="session")
def smollm2_tokenizer():
  """The real SmolLM2 tokenizer (from the GGUF; converted once, then read from the cache)."""
  from jaxsys.models.gguf import load_tokenizer
  return load_tokenizer(_smollm2_path())


@pytest.fixture(scope="session")
def smollm2(smollm2_tokenizer):
  """``(model, tokenizer)``: the real SmolLM2-135M-Instruct in float32, loaded once per test
  process. Tests that use it carry ``pytest.mark.xdist_group("smollm2")`` so that, under
  ``pytest -n ... --dist loadgroup``, one worker holds it."""
  from jaxsys.models import from_gguf
  import jax.numpy as jnp
  return from_gguf(_smollm2_path(), jnp.float32), smollm2_tokenizer
