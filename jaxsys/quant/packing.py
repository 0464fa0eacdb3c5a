"""Adaptive package format (MEGA): mixed-bit node features packed into uint32 words.

Nodes are grouped by bitwidth. A group with ``b`` bits stores each node's ``F`` integer codes in
``W = ceil(F / v)`` uint32 words, ``v = 32 // b`` fields per word (fields never straddle words).
Layout is field-major so unpacking is a broadcast shift, no in-register gather (kernel friendly)::

  feature j of a row lives in word (j % W), bits [(j // W) * b, (j // W) * b + b)

Signed codes in ``[-(2^(b-1)-1), 2^(b-1)-1]`` are stored biased by ``2^(b-1)``; unsigned codes in
``[0, 2^b - 1]`` as is. Each node keeps one float32 scale; ``dequantized = code * scale``.

Usage::

  pk = pack_codes(codes, bits, scales, signed=False)   # codes int [N, F], bits int [N]
  codes2 = unpack_codes(pk)                              # exact round trip
  x = dequantize(pk)                                     # [N, F] float32
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxsys.core.errors import ConfigError, InputError, ShapeError
from jaxsys.quant.a2q import MAX_BITS, MIN_BITS, check_bits, qmax_of

__all__ = [
    "code_range", "dequantize", "fields_per_word", "pack_codes", "pack_features", "pack_rows",
    "PackedFeatures", "unpack_codes", "unpack_rows", "words_per_row",
]


def fields_per_word(bits: int) -> int:
  return 32 // bits


def words_per_row(num_features: int, bits: int) -> int:
  return -(-num_features // fields_per_word(bits))


def code_range(bits: int, signed: bool) -> tuple[int, int]:
  q = int(qmax_of(bits, signed))
  return (-q, q) if signed else (0, q)


@functools.partial(jax.jit, static_argnums=(1, 2))
def pack_rows(codes, bits: int, signed: bool):
  """Packs integer codes ``[n, F]`` of one bitwidth into uint32 words ``[n, W]`` (field-major)."""
  n, f = codes.shape
  v, w = fields_per_word(bits), words_per_row(f, bits)
  stored = codes.astype(jnp.int32) + (2 ** (bits - 1) if signed else 0)
  stored = jnp.pad(stored.astype(jnp.uint32), ((0, 0), (0, v * w - f)))
  stored = stored.reshape(n, v, w)  # [rows, field, word]: feature k*W + w -> field k of word w
  shifts = (jnp.arange(v, dtype=jnp.uint32) * bits)[None, :, None]
  return jnp.sum(stored << shifts, axis=1, dtype=jnp.uint32)  # fields are disjoint: sum == or


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def unpack_rows(words, bits: int, num_features: int, signed: bool):
  """Inverse of ``pack_rows``: uint32 ``[..., W]`` -> int32 codes ``[..., F]``."""
  v = fields_per_word(bits)
  shifts = (jnp.arange(v, dtype=jnp.uint32) * bits)[:, None]
  mask = jnp.uint32((1 << bits) - 1)
  fields = (words[..., None, :] >> shifts) & mask  # [..., field, word]
  codes = fields.reshape(*words.shape[:-1], -1)[..., :num_features].astype(jnp.int32)
  return codes - (2 ** (bits - 1) if signed else 0)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PackedFeatures:
  """Mixed-bit node features: one (node_ids, words, scales) triple per bitwidth group.

  ``bits[g]`` (static) is group g's bitwidth; ``node_ids[g]`` int32 ``[n_g]`` the global rows it
  holds; ``words[g]`` uint32 ``[n_g, W_g]``; ``scales[g]`` float32 ``[n_g]``. Empty groups are
  dropped at packing time.
  """
  node_ids: tuple
  words: tuple
  scales: tuple
  bits: tuple = dataclasses.field(metadata=dict(static=True))
  num_nodes: int = dataclasses.field(metadata=dict(static=True))
  num_features: int = dataclasses.field(metadata=dict(static=True))
  signed: bool = dataclasses.field(metadata=dict(static=True))

  @property
  def nbytes(self) -> int:
    """Bytes stored: packed words + per-node scale + per-node id."""
    return int(sum(w.size * 4 + s.size * 4 + i.size * 4
                   for w, s, i in zip(self.words, self.scales, self.node_ids)))

  @property
  def payload_bytes(self) -> int:
    """Bytes of the packed codes alone (what the aggregation streams per edge)."""
    return int(sum(w.size * 4 for w in self.words))

  @property
  def float32_bytes(self) -> int:
    return 4 * self.num_nodes * self.num_features

  def average_bits(self) -> float:
    total = sum(b * int(i.size) for b, i in zip(self.bits, self.node_ids))
    return total / max(self.num_nodes, 1)


def _check_codes(codes, bits_np, signed):
  for b in np.unique(bits_np):
    lo, hi = code_range(int(b), signed)
    rows = codes[bits_np == b]
    if rows.size and (rows.min() < lo or rows.max() > hi):
      raise InputError(f"codes of {int(b)}-bit rows must lie in [{lo}, {hi}] "
                       f"(signed={signed}), got [{int(rows.min())}, {int(rows.max())}]")


def pack_codes(codes, bits, scales, *, signed: bool) -> PackedFeatures:
  """Packs integer codes ``[N, F]`` with per-node ``bits [N]`` (1..8) and ``scales [N]``.

  Runs on the host (group membership is static structure, as in an accelerator's package).
  """
  codes_np = np.asarray(codes)
  bits_np = np.asarray(bits)
  if codes_np.ndim != 2:
    raise ShapeError(f"codes must be [num_nodes, num_features], got shape {codes_np.shape}")
  n, f = codes_np.shape
  if bits_np.shape != (n,) or np.asarray(scales).shape != (n,):
    raise ShapeError(f"bits and scales must be [{n}], got {bits_np.shape} and "
                     f"{np.asarray(scales).shape}")
  if not np.all(bits_np == np.round(bits_np)):
    raise ConfigError("bits must be integers")
  check_bits("bits", bits_np)
  bits_np = bits_np.astype(np.int32)
  if not np.all(codes_np == np.round(codes_np)):
    raise InputError("codes must be integers")
  codes_np = codes_np.astype(np.int32)
  _check_codes(codes_np, bits_np, signed)
  scales = jnp.asarray(scales, jnp.float32)
  ids, words, sc, bl = [], [], [], []
  for b in range(MIN_BITS, MAX_BITS + 1):
    rows = np.nonzero(bits_np == b)[0].astype(np.int32)
    if rows.size == 0:
      continue
    ids.append(jnp.asarray(rows))
    words.append(pack_rows(jnp.asarray(codes_np[rows]), b, signed))
    sc.append(scales[rows])
    bl.append(b)
  return PackedFeatures(tuple(ids), tuple(words), tuple(sc), tuple(bl), n, f, signed)


def unpack_codes(packed: PackedFeatures):
  """Integer codes ``[N, F]`` in the original node order (exact inverse of ``pack_codes``)."""
  out = jnp.zeros((packed.num_nodes, packed.num_features), jnp.int32)
  for ids, w, b in zip(packed.node_ids, packed.words, packed.bits):
    out = out.at[ids].set(unpack_rows(w, b, packed.num_features, packed.signed))
  return out


def dequantize(packed: PackedFeatures):
  """Float32 features ``codes * scale`` ``[N, F]``."""
  out = jnp.zeros((packed.num_nodes, packed.num_features), jnp.float32)
  for ids, w, s, b in zip(packed.node_ids, packed.words, packed.scales, packed.bits):
    vals = unpack_rows(w, b, packed.num_features, packed.signed).astype(jnp.float32)
    out = out.at[ids].set(vals * s[:, None])
  return out


def pack_features(x, bits, scales, *, signed: bool) -> PackedFeatures:
  """Quantizes float features with A2Q eq. 1 (per-node bits and scales) and packs them."""
  from jaxsys.quant.a2q import quantize_codes
  x = jnp.asarray(x, jnp.float32)
  bits = np.asarray(bits)
  check_bits("bits", bits)
  scales = jnp.asarray(scales, jnp.float32)
  if np.any(np.asarray(scales) <= 0):
    raise InputError("scales must be positive")
  codes = quantize_codes(x, scales[:, None], jnp.asarray(bits, jnp.float32)[:, None], signed)
  return pack_codes(codes, bits, scales, signed=signed)
