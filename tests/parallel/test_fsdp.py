"""FSDP and TP through the one rules table (``jaxsys.core.mesh.RULE_SETS``), in ``jaxsys.train``:
the same loss curve as one device on data-only and data x model meshes, Explicit (``jax.make_mesh``
defaults) and Auto; per-device parameter + optimizer memory from the compiled step; clear errors
for dimensions a mesh axis does not divide."""

import functools

import jax
import numpy as np
import pytest
from jax.sharding import AxisType

import jaxsys.models as M
from jaxsys import train as T
from jaxsys.core.errors import ConfigError
from jaxsys.core.mesh import make_mesh
from jaxsys.data import synthetic as S
from jaxsys.nn.layers import shard_params

CFG = M.DecoderConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2,
                      num_heads=8, num_kv_heads=4, max_position_embeddings=64)
TRAIN = T.TrainConfig(learning_rate=3e-3, warmup_steps=0, total_steps=4, log_every=1)


def batches(step):
  return S.training_batch({"copy": 1.0}, seed=0, step=step, batch_size=8, length=24)


@functools.cache
def _one_device():
  return _losses()


def _losses(mesh=None, rules="tp"):
  cfg = T.TrainConfig(**{**TRAIN.__dict__, "rules": rules})
  res = T.train(M.random_model(CFG, seed=3), batches, cfg, mesh=mesh, progress=False)
  return np.array([r["loss"] for r in res.history])


def _mesh(shape, kind):
  names = tuple(shape)
  if kind == "explicit":
    return jax.make_mesh(tuple(shape.values()), names)   # JAX's default: Explicit axes
  return make_mesh(shape)                                  # the project's: Auto axes


@pytest.mark.parametrize("shape,kind", [({"data": 8}, "explicit"), ({"data": 4, "model": 2}, "explicit"),
                                        ({"data": 2, "model": 4}, "explicit"), ({"data": 4, "model": 2}, "auto")])
def test_fsdp_loss_curve_equals_one_device(shape, kind):
  ref = _one_device()
  mesh = _mesh(shape, kind)
  if kind == "explicit":
    assert set(mesh.axis_types) == {AxisType.Explicit}
  got = _losses(mesh, "fsdp")
  np.testing.assert_allclose(got, ref, rtol=1e-4)


def test_tp_rules_still_match_one_device():
  np.testing.assert_allclose(_losses(_mesh({"data": 2, "model": 4}, "auto"), "tp"), _one_device(), rtol=1e-4)


def _state_bytes_per_device(mesh, rules):
  """Bytes per device of parameters + AdamW state (+ the batch shard), as the compiled train
  step's arguments count them (``jaxsys.train.lower_step``: placed as ``train`` places them)."""
  cfg = T.TrainConfig(**{**TRAIN.__dict__, "rules": rules})
  lowered = T.lower_step(M.random_model(CFG, seed=0), batches(0), cfg, mesh=mesh)
  return lowered.compile().memory_analysis().argument_size_in_bytes


def test_fsdp_shrinks_parameter_and_optimizer_memory_8x():
  one = _state_bytes_per_device(None, "tp")
  fsdp = _state_bytes_per_device(make_mesh({"data": 8}), "fsdp")
  tp = _state_bytes_per_device(make_mesh({"data": 8}), "tp")
  assert fsdp <= 0.15 * one, (fsdp, one)   # ideal 1/8 = 0.125 (measured 0.1250)
  assert tp >= 0.9 * one                    # "tp" on a data-only mesh replicates everything


def test_indivisible_dimension_is_a_clear_error_or_replicated():
  model = M.random_model(M.DecoderConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
                                         num_layers=1, num_heads=4, num_kv_heads=2), seed=0)
  mesh = make_mesh({"data": 2, "model": 4})
  with pytest.raises(ConfigError, match=r"layers/0/attn/wk dimension 1 \('kv_heads', size 2\).*size 4"):
    shard_params(model, mesh)
  shard_params(model, mesh, replicate_indivisible=True)
  assert model.layers[0].attn.wk[...].sharding.spec[1] is None
  with pytest.raises(ConfigError, match="rules"):
    T.TrainConfig(rules="zero")
  # train() the same: an error by default, replicated (same loss as one device) on request
  odd = M.DecoderConfig(vocab_size=128, hidden_size=48, intermediate_size=64, num_layers=1, num_heads=6,
                        num_kv_heads=3)
  run = lambda mesh, **kw: np.array([r["loss"] for r in T.train(  # noqa: E731
      M.random_model(odd, seed=1), batches, T.TrainConfig(**{**TRAIN.__dict__, "rules": "fsdp", **kw}),
      mesh=mesh, progress=False).history])
  with pytest.raises(ConfigError, match="replicate_indivisible"):
    run(make_mesh({"data": 4, "model": 2}))
  np.testing.assert_allclose(run(make_mesh({"data": 4, "model": 2}), replicate_indivisible=True), run(None),
                             rtol=1e-4)


def test_pods_doc_memory_table_is_the_estimators():
  """docs/pods.md's per-device memory table for 1B / 8B Llama shapes is what
  state_bytes_per_device computes (on abstract models: nothing allocated)."""
  import pathlib

  from flax import nnx

  from jaxsys.models.llm.decoder import Decoder
  from jaxsys.nn.layers import state_bytes_per_device
  doc = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "pods.md").read_text()
  shapes = {"1B (Llama-3.2-1B shape)": dict(hidden_size=2048, intermediate_size=8192, num_layers=16, tie_embeddings=True),
            "8B (Llama-3.1-8B shape)": dict(hidden_size=4096, intermediate_size=14336, num_layers=32)}
  layouts = [({"data": 1}, "tp"), ({"data": 8}, "tp"), ({"model": 8}, "tp"), ({"data": 8}, "fsdp"),
             ({"data": 2, "model": 4}, "fsdp")]
  for name, kw in shapes.items():
    cfg = M.DecoderConfig(vocab_size=128256, num_heads=32, num_kv_heads=8, param_dtype="bfloat16",
                          dtype="bfloat16", **kw)
    model = nnx.eval_shape(lambda cfg=cfg: Decoder(cfg, rngs=nnx.Rngs(0)))
    for shape, rules in layouts:
      g = {k: v / 2**30 for k, v in state_bytes_per_device(model, shape, rules).items()}
      mesh = ",".join(f"{k}={v}" for k, v in shape.items())
      row = (f"| {name} | {mesh} | {rules} | {g['params']:.2f} | {g['grads']:.2f} | {g['optimizer']:.2f} "
             f"| {g['total']:.2f} |")
      assert row in doc, row
  one = state_bytes_per_device(M.random_model(CFG, seed=0), {"data": 1})
  assert one["params"] == sum(x.nbytes for x in jax.tree.leaves(nnx.state(M.random_model(CFG, seed=0), nnx.Param)))


_TWO_PROCESS_WORKER = """
from jaxsys.parallel.distributed import initialize_distributed
assert initialize_distributed()               # JAXSYS_* from the environment: 2 processes x 2 devices
import jax
import jaxsys.models as M
from jaxsys import train as T
from jaxsys.core.mesh import make_mesh
from jaxsys.data import synthetic as S
assert jax.process_count() == 2 and jax.device_count() == 4
CFG = M.DecoderConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=8,
                      num_kv_heads=4, max_position_embeddings=64)
cfg = T.TrainConfig(learning_rate=3e-3, warmup_steps=0, total_steps=3, log_every=1, rules="fsdp")
batches = lambda step: S.training_batch({"copy": 1.0}, seed=0, step=step, batch_size=8, length=24)
res = T.train(M.random_model(CFG, seed=3), batches, cfg, mesh=make_mesh({"data": 2, "model": 2}), progress=False)
print("LOSSES", ",".join(repr(r["loss"]) for r in res.history), flush=True)
"""


def test_fsdp_step_across_two_processes_matches_one(tmp_path):
  """The FSDP + TP train step on a data=2 x model=2 mesh spanning two jax.distributed processes
  gives one device's losses."""
  import sys
  sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))
  from _multiprocess import run_two_processes
  outs = run_two_processes(_TWO_PROCESS_WORKER, tmp_path, timeout=300, what="FSDP train step")
  got = [[float(x) for x in o.split("LOSSES ")[1].split()[0].split(",")] for o in outs]
  cfg = T.TrainConfig(learning_rate=3e-3, warmup_steps=0, total_steps=3, log_every=1)
  ref = [r["loss"] for r in T.train(M.random_model(CFG, seed=3), batches, cfg, progress=False).history]
  for losses in got:
    np.testing.assert_allclose(losses, ref, rtol=1e-4)
