"""Speculative-decoding strategies and the bucketed epsilon-greedy bandit that picks one.

The best (depth, top-k, verify_tokens) depends on the batch size: a large batch is closer to
compute bound, so verifying many tree tokens costs real time, while at batch 1 verification is
nearly free and deep, wide trees pay off. TLT therefore keeps one bandit per batch-size bucket
and rewards an arm with its measured throughput ``accepted tokens x batch / step time``.

Usage::

  bandit = BucketedBandit([Strategy(4, 1, 5), Strategy(4, 4, 16)], buckets=(1, 2, 4, 8), epsilon=0.1)
  arm = bandit.select(batch_size=3)       # an index into the strategies
  bandit.update(3, arm, reward)
"""

from __future__ import annotations

import collections
import dataclasses

import numpy as np

from jaxsys.core.errors import ConfigError
from jaxsys.decoding.core import bucket_of  # noqa: F401  (re-exported for the bandit users)

__all__ = ["BucketedBandit", "bucket_of", "Strategy"]


@dataclasses.dataclass(frozen=True)
class Strategy:
  """Draft ``depth`` levels, expanding the ``topk`` best nodes per level; verify ``verify_tokens``
  tree nodes (root included). ``topk == 1`` is a chain (``verify_tokens == depth + 1``)."""
  depth: int
  topk: int
  verify_tokens: int

  def __post_init__(self):
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
    return f"{'chain' if self.is_chain else 'tree'}(d={self.depth},k={self.topk},v={self.verify_tokens})"

  @staticmethod
  def chain(depth: int) -> "Strategy":
    return Strategy(depth, 1, depth + 1)


class BucketedBandit:
  """Epsilon-greedy over strategies, one independent bandit per batch-size bucket.

  Every arm is tried once per bucket before exploitation starts; the value of an arm is the mean
  of its last ``window`` rewards (a sliding window, because the drafter and the policy drift).
  """

  def __init__(self, strategies, buckets, *, epsilon: float = 0.1, window: int = 50, seed: int = 0):
    if not strategies:
      raise ConfigError("strategies must not be empty")
    if not 0.0 <= epsilon <= 1.0:
      raise ConfigError(f"epsilon={epsilon} must be in [0, 1]")
    if window < 1:
      raise ConfigError(f"window={window} must be >= 1")
    self.strategies = tuple(strategies)
    self.buckets = tuple(sorted(buckets))
    self.epsilon = float(epsilon)
    self._rng = np.random.default_rng(seed)
    self._hist = {(b, a): collections.deque(maxlen=window)
                  for b in self.buckets for a in range(len(self.strategies))}
    self.pulls = collections.Counter()

  def value(self, batch_size: int, arm: int) -> float:
    h = self._hist[(bucket_of(batch_size, self.buckets), arm)]
    return float(np.mean(h)) if h else float("nan")

  def best(self, batch_size: int) -> int:
    b = bucket_of(batch_size, self.buckets)
    vals = [np.mean(self._hist[(b, a)]) if self._hist[(b, a)] else -np.inf
            for a in range(len(self.strategies))]
    return int(np.argmax(vals))

  def select(self, batch_size: int) -> int:
    b = bucket_of(batch_size, self.buckets)
    untried = [a for a in range(len(self.strategies)) if not self._hist[(b, a)]]
    if untried:
      arm = untried[0]
    elif self._rng.random() < self.epsilon:
      arm = int(self._rng.integers(len(self.strategies)))
    else:
      arm = self.best(batch_size)
    self.pulls[(b, arm)] += 1
    return arm

  def update(self, batch_size: int, arm: int, reward: float):
    if not np.isfinite(reward):
      raise ConfigError(f"reward={reward} must be finite")
    self._hist[(bucket_of(batch_size, self.buckets), arm)].append(float(reward))
