"""After ``precompile()`` rollouts run no compiler: every batch bucket, every shrink, both loops.

Compilations are counted with JAX's backend-compile monitoring event (it fires for jitted calls,
AOT ``.compile()`` and eager ops alike), so an eager op slipping into ``generate`` fails too.
Sampled rollouts with a stop token finish rows at varying steps, so the batch shrinks to
different buckets from one seed to the next.
"""

import contextlib

import jax
import numpy as np
from flax import nnx
from jax._src import dispatch  # the event name only (no public constant)

from jaxsys.models import DecoderConfig
from jaxsys.models.llm.decoder import random_model
from jaxsys.models.llm.drafter import DrafterConfig, EagleDrafter
from jaxsys.speculative.bandit import Strategy
from jaxsys.speculative.engine import RolloutConfig, RolloutEngine
from jaxsys.decoding.sampling import SamplingParams

CFG = DecoderConfig(vocab_size=24, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4,
                    num_kv_heads=2)


@contextlib.contextmanager
def count_compiles():
  events = []

  def listener(event, duration, **kw):
    if event == dispatch.BACKEND_COMPILE_EVENT:
      events.append(duration)

  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    yield events
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)


def test_precompiled_rollouts_compile_nothing():
  model = random_model(CFG, 0)
  drafter = EagleDrafter(DrafterConfig.for_target(CFG), rngs=nnx.Rngs(1))
  engine = RolloutEngine(model, drafter, RolloutConfig(
      strategies=(Strategy.chain(2), Strategy(2, 2, 3)), max_new=10, max_prompt=6,
      batch_buckets=(1, 4, 8), spec_threshold=5, stop_tokens=(3, 4, 5),
      sampling=SamplingParams(1.0)))
  rng = np.random.default_rng(0)
  prompts = [rng.integers(6, CFG.vocab_size, size=int(rng.integers(2, 6))).tolist() for _ in range(8)]
  with count_compiles() as before:
    engine.precompile()
  assert before and engine.pool.compilations > 0
  n_exe = engine.pool.compilations
  shrinks = set()
  with count_compiles() as events:
    for seed in range(6):  # every bucket, both engines' modes, several shrink targets
      for n, spec in ((8, True), (8, False), (3, True), (1, True)):
        res = engine.generate(prompts[:n], seed=seed, speculative=spec)
        shrinks.add((n, res.stats["shrinks"], tuple(res.stats["spec_batch"])))
  assert engine.pool.compilations == n_exe, engine.pool.compiled_keys[n_exe:]
  assert not events, f"{len(events)} compilations after precompile()"
  assert len(shrinks) > 3  # the rollouts did take different paths


def test_spec_threshold_above_the_largest_bucket():
  """A long tail that starts above the largest bucket runs in that bucket (no bucket is asked
  for beyond it): precompile and a rollout work, and nothing more compiles afterwards."""
  model = random_model(CFG, 0)
  engine = RolloutEngine(model, None, RolloutConfig(
      strategies=(Strategy.lookup_chain(2),), max_new=4, max_prompt=4, batch_buckets=(1,),
      spec_threshold=3))
  engine.precompile()
  n_exe = engine.pool.compilations
  assert len(engine.generate([[7, 8]]).tokens) == 1
  assert engine.pool.compilations == n_exe


def test_prompt_buckets_prefill_short_prompts_short():
  """``prompt_buckets``: a batch prefills at the smallest length holding its longest prompt, with
  the same tokens as a max_prompt-long prefill (greedy, vanilla and speculative); precompile
  builds every length, so nothing compiles afterwards; a bucket beyond max_prompt is refused."""
  import pytest
  from jaxsys.core.errors import ConfigError
  model = random_model(CFG, 0)
  drafter = EagleDrafter(DrafterConfig.for_target(CFG), rngs=nnx.Rngs(1))
  base = dict(strategies=(Strategy.chain(2),), max_new=6, max_prompt=16, batch_buckets=(1, 4), spec_threshold=3)
  long_only = RolloutEngine(model, drafter, RolloutConfig(**base))
  short = RolloutEngine(model, drafter, RolloutConfig(**base, prompt_buckets=(4, 8)))
  assert short.config.prompt_lengths == (4, 8, 16)
  short.precompile()
  n_exe = short.pool.compilations
  rng = np.random.default_rng(1)
  batches = [[rng.integers(6, CFG.vocab_size, size=size).tolist() for _ in range(4)]
             for size in (3, 7, 12)]  # one batch per prefill length
  want = [long_only.generate(p, speculative=spec).tokens for p in batches for spec in (False, True)]
  used = []
  exe = short._exe
  short._exe = lambda kind, *a: used.append(kind) or exe(kind, *a)
  with count_compiles() as events:
    got = [short.generate(p, speculative=spec).tokens for p in batches for spec in (False, True)]
  assert got == want
  assert [k for k in used if k.startswith("prefill")] == ["prefill4"] * 2 + ["prefill8"] * 2 + ["prefill16"] * 2
  assert short.pool.compilations == n_exe and not events
  with pytest.raises(ConfigError, match="prompt_buckets"):
    RolloutConfig(**base, prompt_buckets=(32,))
