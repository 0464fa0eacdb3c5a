"""1-bit communication quantizer (Sylvie): per-row range, stochastic rounding, uint32 bit packing.

Each row ``x`` (``F`` values) is sent as ``ceil(F/32)`` uint32 words plus two float32 numbers
(``lo = min x``, ``hi = max x``). Element j is sent as one bit ``q_j ~ Bernoulli((x_j - lo) /
(hi - lo))`` and received as ``lo + q_j * (hi - lo)``, so ``E[received] = x`` (unbiased).
With ``key=None`` rounding is to nearest (deterministic). Bit j of a row lives in word
``j // 32`` at position ``j % 32``.

Bytes per row: ``4 * ceil(F/32) + 8`` versus ``4 * F`` in float32 (e.g. F=1433: 188 vs 5732).

Usage::

  payload = quantize_1bit(x, key)          # OneBitPayload(words, lo, hi)
  x_hat = dequantize_1bit(payload, F)
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxsys.core.errors import ShapeError

__all__ = [
    "bytes_per_row", "dequantize_1bit", "OneBitPayload", "pack_bits", "quantize_1bit", "unpack_bits",
    "words_for",
]


class OneBitPayload(NamedTuple):
  words: jax.Array  # uint32 [..., ceil(F/32)]
  lo: jax.Array     # float32 [...]
  hi: jax.Array     # float32 [...]

  @property
  def nbytes(self) -> int:
    return int(sum(a.size * a.dtype.itemsize for a in self))


def words_for(num_features: int) -> int:
  return -(-num_features // 32)


def bytes_per_row(num_features: int, quantized: bool = True) -> int:
  """Bytes one row costs on the wire: packed bits + lo + hi, or float32."""
  return 4 * words_for(num_features) + 8 if quantized else 4 * num_features


def pack_bits(bits):
  """bool/int ``[..., F]`` -> uint32 ``[..., ceil(F/32)]`` (bit j -> word j//32, position j%32)."""
  f = bits.shape[-1]
  w = words_for(f)
  b = jnp.pad(bits.astype(jnp.uint32), [(0, 0)] * (bits.ndim - 1) + [(0, 32 * w - f)])
  b = b.reshape(*bits.shape[:-1], w, 32)
  return jnp.sum(b << jnp.arange(32, dtype=jnp.uint32), axis=-1, dtype=jnp.uint32)


def unpack_bits(words, num_features: int):
  """uint32 ``[..., W]`` -> uint32 0/1 ``[..., F]``."""
  b = (words[..., None] >> jnp.arange(32, dtype=jnp.uint32)) & jnp.uint32(1)
  return b.reshape(*words.shape[:-1], -1)[..., :num_features]


def quantize_1bit(x, key=None, *, seed=None) -> OneBitPayload:
  """Quantizes rows of ``x [..., F]`` to one bit each.

  Stochastic rounding with a ``jax.random`` key, or with an integer ``seed`` (a counter hash,
  ``jaxsys.quant.random.hash_uniform``: much cheaper on CPU); nearest rounding with neither.
  """
  if x.ndim < 1:
    raise ShapeError(f"x must have a feature axis, got shape {x.shape}")
  x = x.astype(jnp.float32)
  lo = jnp.min(x, axis=-1)
  hi = jnp.max(x, axis=-1)
  span = hi - lo
  p = jnp.where(span[..., None] > 0, (x - lo[..., None]) / jnp.where(span > 0, span, 1.0)[..., None], 0.0)
  if key is not None:
    bits = jax.random.uniform(key, x.shape) < p
  elif seed is not None:
    from jaxsys.quant.random import hash_uniform
    bits = hash_uniform(x.shape, seed) < p
  else:
    bits = p >= 0.5
  return OneBitPayload(pack_bits(bits), lo, hi)


def dequantize_1bit(payload: OneBitPayload, num_features: int):
  bits = unpack_bits(payload.words, num_features).astype(jnp.float32)
  return payload.lo[..., None] + bits * (payload.hi - payload.lo)[..., None]
