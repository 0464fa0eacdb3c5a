"""The rollout engine's on-device phases (one while_loop per phase) == vanilla greedy, token for token.

Uses the trained setup of ``test_lossless_greedy`` (drafts partly accepted, partly rejected).
"""

import dataclasses

import numpy as np
import pytest

from jaxsys.speculative.engine import RolloutEngine

from .test_lossless_greedy import CHAIN, TREE, setup  # noqa: F401  (pytest fixture)


@pytest.fixture(scope="module")
def fused_engine(setup):  # noqa: F811
  model, drafter, engine, _, _ = setup
  # Four of the eight reference rows stop within 6 tokens: the long tail starts with 4 running
  # rows (< spec_threshold=5), which the engine moves to the 4-row bucket.
  cfg = dataclasses.replace(engine.config, spec_threshold=5, batch_buckets=(1, 4, 8))
  return RolloutEngine(model, drafter, cfg, pool=engine.pool)


@pytest.mark.parametrize("strategy", [CHAIN, TREE], ids=["chain", "tree"])
@pytest.mark.parametrize("batch", [1, 8])
def test_fused_speculative_equals_vanilla(setup, fused_engine, strategy, batch):  # noqa: F811
  _, _, _, prompts, ref = setup
  res = fused_engine.generate(prompts[:batch], force_strategy=strategy)
  assert res.tokens == ref[:batch]
  assert res.stats["spec_steps"] > 0 and res.stats["vanilla_steps"] == 0
  assert res.stats["mean_accepted"] > 0


@pytest.mark.parametrize("speculative", [False, True])
def test_fused_phases_equal_vanilla(setup, fused_engine, speculative):  # noqa: F811
  """Vanilla loop on the full batch, shrink, long-tail loop: same tokens and histories."""
  _, _, engine, prompts, ref = setup
  calls = []
  res = fused_engine.generate(prompts, speculative=speculative, on_long_tail=lambda: calls.append(1))
  assert res.tokens == ref
  assert res.stats["vanilla_steps"] > 0 and res.stats["shrinks"] >= 1
  assert (res.stats["spec_steps"] > 0) == speculative == bool(calls)
  base = fused_engine.generate(prompts, speculative=False)
  for a, b, fa, fb in zip(res.sequences, base.sequences, res.features, base.features):
    # A verify round may commit accepted tokens past max_new (they are not emitted): compare
    # the history both runs committed.
    k = min(len(a), len(b))
    np.testing.assert_array_equal(a[:k], b[:k])
    np.testing.assert_allclose(fa[:k], fb[:k], atol=1e-4)


def test_vanilla_arm_is_explored_and_lossless(setup):  # noqa: F811
  """With ``vanilla_arm`` the bandit may decode the long tail without drafting; outputs unchanged."""
  model, drafter, engine, prompts, ref = setup
  cfg = dataclasses.replace(engine.config, spec_threshold=5, batch_buckets=(1, 4, 8),
                            vanilla_arm=True, epsilon=0.0)
  eng = RolloutEngine(model, drafter, cfg, pool=engine.pool)
  n_arms = len(cfg.strategies) + 1
  strategies = []
  for _ in range(n_arms):  # every arm is tried once per bucket before exploitation
    res = eng.generate(prompts)
    assert res.tokens == ref
    strategies += res.stats["strategy"]
  assert "vanilla" in strategies and set(strategies) - {"vanilla"}
  assert eng.bandit.pulls[(4, n_arms - 1)] >= 1  # the vanilla arm, in the 4-row tail bucket


@pytest.mark.parametrize("strategy", [None, CHAIN], ids=["vanilla", "chain"])
def test_long_tail_shrinks_per_bucket(setup, strategy):  # noqa: F811
  """``shrink_tail``: the tail moves to a smaller bucket each time its rows fit one (one loop
  per bucket, the last response alone at batch 1); outputs equal the single-shrink tail's."""
  model, drafter, engine, prompts, ref = setup
  out = {}
  for shrink_tail in (True, False):
    cfg = dataclasses.replace(engine.config, spec_threshold=8, batch_buckets=(1, 2, 4, 8),
                              shrink_tail=shrink_tail)
    eng = RolloutEngine(model, drafter, cfg, pool=engine.pool)
    res = eng.generate(prompts, force_strategy=strategy, speculative=strategy is not None)
    assert res.tokens == ref
    out[shrink_tail] = res.stats
  assert out[True]["shrinks"] > out[False]["shrinks"]
  if strategy is not None:  # rows running at the start of each speculative loop
    batches = out[True]["spec_batch"]
    assert len(batches) > 1 and batches[-1] == 1 and batches == sorted(batches, reverse=True)
    assert len(out[False]["spec_batch"]) == 1
