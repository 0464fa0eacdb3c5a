"""Tensor-parallel rollouts: ``RolloutEngine(..., mesh=...)`` shards the weights by the "tp" rules
and the KV cache by kv head over "model"; greedy tokens equal one device's, vanilla and
speculative, on JAX's default (Explicit) mesh and an Auto one; the caller's model is not moved."""

import jax
import numpy as np
import pytest
from flax import nnx

from jaxsys.core.errors import ConfigError
from jaxsys.core.mesh import make_mesh
from jaxsys.models import DecoderConfig, random_model
from jaxsys.models.llm.drafter import DrafterConfig, EagleDrafter
from jaxsys.speculative.bandit import Strategy
from jaxsys.speculative.engine import RolloutConfig, RolloutEngine

CFG = DecoderConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=8,
                    num_kv_heads=4)
ROLL = RolloutConfig(strategies=(Strategy.chain(2),), max_new=12, max_prompt=8, batch_buckets=(2, 8),
                     spec_threshold=3)


@pytest.fixture(scope="module")
def setup():
  model = random_model(CFG, 0)
  model.lm_head[...] = model.lm_head[...] * 20.0  # clear argmaxes: greedy ties cannot flip
  drafter = EagleDrafter(DrafterConfig.for_target(CFG), rngs=nnx.Rngs(1))
  rng = np.random.default_rng(0)
  prompts = [rng.integers(0, CFG.vocab_size, size=int(rng.integers(3, 8))).tolist() for _ in range(8)]
  ref = RolloutEngine(model, drafter, ROLL)
  return model, drafter, prompts, {s: ref.generate(prompts, speculative=s).tokens for s in (False, True)}


@pytest.mark.parametrize("kind,tp", [("explicit", 2), ("auto", 4)])
def test_tp_rollouts_equal_one_device(setup, kind, tp):
  model, drafter, prompts, ref = setup
  mesh = jax.make_mesh((tp,), ("model",)) if kind == "explicit" else make_mesh({"model": tp})
  engine = RolloutEngine(model, drafter, ROLL, mesh=mesh)
  assert engine.tstate["layers"][0]["attn"]["wq"][...].sharding.spec[1] == "model"
  assert len(model.layers[0].attn.wq[...].sharding.device_set) == 1  # the caller's model stays put
  for spec in (False, True):
    assert engine.generate(prompts, speculative=spec).tokens == ref[spec], spec
  engine.set_weights(model)  # placed again on the mesh
  assert engine.generate(prompts[:2], speculative=False).tokens == ref[False][:2]


def test_tp_rollouts_refuse_other_axes_and_indivisible_heads(setup):
  model, drafter, _, _ = setup
  with pytest.raises(ConfigError, match="'model' axis only"):
    RolloutEngine(model, drafter, ROLL, mesh=make_mesh({"data": 2, "model": 2}))
  with pytest.raises(ConfigError, match="num_kv_heads=4 must be a multiple"):
    RolloutEngine(model, drafter, ROLL, mesh=make_mesh({"model": 8}))


_TWO_PROCESS_WORKER = """
from jaxsys.parallel.distributed import initialize_distributed
assert initialize_distributed()               # JAXSYS_* from the environment: 2 processes x 2 devices
import jax
import numpy as np
from jaxsys.core.mesh import make_mesh
from jaxsys.models import DecoderConfig, random_model
from jaxsys.speculative.engine import RolloutConfig, RolloutEngine
assert jax.process_count() == 2 and jax.device_count() == 4
CFG = DecoderConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=8,
                    num_kv_heads=4)
model = random_model(CFG, 0)
model.lm_head[...] = model.lm_head[...] * 20.0
rng = np.random.default_rng(0)
prompts = [rng.integers(0, CFG.vocab_size, size=int(rng.integers(3, 8))).tolist() for _ in range(8)]
engine = RolloutEngine(model, None, RolloutConfig(max_new=12, max_prompt=8, batch_buckets=(2, 8),
                       spec_threshold=3, speculative=False), mesh=make_mesh({"model": 4}))
print("TOKENS", repr(engine.generate(prompts).tokens), flush=True)
"""


def test_tp_decode_across_two_processes_matches_one(tmp_path, setup):
  """Greedy TP=4 rollouts on a "model" mesh spanning two jax.distributed processes give one
  device's tokens."""
  import ast
  import pathlib
  import sys
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
  from _multiprocess import run_two_processes
  outs = run_two_processes(_TWO_PROCESS_WORKER, tmp_path, timeout=300, what="TP decode")
  _, _, _, ref = setup
  for out in outs:
    assert ast.literal_eval(out.split("TOKENS ")[1].splitlines()[0]) == ref[False]
