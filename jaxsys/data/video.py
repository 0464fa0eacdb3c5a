"""Synthetic long-video QA, deterministic by seed: frames interleaved with text tokens.

A video is ``n`` frames of ``patches x patch_dim`` features (a stand-in for pixels; a frame
encoder turns each into ``tokens_per_frame`` tokens). Haystack frames are noise plus two random
"glyph" patches (class prototypes). The needle frame carries a visual marker on every patch and
glyphs spelling a code ``(c_0, c_1)``; the question asks for the code, the answer is the two
digit tokens ``c_0 c_1``. A model must find the marked frame among ``n`` and read its glyphs:
video needle-in-a-haystack (LongVILA, Chen et al. 2024), at CPU size.

Sequence layout (one row): ``BOS, <frame tokens of frame 0..n-1>, Q, ASK, c_0, c_1, EOS, pad``.
Frame slots hold the placeholder token FRAME and ``frame_slot = f * tokens_per_frame + t``
(index into the flattened frame tokens); text slots have ``frame_slot = -1``. ``loss_mask``
is 1 on the answer digits (and EOS); padding has ``segment_ids = -1``.

Usage::

  spec = VideoSpec()
  batch = video_qa_batch(spec, seed=0, step=3, batch_size=8, n_frames=(4, 8), seq_len=32)
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxsys.core.errors import ConfigError

__all__ = [
    "ANSWER_LEN", "haystack_frames", "layout_row", "make_frames", "mark_frame", "PROMPT_LEN",
    "QUESTION_LEN", "seq_len_for", "video_qa_batch", "VideoSpec", "VOCAB_SIZE",
]

# Vocabulary: digits 0..9 for codes, then specials.
PAD, BOS, EOS, FRAME, Q, ASK = 10, 11, 12, 13, 14, 15
VOCAB_SIZE = 16
PROMPT_LEN = 1            # BOS
QUESTION_LEN = 2          # Q ASK
ANSWER_LEN = 3            # c_0 c_1 EOS


@dataclasses.dataclass(frozen=True)
class VideoSpec:
  """Frame features and the code alphabet."""
  patches: int = 4
  patch_dim: int = 8
  tokens_per_frame: int = 2
  num_classes: int = 8
  noise: float = 0.3
  seed: int = 1234  # fixes the marker and glyph prototypes (the "visual world")

  def __post_init__(self):
    if self.patches % self.tokens_per_frame:
      raise ConfigError(f"patches={self.patches} must be divisible by "
                        f"tokens_per_frame={self.tokens_per_frame}")
    if not 2 <= self.num_classes <= 10:
      raise ConfigError(f"num_classes={self.num_classes} must be in [2, 10] (digit tokens)")
    if self.tokens_per_frame < 2:
      raise ConfigError(f"tokens_per_frame={self.tokens_per_frame} must be >= 2 (one glyph per token)")

  def world(self):
    rng = np.random.default_rng(self.seed)
    marker = rng.standard_normal(self.patch_dim).astype(np.float32)
    marker *= 2.0 / np.linalg.norm(marker)
    glyphs = rng.standard_normal((self.num_classes, self.patch_dim)).astype(np.float32)
    glyphs *= 2.0 / np.linalg.norm(glyphs, axis=-1, keepdims=True)
    return marker, glyphs


def seq_len_for(n_frames: int, spec: VideoSpec) -> int:
  """Tokens of one sample with ``n_frames`` frames (before padding)."""
  return PROMPT_LEN + n_frames * spec.tokens_per_frame + QUESTION_LEN + ANSWER_LEN


def make_frames(spec: VideoSpec, rng: np.random.Generator, n_frames: int, depth: float, code):
  """``(frames float32[n, patches, patch_dim], needle_index)``; needle at ``round(depth*(n-1))``."""
  marker, glyphs = spec.world()
  frames = spec.noise * rng.standard_normal((n_frames, spec.patches, spec.patch_dim)).astype(np.float32)
  distract = rng.integers(0, spec.num_classes, size=(n_frames, 2))
  # glyph j sits in the first patch of frame token j, so each pooled token carries one glyph
  g0, g1 = 0, spec.patches // spec.tokens_per_frame
  frames[:, g0] += glyphs[distract[:, 0]]
  frames[:, g1] += glyphs[distract[:, 1]]
  needle = int(round(float(depth) * (n_frames - 1)))
  frames[needle, g0] = glyphs[code[0]] + spec.noise * rng.standard_normal(spec.patch_dim)
  frames[needle, g1] = glyphs[code[1]] + spec.noise * rng.standard_normal(spec.patch_dim)
  frames[needle] += marker
  return frames, needle


def haystack_frames(spec: VideoSpec, rng: np.random.Generator, n_frames: int) -> np.ndarray:
  """``float32[n, patches, patch_dim]`` haystack frames (noise + two distractor glyphs), no needle."""
  _, glyphs = spec.world()
  frames = spec.noise * rng.standard_normal((n_frames, spec.patches, spec.patch_dim)).astype(np.float32)
  distract = rng.integers(0, spec.num_classes, size=(n_frames, 2))
  frames[:, 0] += glyphs[distract[:, 0]]
  frames[:, spec.patches // spec.tokens_per_frame] += glyphs[distract[:, 1]]
  return frames


def mark_frame(spec: VideoSpec, rng: np.random.Generator, frame: np.ndarray, code) -> None:
  """Turns ``frame [patches, patch_dim]`` into a needle in place: the marker on every patch and
  the glyphs of ``code (c_0, c_1)`` in the first patch of each of its two frame tokens."""
  marker, glyphs = spec.world()
  g1 = spec.patches // spec.tokens_per_frame
  frame[0] = glyphs[code[0]] + spec.noise * rng.standard_normal(spec.patch_dim)
  frame[g1] = glyphs[code[1]] + spec.noise * rng.standard_normal(spec.patch_dim)
  frame += marker


def layout_row(n_frames: int, spec: VideoSpec, seq_len: int, code=(0, 0)) -> dict:
  """Token ids, frame slots, loss mask, positions and segment ids of one padded row."""
  need = seq_len_for(n_frames, spec)
  if need > seq_len:
    raise ConfigError(f"seq_len={seq_len} is too short for n_frames={n_frames} (needs {need})")
  tpf = spec.tokens_per_frame
  tokens = np.full(seq_len, PAD, np.int32)
  slot = np.full(seq_len, -1, np.int32)
  loss = np.zeros(seq_len, np.float32)
  seg = np.full(seq_len, -1, np.int32)
  tokens[0] = BOS
  nf = n_frames * tpf
  tokens[1:1 + nf] = FRAME
  slot[1:1 + nf] = np.arange(nf)
  i = 1 + nf
  tokens[i:i + 2] = (Q, ASK)
  tokens[i + 2:i + 5] = (code[0], code[1], EOS)
  loss[i + 2:i + 5] = 1.0
  seg[:need] = 0
  return {"tokens": tokens, "frame_slot": slot, "loss_mask": loss,
          "positions": np.arange(seq_len, dtype=np.int32), "segment_ids": seg,
          "answer_start": np.int32(i + 2)}


def video_qa_batch(spec: VideoSpec, *, seed: int, step: int, batch_size: int, n_frames,
                   seq_len: int, max_frames: int | None = None, depths=None) -> dict:
  """A batch of needle-in-a-video QA rows (a pure function of ``seed`` and ``step``).

  ``n_frames``: an int or an inclusive range ``(lo, hi)``; ``max_frames`` (default ``hi``)
  pads the frames array so shapes stay static. ``depths``: fixed depth per row (or random).
  """
  lo, hi = (n_frames, n_frames) if isinstance(n_frames, int) else n_frames
  max_frames = max_frames or hi
  if hi > max_frames:
    raise ConfigError(f"n_frames up to {hi} exceeds max_frames={max_frames}")
  rng = np.random.default_rng([seed, step])
  rows, frames = [], np.zeros((batch_size, max_frames, spec.patches, spec.patch_dim), np.float32)
  codes = rng.integers(0, spec.num_classes, size=(batch_size, 2))
  for i in range(batch_size):
    n = int(rng.integers(lo, hi + 1))
    depth = rng.random() if depths is None else depths[i]
    f, _ = make_frames(spec, rng, n, depth, codes[i])
    frames[i, :n] = f
    rows.append(layout_row(n, spec, seq_len, codes[i]))
  batch = {k: np.stack([r[k] for r in rows]) for k in rows[0]}
  batch["frames"] = frames
  batch["codes"] = codes.astype(np.int32)
  return batch
