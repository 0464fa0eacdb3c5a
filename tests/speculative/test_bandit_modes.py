"""Bandit modes as fastrl's: UCB1, BEG (verify widths pinned to batch-size ranges), median values."""

import numpy as np
import pytest

from jaxsys.core.errors import ConfigError
from jaxsys.speculative.bandit import (FASTRL_BS_THRESHOLDS, BucketedBandit, Strategy,
                                       fastrl_strategies)

ARMS = [Strategy.chain(2), Strategy.chain(4), Strategy(3, 2, 6)]
TABLE = [1.0, 3.0, 2.0]  # deterministic reward per arm


def _ucb_reference(table, steps, c=1.0):
  """UCB1 written out: each arm once, then argmax mean + c sqrt(2 ln N / n)."""
  sums, pulls, picks = np.zeros(len(table)), np.zeros(len(table)), []
  for t in range(steps):
    if t < len(table):
      a = t
    else:
      a = int(np.argmax(sums / pulls + c * np.sqrt(2 * np.log(pulls.sum()) / pulls)))
    sums[a] += table[a]
    pulls[a] += 1
    picks.append(a)
  return picks


def test_ucb1_explores_every_arm_then_exploits_the_best():
  bandit = BucketedBandit(ARMS, (1,), policy="ucb1", window=1000)
  picks = []
  for _ in range(300):
    a = bandit.select(1)
    bandit.update(1, a, TABLE[a])
    picks.append(a)
  assert picks[:3] == [0, 1, 2]  # every arm once first
  # 4th pull: equal bonuses sqrt(2 ln 3), so the best mean (arm 1); at N = 7 arm 2's bonus
  # (n = 1) outweighs its gap of 1: 2 + sqrt(2 ln 7) = 3.97 > 3 + sqrt(2 ln 7 / 5) = 3.88
  assert picks[3:8] == [1, 1, 1, 1, 2]
  assert picks == _ucb_reference(TABLE, 300)
  counts = np.bincount(picks, minlength=3)
  assert counts[1] > 0.9 * 300 and counts[2] > counts[0] >= 1
  assert bandit.best(1) == 1
  # ucb_c = 0 is greedy after the first round: arm 1 only
  greedy = BucketedBandit(ARMS, (1,), policy="ucb1", ucb_c=0.0)
  for _ in range(20):
    a = greedy.select(1)
    greedy.update(1, a, TABLE[a])
  assert [greedy.pulls[(1, a)] for a in range(3)] == [1, 18, 1]


def test_beg_pins_verify_groups_to_batch_ranges():
  b = BucketedBandit.fastrl()
  assert [s.verify_tokens for s in b.strategies] == [48, 32, 16, 8]
  assert all((s.depth, s.topk) == (8, 4) for s in b.strategies)
  assert FASTRL_BS_THRESHOLDS == (1, 2, 5, 21)
  expect = {1: 0, 2: 1, 4: 1, 5: 2, 20: 2, 21: 3, 64: 3, 256: 3}  # widest group at batch 1
  for batch, arm in expect.items():
    assert b.candidates(batch) == (arm,)
    assert all(b.select(batch) == arm for _ in range(5))  # a one-arm range never explores
  # Two arms share width 16 at batches 1-2; a chain (5) at 3-8; the vanilla arm (width 1) above.
  arms = [Strategy(4, 4, 16), Strategy(3, 4, 16), Strategy.chain(4), None]
  beg = BucketedBandit(arms, (2, 8, 32), mode="beg", bs_thresholds=(1, 3, 9), value="median",
                       epsilon=0.2, seed=0)
  assert beg.candidates(2) == (0, 1) and beg.candidates(3) == (2,) and beg.candidates(9) == (3,)
  seen = set()
  for _ in range(200):
    a = beg.select(1)
    seen.add(a)
    beg.update(1, a, [1.0, 2.0][a])
  assert seen == {0, 1} and beg.best(1) == 1
  assert beg.pulls[(2, 1)] > 0.8 * 200
  assert beg.select(5) == 2 and beg.select(20) == 3


def test_median_and_trimmed_values_and_window():
  b = BucketedBandit(ARMS, (1,), value="median", window=3)
  for r in (50.0, 1.0, 100.0, 2.0):  # the window keeps the last 3: 1, 100, 2
    b.update(1, 0, r)
  assert b.value(1, 0) == 2.0
  t = BucketedBandit(ARMS, (1,), value="trimmed")
  for r in list(range(1, 10)) + [1000]:  # 10% trimmed: drop 1 and 1000 -> mean(2..9)
    t.update(1, 0, float(r))
  assert t.value(1, 0) == pytest.approx(5.5)
  # the median is robust to one outlier where the mean is not
  for kind, best in (("median", 1), ("mean", 0)):
    m = BucketedBandit(ARMS[:2], (1,), value=kind, epsilon=0.0)
    for r in (1.0, 1.0, 100.0):
      m.update(1, 0, r)
    for r in (2.0, 2.0, 2.0):
      m.update(1, 1, r)
    assert m.best(1) == best and m.select(1) == best


def test_token_budget_filters_wide_arms():
  b = BucketedBandit([Strategy(8, 4, 48), Strategy(8, 4, 8)], (1, 2, 16), token_budget=64)
  assert b.candidates(1) == (0, 1) and b.candidates(2) == (1,)
  assert b.candidates(16) == (1,)  # nothing fits 64: the narrowest arm


def test_bandit_mode_errors():
  for kw, match in [({"policy": "ucb2"}, "policy"), ({"value": "max"}, "value"),
                    ({"mode": "tree"}, "mode"), ({"ucb_c": -1.0}, "ucb_c"),
                    ({"token_budget": 0}, "token_budget"),
                    ({"mode": "beg"}, "bs_thresholds"),
                    ({"mode": "beg", "bs_thresholds": (1, 2)}, "one entry per distinct"),
                    ({"mode": "beg", "bs_thresholds": (1, 4, 4)}, "strictly increasing")]:
    with pytest.raises(ConfigError, match=match):
      BucketedBandit(ARMS, (1,), **kw)
  with pytest.raises(ConfigError, match="bs_thresholds"):
    BucketedBandit.fastrl(bs_thresholds=(1, 2, 5))
  assert len(fastrl_strategies()) == 4
