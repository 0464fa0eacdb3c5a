"""Speculative-decoding strategies and the bucketed bandit that picks one.

The best (depth, top-k, verify_tokens) depends on the batch size: a large batch is closer to
compute bound, so verifying many tree tokens costs real time, while at batch 1 verification is
nearly free and deep, wide trees pay off. TLT therefore keeps one bandit per batch-size bucket
and rewards an arm with its measured throughput ``accepted tokens x batch / step time``.

Options of :class:`BucketedBandit` (the defaults are the original epsilon-greedy bandit):

* ``policy``: ``"egreedy"`` (explore a random arm with probability ``epsilon``, else the best
  value) or ``"ucb1"`` (Auer et al. 2002: ``value + ucb_c * sqrt(2 ln N / n_a)`` with ``n_a`` the
  arm's rewards in the window and ``N`` their sum over the bucket's arms, as fastrl counts them).
  Both try every arm once per bucket first.
* ``value``: an arm's value over its sliding ``window`` of recent rewards: ``"mean"``,
  ``"median"`` (fastrl's epsilon-greedy and BEG) or ``"trimmed"`` (10% trimmed mean, fastrl's
  UCB1); the window forgets, because the drafter and the policy drift.
* ``mode="beg"``: fastrl's bucketed epsilon-greedy (``BucketedEpsilonGreedyMAB``). Arms are
  grouped by ``verify_tokens`` (the vanilla arm ``None`` verifies 1); the groups, largest verify
  width first, are pinned to the batch-size ranges ``[t_i, t_{i+1} - 1]`` of ``bs_thresholds``
  (the last range open-ended; one threshold per group), so a batch only ever picks among the
  arms of its range (a one-arm range is fixed). Statistics stay per batch-size bucket.
* ``token_budget``: arms whose ``verify_tokens x batch`` exceeds it are skipped (fastrl's 2048
  memory guard for its EG/UCB1; the narrowest arm when none fits).
* ``BucketedBandit.fastrl(...)`` / :func:`fastrl_strategies`: fastrl's defaults
  (``verl/trainer/config/fastrl_trainer.yaml``): strategies 8_4_48 (the base config), 8_4_32,
  8_4_16, 8_4_8 (steps_topk_verify), BEG with thresholds (1, 2, 5, 21), epsilon 0.1, the median
  of a 300-reward window (sglang's ``speculative_mab_window_size``), and one bucket per batch
  size up to 32, then steps of 8 to 128 and of 32 to 256 (fastrl's batch-size groups).

Usage::

  bandit = BucketedBandit([Strategy(4, 1, 5), Strategy(4, 4, 16)], buckets=(1, 2, 4, 8), epsilon=0.1)
  arm = bandit.select(batch_size=3)       # an index into the strategies
  bandit.update(3, arm, reward)
  beg = BucketedBandit.fastrl()           # fastrl's BEG over its four tree strategies
"""

from __future__ import annotations

import collections
import dataclasses

import numpy as np

from jaxsys.core.errors import ConfigError, check_one_of
from jaxsys.decoding.core import bucket_of  # noqa: F401  (re-exported for the bandit users)

__all__ = [
    "BANDIT_MODES", "BANDIT_POLICIES", "BANDIT_VALUES", "BucketedBandit", "bucket_of",
    "FASTRL_BS_THRESHOLDS", "FASTRL_BUCKETS", "fastrl_strategies", "Strategy",
]

BANDIT_POLICIES = ("egreedy", "ucb1")
BANDIT_VALUES = ("mean", "median", "trimmed")
BANDIT_MODES = ("bucketed", "beg")
FASTRL_BS_THRESHOLDS = (1, 2, 5, 21)
# fastrl's MAB batch-size groups: 1..31, 32..120 step 8, 128..256 step 32.
FASTRL_BUCKETS = tuple(range(1, 32)) + tuple(range(32, 128, 8)) + tuple(range(128, 257, 32))


@dataclasses.dataclass(frozen=True)
class Strategy:
  """Draft ``depth`` levels, expanding the ``topk`` best nodes per level; verify ``verify_tokens``
  tree nodes (root included). ``topk == 1`` is a chain (``verify_tokens == depth + 1``).

  ``lookup > 0``: no drafter model; the chain is copied from the row's own history and its
  reference tokens after the longest match of up to ``lookup`` tokens (``speculative.lookup``).
  """
  depth: int
  topk: int
  verify_tokens: int
  lookup: int = 0

  def __post_init__(self):
    if self.lookup < 0:
      raise ConfigError(f"lookup={self.lookup} must be >= 0 (0: the drafter model drafts)")
    if self.lookup and (self.topk != 1 or self.verify_tokens != self.depth + 1):
      raise ConfigError(f"a lookup strategy is a chain: topk={self.topk} must be 1 and "
                        f"verify_tokens={self.verify_tokens} must be depth + 1 = {self.depth + 1}")
    if self.depth < 1:
      raise ConfigError(f"depth={self.depth} must be >= 1")
    if self.topk < 1:
      raise ConfigError(f"topk={self.topk} must be >= 1")
    if self.verify_tokens < 2 or self.verify_tokens > self.num_candidates + 1:
      raise ConfigError(f"verify_tokens={self.verify_tokens} must be in [2, {self.num_candidates + 1}] "
                        f"for depth={self.depth}, topk={self.topk}")

  @property
  def num_candidates(self) -> int:
    """Draft candidates produced: ``topk`` at depth 1, ``topk**2`` per deeper level."""
    return self.topk + (self.depth - 1) * self.topk * self.topk

  @property
  def is_chain(self) -> bool:
    return self.topk == 1

  @property
  def name(self) -> str:
    if self.lookup:
      return f"lookup(d={self.depth},n={self.lookup})"
    return f"{'chain' if self.is_chain else 'tree'}(d={self.depth},k={self.topk},v={self.verify_tokens})"

  @staticmethod
  def chain(depth: int) -> "Strategy":
    return Strategy(depth, 1, depth + 1)

  @staticmethod
  def lookup_chain(depth: int, ngram: int = 3) -> "Strategy":
    """A chain of ``depth`` tokens copied after the longest match of up to ``ngram`` tokens."""
    return Strategy(depth, 1, depth + 1, lookup=ngram)


def fastrl_strategies() -> tuple[Strategy, ...]:
  """fastrl's default arms: ``spec_steps=8, topk=4`` verifying 48 (its base config), 32, 16, 8."""
  return tuple(Strategy(8, 4, v) for v in (48, 32, 16, 8))


def _verify_width(arm) -> int:
  return 1 if arm is None else arm.verify_tokens  # the vanilla arm verifies its one token


def _trimmed_mean(x, frac: float = 0.1) -> float:
  v = np.sort(np.asarray(x, np.float64))
  k = int(len(v) * frac)
  return float(v[k:len(v) - k].mean()) if len(v) > 2 * k else float(v.mean())


class BucketedBandit:
  """A bandit over strategies, one independent bandit per batch-size bucket (see the module
  docstring for ``policy``, ``value``, ``mode="beg"`` and ``token_budget``).

  Every arm is tried once per bucket before exploitation starts; the value of an arm is taken
  over its last ``window`` rewards (a sliding window, because the drafter and the policy drift).
  """

  def __init__(self, strategies, buckets, *, epsilon: float = 0.1, window: int = 50, seed: int = 0,
               policy: str = "egreedy", value: str = "mean", mode: str = "bucketed",
               bs_thresholds=None, ucb_c: float = 1.0, token_budget: int | None = None):
    if not strategies:
      raise ConfigError("strategies must not be empty")
    if not 0.0 <= epsilon <= 1.0:
      raise ConfigError(f"epsilon={epsilon} must be in [0, 1]")
    if window < 1:
      raise ConfigError(f"window={window} must be >= 1")
    check_one_of("policy", policy, BANDIT_POLICIES)
    check_one_of("value", value, BANDIT_VALUES)
    check_one_of("mode", mode, BANDIT_MODES)
    if not ucb_c >= 0:
      raise ConfigError(f"ucb_c={ucb_c} must be >= 0")
    if token_budget is not None and token_budget < 1:
      raise ConfigError(f"token_budget={token_budget} must be >= 1 (or None: no budget)")
    self.strategies = tuple(strategies)
    self.buckets = tuple(sorted(buckets))
    self.epsilon = float(epsilon)
    self.policy, self.value_kind, self.mode = policy, value, mode
    self.ucb_c, self.token_budget = float(ucb_c), token_budget
    self._rng = np.random.default_rng(seed)
    self._hist = {(b, a): collections.deque(maxlen=window)
                  for b in self.buckets for a in range(len(self.strategies))}
    self.pulls = collections.Counter()
    self.ranges = self._pin_ranges(bs_thresholds) if mode == "beg" else None

  @classmethod
  def fastrl(cls, strategies=None, buckets=FASTRL_BUCKETS, **overrides) -> "BucketedBandit":
    """fastrl's default bandit: BEG over :func:`fastrl_strategies` with thresholds (1, 2, 5, 21),
    epsilon 0.1 and the median of a 300-reward window; ``overrides`` replace any of these."""
    kw = dict(mode="beg", bs_thresholds=FASTRL_BS_THRESHOLDS, epsilon=0.1, window=300,
              value="median", policy="egreedy")
    return cls(fastrl_strategies() if strategies is None else strategies, buckets,
               **{**kw, **overrides})

  def _pin_ranges(self, thresholds) -> tuple[tuple[int, float, tuple[int, ...]], ...]:
    """``(min_batch, max_batch, arms)`` per verify-width group, widest group at the smallest
    batches (fastrl's ``_create_buckets``)."""
    widths = sorted({_verify_width(a) for a in self.strategies}, reverse=True)
    if thresholds is None:
      raise ConfigError(f"mode='beg' needs bs_thresholds: one per verify width {widths}")
    t = tuple(int(x) for x in thresholds)
    if len(t) != len(widths):
      raise ConfigError(f"bs_thresholds={t} must have one entry per distinct verify_tokens "
                        f"{widths} (got {len(t)}, need {len(widths)})")
    if t[0] < 1 or any(b <= a for a, b in zip(t, t[1:])):
      raise ConfigError(f"bs_thresholds={t} must be strictly increasing and start at >= 1")
    out = []
    for i, w in enumerate(widths):
      hi = t[i + 1] - 1 if i + 1 < len(t) else float("inf")
      out.append((t[i], hi, tuple(a for a, s in enumerate(self.strategies) if _verify_width(s) == w)))
    return tuple(out)

  def candidates(self, batch_size: int) -> tuple[int, ...]:
    """The arms a batch of ``batch_size`` may pick: its pinned group (BEG), else every arm within
    the token budget."""
    if self.ranges is not None:
      for lo, hi, arms in self.ranges:
        if lo <= batch_size <= hi:
          return arms
      return tuple(range(len(self.strategies)))  # below the first threshold: fastrl's fallback
    arms = tuple(range(len(self.strategies)))
    if self.token_budget is None:
      return arms
    ok = tuple(a for a in arms if _verify_width(self.strategies[a]) * batch_size <= self.token_budget)
    return ok or (min(arms, key=lambda a: _verify_width(self.strategies[a])),)

  def _value(self, h) -> float:
    if not h:
      return float("nan")
    if self.value_kind == "median":
      return float(np.median(h))
    return _trimmed_mean(h) if self.value_kind == "trimmed" else float(np.mean(h))

  def value(self, batch_size: int, arm: int) -> float:
    return self._value(self._hist[(bucket_of(batch_size, self.buckets), arm)])

  def best(self, batch_size: int) -> int:
    b = bucket_of(batch_size, self.buckets)
    cands = self.candidates(batch_size)
    vals = [self._value(self._hist[(b, a)]) if self._hist[(b, a)] else -np.inf for a in cands]
    return int(cands[int(np.argmax(vals))])

  def _ucb(self, b: int, cands) -> int:
    total = sum(len(self._hist[(b, a)]) for a in range(len(self.strategies)))
    scores = [self._value(self._hist[(b, a)])
              + self.ucb_c * np.sqrt(2.0 * np.log(total) / len(self._hist[(b, a)])) for a in cands]
    return int(cands[int(np.argmax(scores))])

  def select(self, batch_size: int) -> int:
    b = bucket_of(batch_size, self.buckets)
    cands = self.candidates(batch_size)
    untried = [a for a in cands if not self._hist[(b, a)]]
    if len(cands) == 1:
      arm = cands[0]
    elif untried:
      arm = untried[0]
    elif self.policy == "ucb1":
      arm = self._ucb(b, cands)
    elif self._rng.random() < self.epsilon:
      arm = int(cands[int(self._rng.integers(len(cands)))])
    else:
      arm = self.best(batch_size)
    self.pulls[(b, arm)] += 1
    return arm

  def update(self, batch_size: int, arm: int, reward: float):
    if not np.isfinite(reward):
      raise ConfigError(f"reward={reward} must be finite")
    self._hist[(bucket_of(batch_size, self.buckets), arm)].append(float(reward))
