"""Drafting uses the drafter the way it was trained.

A drafter fitted to the target's own greedy continuations of some prompts predicts the target's
next token almost always on those sequences (teacher forced, ``drafter_loss``'s top-1). Greedy
speculation on the same prompts must then accept close to the draft depth per round: a drafter
fed features/tokens shifted by one position, a stale drafter state, or a broken drafter cache
after rollback gives ~0 accepted tokens although the teacher-forced top-1 is high.
"""

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxsys.models import DecoderConfig
from jaxsys.models.llm.decoder import random_model
from jaxsys.models.llm.drafter import DrafterConfig, EagleDrafter, drafter_loss
from jaxsys.speculative import online
from jaxsys.speculative.bandit import Strategy
from jaxsys.speculative.engine import RolloutConfig, RolloutEngine

CFG = DecoderConfig(vocab_size=48, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                    num_kv_heads=2)
CHAIN = Strategy.chain(3)


def test_fitted_drafter_accepts_near_depth():
  model = random_model(CFG, 0)
  model.lm_head[...] = model.lm_head[...] * 40.0  # clear argmaxes
  drafter = EagleDrafter(DrafterConfig.for_target(CFG), rngs=nnx.Rngs(1))
  engine = RolloutEngine(model, drafter, RolloutConfig(
      strategies=(CHAIN,), max_new=24, max_prompt=8, batch_buckets=(1, 2)))
  rng = np.random.default_rng(0)
  prompts = [rng.integers(0, CFG.vocab_size, size=6).tolist() for _ in range(2)]
  res = engine.generate(prompts, speculative=False)
  buffer = online.DrafterBuffer()
  buffer.add(0, res.sequences, res.features, res.prompt_lengths)
  trainer = online.DrafterTrainer(drafter, lr=3e-3, batch=2, seq_len=32)
  trainer.train(model, buffer, steps=300)
  tk, fe, mk = buffer.sample(8, 32)
  top1 = float(drafter_loss(trainer.drafter, model, jnp.asarray(tk), jnp.asarray(fe), jnp.asarray(mk))[1]["top1"])
  assert top1 > 0.9, f"the drafter did not fit its training data (top-1 {top1:.2f})"
  engine.set_drafter(trainer.state)
  for p in prompts:
    spec = engine.generate([p], force_strategy=CHAIN)
    assert spec.tokens == engine.generate([p], speculative=False).tokens
    # top-1 > 0.9 -> a chain of 3 is mostly accepted (end of the response cuts the last rounds).
    assert spec.stats["mean_accepted"] >= 1.8, (top1, spec.stats["mean_accepted"])
