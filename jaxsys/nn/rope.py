"""Rotary position embeddings (RoPE) with the scaling rules used for long-context extension.

RoPE (Su et al., 2021) rotates each pair of channels ``(x_i, x_{i+d/2})`` of a query/key at
position ``p`` by the angle ``p * inv_freq_i`` with ``inv_freq_i = theta^(-2i/d)``; the dot
product of a rotated query and key then depends only on their distance. Layout follows the
Llama "rotate half" convention, so weights from Hugging Face checkpoints apply unchanged.

Scaling rules (``RopeConfig.kind``):

* ``"default"``: ``inv_freq_i = theta^(-2i/d)``. A larger ``theta`` ("theta rescale" / NTK-style
  base change) stretches every wavelength.
* ``"linear"``: position interpolation (Chen et al., 2023), ``inv_freq / factor``, i.e. position
  ``p`` is read as ``p / factor``.
* ``"llama3"``: Llama-3.1 frequency-dependent interpolation: wavelengths longer than
  ``original_max_position_embeddings / low_freq_factor`` are divided by ``factor``, shorter than
  ``.../high_freq_factor`` kept, a linear blend in between.
* ``"yarn"``: YaRN (Peng et al., 2023): per-dimension blend of interpolation and extrapolation
  with a ramp between the ``beta_fast``/``beta_slow`` rotation counts, and an attention
  temperature ``attention_factor = 0.1 ln(factor) + 1`` multiplying cos/sin.

Usage::

  rope = RopeConfig(theta=1e4, kind="linear", factor=4.0)
  q = apply_rope(q, positions, rope)      # q [batch, seq, heads, head_dim], positions [batch, seq]
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax.numpy as jnp
import numpy as np

from jaxsys.core.errors import ConfigError, ShapeError, check_one_of, check_positive

__all__ = ["apply_rope", "inv_frequencies", "rope_cos_sin", "ROPE_KINDS", "RopeConfig"]

ROPE_KINDS = ("default", "linear", "llama3", "yarn")


@dataclasses.dataclass(frozen=True)
class RopeConfig:
  """RoPE frequencies. ``factor`` etc. are used only by the kinds that need them."""
  theta: float = 10000.0
  kind: str = "default"
  factor: float = 1.0
  original_max_position_embeddings: int | None = None
  low_freq_factor: float = 1.0      # llama3
  high_freq_factor: float = 4.0     # llama3
  beta_fast: float = 32.0           # yarn
  beta_slow: float = 1.0            # yarn
  attention_factor: float | None = None  # yarn: None -> 0.1 ln(factor) + 1 (or the mscale rule)
  mscale: float | None = None       # yarn
  mscale_all_dim: float | None = None  # yarn
  truncate: bool = True             # yarn

  def __post_init__(self):
    check_one_of("kind", self.kind, ROPE_KINDS, where="rope ")
    check_positive(self, "theta", where="rope ")
    if self.kind != "default" and not self.factor > 0:
      raise ConfigError(f"rope factor={self.factor} must be positive for kind={self.kind!r}")
    if self.kind in ("llama3", "yarn") and self.original_max_position_embeddings is None:
      raise ConfigError(f"rope kind={self.kind!r} needs original_max_position_embeddings")
    if self.kind == "llama3" and self.high_freq_factor <= self.low_freq_factor:
      raise ConfigError(f"llama3 rope needs {self.high_freq_factor=} > {self.low_freq_factor=}")


@functools.lru_cache(maxsize=64)
def _inv_freq_cached(rope: RopeConfig, dim: int) -> tuple[np.ndarray, float]:
  if dim % 2:
    raise ConfigError(f"rotary head_dim={dim} must be even")
  exponent = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / dim
  inv = (1.0 / (rope.theta ** exponent)).astype(np.float32)  # [dim/2]
  scale = 1.0
  if rope.kind == "linear":
    inv = inv / np.float32(rope.factor)
  elif rope.kind == "llama3":
    inv = _llama3(inv, rope)
  elif rope.kind == "yarn":
    inv, scale = _yarn(rope, dim)
  return inv.astype(np.float32), float(scale)


def inv_frequencies(rope: RopeConfig, dim: int) -> tuple[np.ndarray, float]:
  """Returns ``(inv_freq float32[dim/2], attention_factor)`` for a rotary dimension ``dim``."""
  inv, scale = _inv_freq_cached(rope, int(dim))
  return inv.copy(), scale


def _llama3(inv: np.ndarray, rope: RopeConfig) -> np.ndarray:
  old = rope.original_max_position_embeddings
  low_wavelen = old / rope.low_freq_factor
  high_wavelen = old / rope.high_freq_factor
  wavelen = 2 * math.pi / inv
  scaled = np.where(wavelen > low_wavelen, inv / rope.factor, inv)
  smooth = (old / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
  blended = (1 - smooth) * scaled / rope.factor + smooth * scaled
  medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
  return np.where(medium, blended, scaled).astype(np.float32)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
  return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(rope: RopeConfig, dim: int) -> tuple[np.ndarray, float]:
  factor, base, orig = rope.factor, rope.theta, rope.original_max_position_embeddings
  if rope.attention_factor is not None:
    attn = rope.attention_factor
  elif rope.mscale and rope.mscale_all_dim:
    attn = _yarn_mscale(factor, rope.mscale) / _yarn_mscale(factor, rope.mscale_all_dim)
  else:
    attn = _yarn_mscale(factor)

  def correction_dim(rotations):  # the dimension that makes `rotations` turns over `orig` tokens
    return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

  low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
  if rope.truncate:
    low, high = math.floor(low), math.ceil(high)
  low, high = max(low, 0), min(high, dim - 1)
  if low == high:
    high += 0.001
  ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
  extrapolate = 1 - ramp  # 1 keeps the original frequency, 0 interpolates by `factor`
  pos_freqs = base ** (np.arange(0, dim, 2, dtype=np.float32) / dim)
  inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate
  return inv.astype(np.float32), float(attn)


def rope_cos_sin(positions, rope: RopeConfig, dim: int):
  """``cos, sin float32[batch, seq, dim]`` for int positions ``[batch, seq]``."""
  inv, scale = inv_frequencies(rope, dim)
  angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv)  # [batch, seq, dim/2]
  angles = jnp.concatenate([angles, angles], axis=-1)  # [batch, seq, dim]
  return jnp.cos(angles) * scale, jnp.sin(angles) * scale


def apply_rope(x, positions, rope: RopeConfig):
  """Rotates ``x [batch, seq, heads, head_dim]`` by ``positions int[batch, seq]``."""
  if x.ndim != 4:
    raise ShapeError(f"x must be [batch, seq, heads, head_dim], got shape {x.shape}")
  if positions.shape != x.shape[:2]:
    raise ShapeError(f"positions must have shape {x.shape[:2]} (batch, seq), got {positions.shape}")
  cos, sin = rope_cos_sin(positions, rope, x.shape[-1])
  cos, sin = cos[:, :, None, :], sin[:, :, None, :]  # [batch, seq, 1, dim]
  half = x.shape[-1] // 2
  xf = x.astype(jnp.float32)
  rotated = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
  return (xf * cos + rotated * sin).astype(x.dtype)
