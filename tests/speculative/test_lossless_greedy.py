"""Greedy speculative decoding (chain and tree, batch 1 and 8) == vanilla greedy, token for token.

The reference is ``jaxsys.serving.generation`` (the model's own cached decode loop). The drafter is
briefly trained on the target's own greedy continuations so that drafts are partly accepted
(exercising commit of accepted paths) and partly rejected (exercising rollback).
"""

import numpy as np
import pytest
from flax import nnx

from jaxsys.core.errors import ConfigError, InputError, ShapeError
from jaxsys.models import DecoderConfig
from jaxsys.models.llm.decoder import random_model
from jaxsys.models.llm.drafter import DrafterConfig, EagleDrafter, top_token_ids
from jaxsys.serving.generation import generate
from jaxsys.speculative import online
from jaxsys.speculative.bandit import Strategy
from jaxsys.speculative.engine import RolloutConfig, RolloutEngine
from jaxsys.decoding.sampling import SamplingParams

CFG = DecoderConfig(vocab_size=48, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                    num_kv_heads=2)
CHAIN, TREE = Strategy.chain(3), Strategy(3, 2, 6)
STOP = 5


@pytest.fixture(scope="module")
def setup():
  model = random_model(CFG, 0)
  # Sharpen the random model so greedy decoding has clear argmaxes (no near-ties).
  model.lm_head[...] = model.lm_head[...] * 40.0
  drafter = EagleDrafter(DrafterConfig.for_target(CFG), rngs=nnx.Rngs(1))
  engine = RolloutEngine(model, drafter, RolloutConfig(
      strategies=(CHAIN, TREE), max_new=12, max_prompt=8, batch_buckets=(1, 8), stop_tokens=(STOP,)))
  rng = np.random.default_rng(0)
  prompts = [rng.integers(0, CFG.vocab_size, size=int(rng.integers(2, 8))).tolist() for _ in range(8)]
  ref = generate(model, prompts, max_new_tokens=12, stop_tokens=(STOP,))
  # Brief online-style training on the features of a vanilla rollout.
  res = engine.generate(prompts, speculative=False)
  assert res.stats["spec_steps"] == 0 and res.tokens == ref.tokens
  buffer = online.DrafterBuffer()
  buffer.add(0, res.sequences, res.features, res.prompt_lengths)
  trainer = online.DrafterTrainer(drafter, lr=3e-3, batch=8, seq_len=20)
  trainer.train(model, buffer, steps=40)
  engine.set_drafter(trainer.state)
  return model, trainer.drafter, engine, prompts, ref.tokens


@pytest.mark.parametrize("strategy", [CHAIN, TREE], ids=["chain", "tree"])
def test_greedy_speculative_with_reduced_draft_vocab_equals_vanilla(setup, strategy):
  """A reduced draft vocabulary (the 12 most frequent rollout tokens of 48) changes what is
  proposed, never what is emitted: verification uses the target's full distribution."""
  model, _, engine, prompts, ref = setup
  res = engine.generate(prompts, speculative=False)
  buffer = online.DrafterBuffer()
  buffer.add(0, res.sequences, res.features, res.prompt_lengths)
  drafter = EagleDrafter(DrafterConfig.for_target(CFG, draft_vocab=12), rngs=nnx.Rngs(1))
  drafter.set_draft_vocab(top_token_ids(res.sequences, 12, CFG.vocab_size, res.prompt_lengths))
  trainer = online.DrafterTrainer(drafter, lr=3e-3, batch=8, seq_len=20)
  trainer.train(model, buffer, steps=40)
  out = RolloutEngine(model, trainer.drafter, engine.config).generate(prompts, force_strategy=strategy)
  assert out.tokens == ref
  assert out.stats["spec_steps"] > 0 and out.stats["mean_accepted"] > 0


@pytest.mark.parametrize("strategy", [CHAIN, TREE], ids=["chain", "tree"])
@pytest.mark.parametrize("batch", [1, 8])
def test_greedy_speculative_equals_vanilla(setup, strategy, batch):
  _, _, engine, prompts, ref = setup
  res = engine.generate(prompts[:batch], force_strategy=strategy)
  assert res.tokens == ref[:batch]
  assert res.stats["spec_steps"] > 0 and res.stats["vanilla_steps"] == 0


def test_penalized_rollouts_are_lossless_and_match_generate(setup):
  """Penalties and bias in rollouts: every drafted node is verified against the target penalized
  with its own path's history, so greedy speculative (chain and tree) == vanilla rollouts ==
  ``generate`` with the same penalties, and the penalties change the output."""
  import dataclasses
  model, drafter, engine, prompts, ref = setup
  pen = SamplingParams(0.0, frequency_penalty=0.8, presence_penalty=0.4, repetition_penalty=1.5,
                       logit_bias={7: 2.0})
  want = generate(model, prompts, max_new_tokens=12, stop_tokens=(STOP,), sampling=pen).tokens
  assert want != ref
  eng = RolloutEngine(model, drafter, dataclasses.replace(engine.config, sampling=pen))
  assert eng.generate(prompts, speculative=False).tokens == want
  for strategy in (CHAIN, TREE):
    res = eng.generate(prompts, force_strategy=strategy)
    assert res.tokens == want, strategy
    assert res.stats["spec_steps"] > 0 and res.stats["mean_accepted"] > 0


def test_history_is_prompt_plus_committed_tokens(setup):
  model, drafter, engine, prompts, ref = setup
  res = engine.generate(prompts, force_strategy=TREE)
  assert res.tokens == ref
  assert res.stats["mean_accepted"] > 0  # some drafts were accepted and committed
  # Sequence history = prompt + committed tokens, in order.
  for p, seq, toks in zip(prompts, res.sequences, res.tokens):
    np.testing.assert_array_equal(seq[:len(p)], p)
    np.testing.assert_array_equal(seq[len(p):], toks[:len(seq) - len(p)])


def test_bad_inputs(setup):
  model, drafter, engine, prompts, _ = setup
  wrong_vocab = EagleDrafter(DrafterConfig.for_target(CFG, vocab_size=40), rngs=nnx.Rngs(0))
  with pytest.raises(ShapeError, match="vocab_size"):
    RolloutEngine(model, wrong_vocab, engine.config)
  wrong_hidden = EagleDrafter(DrafterConfig.for_target(CFG, hidden_size=16, head_dim=4), rngs=nnx.Rngs(0))
  with pytest.raises(ShapeError, match="hidden_size"):
    RolloutEngine(model, wrong_hidden, engine.config)
  with pytest.raises(ConfigError, match="top_k"):
    RolloutEngine(model, drafter, RolloutConfig(sampling=SamplingParams(top_k=100)))
  with pytest.raises(InputError, match="max_prompt"):
    engine.generate([list(range(9))])
  with pytest.raises(InputError, match="vocab_size"):
    engine.generate([[1, 99]])
