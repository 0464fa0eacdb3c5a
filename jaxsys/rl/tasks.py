"""Verifiable synthetic RL tasks with a long-tailed response length (deterministic by seed).

Token layout (vocab ``VOCAB``): numbers ``0 .. 63`` are tokens ``0 .. 63``; ``BOS``, ``SEP``,
``EOS``, ``PLUS``, ``EQ`` follow.

* ``count`` (retrieval): ``BOS a b SEP -> a, a+1, ..., b, EOS``. The model must retrieve the end
  ``b`` from the prompt to stop; the span ``b - a + 1`` is long-tailed (most short, a few long),
  which is what makes RL rollouts wait on a few long responses.
* ``add`` (arithmetic): ``BOS x PLUS y EQ -> x+y, EOS`` with ``x, y < 8``.

``reward(task, prompt, response)`` is the fraction of the reference ``answer + [EOS]`` reproduced
position by position (1.0 = exact), so a GRPO group has a graded, verifiable signal.

Usage::

  tasks = TaskSampler(long_fraction=0.15, long_span=(24, 40), seed=0)
  batch = tasks.sample(8)             # list of TaskExample(kind, prompt, answer)
  r = reward(batch[0], response_tokens)
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxsys.core.errors import ConfigError

__all__ = [
    "add_example", "count_example", "LongTailMix", "NUM", "reward", "sft_batch", "TaskExample",
    "TaskSampler", "VOCAB",
]

NUM = 64
BOS, SEP, EOS, PLUS, EQ = 64, 65, 66, 67, 68
VOCAB = 72


@dataclasses.dataclass(frozen=True)
class TaskExample:
  kind: str
  prompt: tuple[int, ...]
  answer: tuple[int, ...]  # reference response without EOS

  @property
  def target(self) -> tuple[int, ...]:
    return self.answer + (EOS,)


def count_example(a: int, b: int) -> TaskExample:
  if not 0 <= a <= b < NUM:
    raise ConfigError(f"count task needs 0 <= a={a} <= b={b} < {NUM}")
  return TaskExample("count", (BOS, a, b, SEP), tuple(range(a, b + 1)))


def add_example(x: int, y: int) -> TaskExample:
  if not (0 <= x < 8 and 0 <= y < 8):
    raise ConfigError(f"add task needs 0 <= x={x}, y={y} < 8")
  return TaskExample("add", (BOS, x, PLUS, y, EQ), (x + y,))


@dataclasses.dataclass
class TaskSampler:
  """Mixture of ``count`` (long-tailed spans) and ``add`` examples."""
  long_fraction: float = 0.15
  short_span: tuple[int, int] = (1, 6)
  long_span: tuple[int, int] = (24, 40)
  add_fraction: float = 0.2
  seed: int = 0

  def __post_init__(self):
    if not 0 <= self.long_fraction <= 1 or not 0 <= self.add_fraction <= 1:
      raise ConfigError(f"long_fraction={self.long_fraction} and add_fraction={self.add_fraction} must be in [0, 1]")
    for name in ("short_span", "long_span"):
      lo, hi = getattr(self, name)
      if not 1 <= lo <= hi <= NUM:
        raise ConfigError(f"{name}={getattr(self, name)} must satisfy 1 <= lo <= hi <= {NUM}")
    self.rng = np.random.default_rng(self.seed)

  def one(self, rng=None) -> TaskExample:
    rng = rng or self.rng
    if rng.random() < self.add_fraction:
      return add_example(int(rng.integers(8)), int(rng.integers(8)))
    lo, hi = self.long_span if rng.random() < self.long_fraction else self.short_span
    span = int(rng.integers(lo, hi + 1))
    a = int(rng.integers(0, NUM - span + 1))
    return count_example(a, a + span - 1)

  def sample(self, n: int, rng=None) -> list[TaskExample]:
    return [self.one(rng) for _ in range(n)]

  @property
  def max_prompt(self) -> int:
    return 5

  @property
  def max_response(self) -> int:
    return self.long_span[1] + 1


def reward(example: TaskExample, response) -> float:
  """Fraction of ``answer + [EOS]`` matched position by position (extra tokens count as wrong)."""
  want = example.target
  got = list(response)
  hits = sum(1 for i, t in enumerate(want) if i < len(got) and got[i] == t)
  return hits / max(len(want), len(got))


def sft_batch(examples, seq_len: int):
  """Teacher-forcing arrays: ``tokens int[n, seq_len]``, ``loss_mask [n, seq_len]`` (1 on the
  positions whose next token is a response token), right-padded with EOS."""
  n = len(examples)
  tokens = np.full((n, seq_len), EOS, np.int32)
  mask = np.zeros((n, seq_len), np.float32)
  for i, ex in enumerate(examples):
    seq = ex.prompt + ex.target
    if len(seq) > seq_len:
      raise ConfigError(f"example of length {len(seq)} exceeds seq_len={seq_len}")
    tokens[i, :len(seq)] = seq
    mask[i, len(ex.prompt) - 1:len(seq) - 1] = 1.0
  return tokens, mask


@dataclasses.dataclass
class LongTailMix:
  """Prompts for the shipped tiny LM (``jaxsys.data.synthetic``) with a long-tailed answer length.

  Most prompts have short answers (``arith``: 1-3 digits, ``recall``: one value; prompts of
  ``recall_length`` tokens), a ``long_fraction`` are ``copy`` of ``long_copy`` tokens, so a
  rollout waits on a few long responses. Examples are ``synthetic.Example`` (``prompt``,
  ``answer`` with EOS); score them with ``synthetic.reward`` (1.0 = exact answer).
  """
  long_fraction: float = 0.15
  long_copy: tuple[int, int] = (40, 60)
  recall_length: int = 40
  recall_keys: int = 4
  arith_fraction: float = 0.5   # of the short prompts; the rest are recall
  seed: int = 0

  def __post_init__(self):
    if not 0 <= self.long_fraction <= 1 or not 0 <= self.arith_fraction <= 1:
      raise ConfigError(f"long_fraction={self.long_fraction} and arith_fraction={self.arith_fraction} "
                        "must be in [0, 1]")
    lo, hi = self.long_copy
    if not 1 <= lo <= hi:
      raise ConfigError(f"long_copy={self.long_copy} must satisfy 1 <= lo <= hi")
    self.rng = np.random.default_rng(self.seed)

  def one(self, rng=None):
    from jaxsys.data import synthetic
    rng = rng or self.rng
    if rng.random() < self.long_fraction:
      n = int(rng.integers(self.long_copy[0], self.long_copy[1] + 1))
      return synthetic.make_example("copy", rng, 2 * n + 4, n=n)
    if rng.random() < self.arith_fraction:
      return synthetic.make_example("arith", rng)
    return synthetic.make_example("recall", rng, self.recall_length, n_keys=self.recall_keys, n_queries=1)

  def sample(self, n: int, rng=None) -> list:
    return [self.one(rng) for _ in range(n)]

  @property
  def max_prompt(self) -> int:
    return max(self.long_copy[1] + 3, self.recall_length)

  @property
  def max_response(self) -> int:
    return self.long_copy[1] + 1
