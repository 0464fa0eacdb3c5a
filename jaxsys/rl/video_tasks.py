"""Verifiable video QA for RL on long videos (deterministic by seed), with exact-match rewards.

Built on the synthetic videos of ``jaxsys.data.video`` (haystack frames of noise + distractor
glyphs; a "marked" frame carries the marker on every patch and two glyphs). Three kinds:

* ``needle``: one marked frame; answer its two glyphs ``c_0 c_1`` (V-NIAH).
* ``count``: ``k`` marked frames (``1 <= k <= min(9, F)``); answer the digit ``k``.
* ``order``: two marked frames; answer the first glyph of the earlier one, then of the later one.

Prompt (one row): ``BOS, <frame tokens>, TASK, ASK`` with ``TASK`` one of ``NEEDLE``, ``COUNT``,
``ORDER``; the response is the answer digits then ``EOS``.
``reward = 0.9 * accuracy + 0.1 * format`` (LongVILA-R1's r1v reward): ``accuracy`` is 1 for an
exact answer, ``format`` is 1 when the response is digits followed by one ``EOS``.

Usage::

  tasks = VideoTaskSampler(spec, n_frames=32, seed=0)
  ex = tasks.sample(4)[0]          # VideoExample(kind, frames [F, patches, dim], answer)
  r = reward(ex, response_tokens)
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxsys.core.errors import ConfigError, check_min, check_one_of
from jaxsys.data import video

__all__ = [
    "accuracy", "format_ok", "KINDS", "make_example", "prompt_len", "prompt_tokens", "reward",
    "TASK_TOKEN", "TEXT_AFTER", "VideoExample", "VideoTaskSampler", "VOCAB",
]

NEEDLE, COUNT, ORDER = video.VOCAB_SIZE, video.VOCAB_SIZE + 1, video.VOCAB_SIZE + 2
VOCAB = video.VOCAB_SIZE + 4  # digits, video specials, task tokens (one spare)
KINDS = ("needle", "count", "order")
TASK_TOKEN = {"needle": NEEDLE, "count": COUNT, "order": ORDER}
TEXT_AFTER = 2  # TASK ASK
ACC_WEIGHT, FORMAT_WEIGHT = 0.9, 0.1


@dataclasses.dataclass(frozen=True)
class VideoExample:
  kind: str
  frames: np.ndarray            # float32[F, patches, patch_dim]
  answer: tuple[int, ...]       # digits, without EOS

  @property
  def target(self) -> tuple[int, ...]:
    return self.answer + (video.EOS,)


def make_example(spec: video.VideoSpec, rng: np.random.Generator, kind: str, n_frames: int,
                 depth: float | None = None) -> VideoExample:
  """One example; ``depth`` (``needle`` only) puts the needle at ``round(depth * (F - 1))``."""
  check_one_of("kind", kind, KINDS)
  if n_frames < 2:
    raise ConfigError(f"{n_frames=} must be >= 2 for the {kind!r} task")
  frames = video.haystack_frames(spec, rng, n_frames)
  codes = rng.integers(0, spec.num_classes, size=(2, 2))
  if kind == "needle":
    at = int(rng.integers(n_frames)) if depth is None else int(round(float(depth) * (n_frames - 1)))
    video.mark_frame(spec, rng, frames[at], codes[0])
    answer = tuple(int(c) for c in codes[0])
  elif kind == "count":
    k = int(rng.integers(1, min(9, n_frames) + 1))
    for i in rng.choice(n_frames, size=k, replace=False):
      video.mark_frame(spec, rng, frames[i], rng.integers(0, spec.num_classes, size=2))
    answer = (k,)
  else:
    i, j = np.sort(rng.choice(n_frames, size=2, replace=False))
    video.mark_frame(spec, rng, frames[i], codes[0])
    video.mark_frame(spec, rng, frames[j], codes[1])
    answer = (int(codes[0, 0]), int(codes[1, 0]))
  return VideoExample(kind, frames, answer)


@dataclasses.dataclass
class VideoTaskSampler:
  """Examples of ``kinds`` with ``n_frames`` frames each (one frame count per RL step keeps
  shapes static; pass another sampler for another count)."""
  spec: video.VideoSpec = dataclasses.field(default_factory=video.VideoSpec)
  n_frames: int = 16
  kinds: tuple[str, ...] = KINDS
  seed: int = 0

  def __post_init__(self):
    check_min(self, 2, "n_frames")
    if not self.kinds:
      raise ConfigError("kinds must name at least one task kind")
    for k in self.kinds:
      check_one_of("kinds", k, KINDS)
    self.rng = np.random.default_rng(self.seed)

  def sample(self, n: int, rng=None) -> list[VideoExample]:
    rng = rng or self.rng
    return [make_example(self.spec, rng, self.kinds[int(rng.integers(len(self.kinds)))], self.n_frames)
            for _ in range(n)]

  @property
  def max_response(self) -> int:
    return 3  # two digits + EOS


def prompt_tokens(kind: str, n_frames: int, tokens_per_frame: int):
  """``(tokens int32[P], frame_slot int32[P])`` of the prompt ``BOS, FRAME*, TASK, ASK``."""
  nf = n_frames * tokens_per_frame
  tokens = np.concatenate([[video.BOS], np.full(nf, video.FRAME), [TASK_TOKEN[kind], video.ASK]])
  slot = np.full(tokens.shape, -1, np.int32)
  slot[1:1 + nf] = np.arange(nf)
  return tokens.astype(np.int32), slot


def prompt_len(n_frames: int, tokens_per_frame: int) -> int:
  return 1 + n_frames * tokens_per_frame + TEXT_AFTER


def format_ok(response) -> bool:
  """Digits followed by exactly one EOS (and nothing after it)."""
  r = list(response)
  return len(r) >= 2 and r[-1] == video.EOS and all(0 <= t <= 9 for t in r[:-1])


def accuracy(example: VideoExample, response) -> float:
  r = list(response)
  if r and r[-1] == video.EOS:
    r = r[:-1]
  return float(tuple(r) == example.answer)


def reward(example: VideoExample, response) -> float:
  """``0.9 * exact-match accuracy + 0.1 * format``."""
  return ACC_WEIGHT * accuracy(example, response) + FORMAT_WEIGHT * float(format_ok(response))
