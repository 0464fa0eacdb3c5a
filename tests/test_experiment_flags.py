"""The flags every experiment shares (``experiments/_cli.py``): --devices, --mesh, --dtype, and a
clear message where the machine has too few devices."""

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _multiprocess import xla_flags  # noqa: E402

from jaxsys.core.errors import ConfigError  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _run(*args, env_extra=None):
  env = dict(os.environ, XLA_FLAGS=xla_flags())
  env.update(env_extra or {})
  return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                        timeout=120)


def test_parse_mesh():
  from experiments._cli import parse_mesh
  assert parse_mesh("ring=2,ulysses=4") == {"ring": 2, "ulysses": 4}
  assert parse_mesh(" graph = 8 ") == {"graph": 8}
  for bad in ("ring", "ring=0", "ring=2,ring=2", "ring=x", ""):
    with pytest.raises(argparse.ArgumentTypeError):
      parse_mesh(bad)


def test_help_lists_the_flags_each_experiment_takes():
  mm = _run("-m", "experiments.mmsp", "--help")
  assert mm.returncode == 0, mm.stderr
  for flag in ("--devices", "--mesh", "--dtype", "ring=2,ulysses=4"):
    assert flag in mm.stdout
  cl = _run("-m", "experiments.cluster", "--help")
  assert cl.returncode == 0 and "--devices" in cl.stdout and "--mesh" not in cl.stdout


def test_devices_flag_sets_the_simulated_cpu_count():
  code = ("import experiments._cli as c; c.set_cpu_devices(3); import jax; "
          "print(jax.device_count()); c.set_cpu_devices(3)\n"
          "try:\n  c.set_cpu_devices(5)\nexcept RuntimeError as e:\n  print('late:', e)")
  r = _run("-c", code, env_extra={"JAX_PLATFORMS": "cpu"})
  assert r.returncode == 0, r.stderr
  assert r.stdout.splitlines()[0] == "3" and "already started with 3 devices" in r.stdout


def test_one_device_gets_a_message_saying_how_to_get_more():
  r = _run("-m", "experiments.mmsp", "--devices", "1", "--quick", "--out", os.devnull)
  assert r.returncode == 2
  assert "needs >= 2 devices" in r.stderr and "--devices 8" in r.stderr and "Traceback" not in r.stderr


def test_mmsp_setups_follow_the_mesh():
  from experiments.mmsp import _headline, make_setups
  s = make_setups(8)
  assert {"ring 8", "zigzag 8", "ulysses 8", "hybrid 2x4", "hybrid 4x2", "allgather 8"} == set(s)
  assert _headline(s) == ("ring 8", "hybrid 2x4")
  s = make_setups(8, {"ulysses": 8})
  assert not any(v[0] == "hybrid" for v in s.values()) and _headline(s) == ("ring 8", "ulysses 8")
  s = make_setups(8, {"ring": 2, "ulysses": 2})  # a 4-device mesh on an 8-device host
  assert s["hybrid 2x2"] == ("hybrid", (2, 2)) and "ring 4" in s
  with pytest.raises(ConfigError, match="--devices 16"):
    make_setups(8, {"ring": 4, "ulysses": 4})
  with pytest.raises(ConfigError, match="not used by mmsp"):
    make_setups(8, {"graph": 8})


def test_lserve_parts_run_alone_and_name_their_result(tmp_path):
  import json

  from experiments import lserve
  rows = lserve.run(True, str(tmp_path), parts=("memory", "smollm2"))
  saved = json.loads((tmp_path / "lserve_memory_smollm2" / "result.json").read_text())
  assert saved["config"]["parts"] == ["memory", "smollm2"]
  assert [r["metric"] for r in saved["rows"]] == [r.metric for r in rows]
  # the real-model rows are the full mode's: quick says how to get them instead of measuring
  (note,) = [r for r in rows if r.metric.startswith("SmolLM2")]
  assert note.ours is None and "--parts smollm2" in note.note
  with pytest.raises(ValueError, match="must be among"):
    lserve.run(True, str(tmp_path), parts=("nope",))


def test_serving_parts_are_checked(tmp_path):
  from experiments import serving
  assert serving.PARTS == ("rates", "long", "soak", "structured")
  with pytest.raises(ValueError, match="must be among"):
    serving.run(True, str(tmp_path), parts=("nope",))


def test_every_experiment_that_builds_a_mesh_takes_mesh_and_the_readme_says_which():
  """``--mesh`` goes to exactly the experiments that build a mesh, ``--seed`` to all of them, and the
  README's tour names the mesh and dtype experiments as they are."""
  import re

  from jaxsys.experiments import REGISTRY, run_params
  builds = {n for n, (m, _, _) in REGISTRY.items()
            if "make_mesh" in (ROOT / (m.replace(".", "/") + ".py")).read_text()}
  takes = {f: {n for n in REGISTRY if f in run_params(n)} for f in ("mesh", "dtype", "seed")}
  assert takes["mesh"] == builds
  assert takes["seed"] == set(REGISTRY)
  readme = (ROOT / "README.md").read_text()
  named = re.search(r"those that build\s+a mesh \(([^)]*)\) take `--mesh`", readme)
  assert named and set(re.findall(r"`(\w+)`", named.group(1))) == builds
  dtype = re.search(r"take `--mesh`\s+\(`[^`]*`\);\s+(.*?) takes? `--dtype`", readme, re.S)
  assert dtype and set(re.findall(r"`(\w+)`", dtype.group(1))) == takes["dtype"]
  # every experiment with a decoder LM takes --dtype (real_lm times each precision itself)
  lm = re.compile(r"load_tiny_lm|load_pretrained|from_hf_model|DecoderConfig\(|VLMConfig\(")
  with_lm = {n for n, (m, _, _) in REGISTRY.items()
             if lm.search((ROOT / (m.replace(".", "/") + ".py")).read_text())}
  assert with_lm - {"real_lm"} == takes["dtype"]


def test_dtype_flag_runs_the_model_in_that_compute_dtype():
  """``--dtype`` (``with_compute_dtype``): float32 is the model itself; bfloat16 computes in bf16
  with the parameters untouched, and agrees with float32 to bf16 precision."""
  import jax.numpy as jnp
  import numpy as np
  from flax import nnx

  from experiments._cli import with_compute_dtype
  from jaxsys.models import DecoderConfig
  from jaxsys.models.llm.decoder import random_model
  cfg = DecoderConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                      num_kv_heads=1, max_position_embeddings=64)
  model = random_model(cfg, seed=0)
  assert with_compute_dtype(model, "float32") is model
  bf16 = with_compute_dtype(model, "bfloat16")
  assert (bf16.config.dtype, bf16.config.param_dtype) == ("bfloat16", "float32")
  assert all(p.dtype == jnp.float32 for p in jax_leaves(nnx.state(bf16, nnx.Param)))
  tokens = jnp.arange(16, dtype=jnp.int32)[None] % 64
  ref, got = model(tokens), bf16(tokens)  # [1, 16, vocab] logits (returned in float32)
  # bf16 compute shows as bf16-sized differences: not zero (it did run in bf16), not more
  err = float(jnp.max(jnp.abs(got.astype(jnp.float32) - ref)))
  assert np.isfinite(err) and 0 < err < 0.05 * float(jnp.max(jnp.abs(ref))) + 0.05, err


def jax_leaves(tree):
  import jax
  return jax.tree_util.tree_leaves(tree)
