"""Losslessness on the real SmolLM2-135M-Instruct: greedy speculative decoding (chain and tree, a
reduced draft vocabulary) equals the engine's vanilla greedy decode, token for token, on 8 chat
prompts (that the vanilla path is the decoding core's greedy ``generate`` is tested on the tiny
model, tests/speculative/test_lossless_greedy.py; a second 30-layer compile here would double
the test's time).

The drafter is trained for a few steps on the model's own greedy responses to these prompts, so
that drafts are partly accepted (commit of accepted paths) and partly rejected (rollback). Short
responses keep the test small. The model is the session fixture ``smollm2`` (tests/conftest.py: its
xdist group, and the skip when the model is not installed).
"""

import pytest
from flax import nnx

from jaxsys.models.llm.interop import pretrained as P
from jaxsys.models.llm.drafter import DrafterConfig, EagleDrafter, top_token_ids
from jaxsys.serving.generation import default_stop_tokens
from jaxsys.speculative import online
from jaxsys.speculative.bandit import Strategy
from jaxsys.speculative.engine import RolloutConfig, RolloutEngine

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.",
           "List three primary colors.", "Count from one to ten.", "Name two planets.",
           "What is 12 plus 7?", "Say hello in Spanish.", "Give one word that rhymes with cat."]
MAX_NEW = 16
CHAIN, TREE = Strategy.chain(3), Strategy(3, 2, 5)


@pytest.fixture(scope="module")
def smol_spec(smollm2):
  model, tok = smollm2
  prompts = [P._chat_ids(tok, [{"role": "user", "content": p}]) for p in PROMPTS]
  stops = default_stop_tokens(model.config, tok)
  drafter = EagleDrafter(DrafterConfig.for_target(model.config, draft_vocab=1024), rngs=nnx.Rngs(0))
  engine = RolloutEngine(model, drafter, RolloutConfig(
      strategies=(CHAIN, TREE), max_new=MAX_NEW, max_prompt=max(map(len, prompts)),
      batch_buckets=(8,), stop_tokens=stops))
  res = engine.generate(prompts, speculative=False)
  drafter.set_draft_vocab(top_token_ids(res.sequences, 1024, model.config.vocab_size,
                                        res.prompt_lengths))
  buffer = online.DrafterBuffer()
  buffer.add(0, res.sequences, res.features, res.prompt_lengths)
  trainer = online.DrafterTrainer(drafter, lr=3e-3, batch=8, seq_len=64)
  trainer.train(model, buffer, steps=30)
  engine.set_drafter(trainer.state)
  return engine, prompts, res


def test_smollm2_greedy_speculative_equals_vanilla(smol_spec):
  engine, prompts, vanilla = smol_spec
  ref = vanilla.tokens
  assert sum(map(len, ref)) > len(ref)  # real responses, not an immediate stop
  for strategy in (CHAIN, TREE):
    res = engine.generate(prompts, force_strategy=strategy)
    assert res.tokens == ref, strategy.name
    assert res.stats["spec_steps"] > 0 and res.stats["mean_accepted"] > 0, strategy.name
