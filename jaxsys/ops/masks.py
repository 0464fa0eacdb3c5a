"""Lazy, composable attention masks.

Semantics (all masks): query row ``i`` of a ``q_len``-row block sits at absolute position
``pos(i) = q_offset + i`` with ``q_offset = kv_len - q_len`` by default (bottom-right aligned,
as in decoding); key ``j`` sits at position ``j``.

* ``Full()``: every key is visible.
* ``Causal()``: key j visible iff ``j <= pos(i)``.
* ``Local(w)``: visible iff ``0 <= pos(i) - j < w`` (the query itself and the ``w-1`` keys before it).
* ``Sink(n)``: visible iff ``j < n`` and ``j <= pos(i)``. ``Sink(n) | Local(w)`` is a streaming head.
* ``a | b``, ``a & b``: union / intersection.
* ``MultiHead([m_0, ..., m_{H-1}])``: query head ``h`` uses ``m_h``.
* ``Dense(values)``: a concrete boolean array ``[heads or 1, q_len, kv_len]`` (row index
  based, like ``BlockSparse``); block layouts classify its tiles exactly, so empty tiles are
  skipped and full ones need no token mask. ``ops.attention`` turns a block-structured dense
  boolean mask into one (``from_dense``).
* ``BlockSparse(layout, block_q, block_k, token_mask=None)``: ``layout[h, i // block_q, j // block_k]``
  says whether query block ``i // block_q`` (by row index) of head h visits key block
  ``j // block_k``; inside visited blocks the optional ``token_mask`` (another mask) applies.
  A layout with a leading dimension of 1 applies to all heads.

Masks are evaluated lazily: ``visible`` works on broadcastable index arrays (inside jit, on
blocks), ``dense`` materialises a small ``[heads, q_len, kv_len]`` boolean array for references
and tests. Kernels compile masks to block layouts so that blocks with no visible key are skipped.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from jaxsys.core.errors import ConfigError, ShapeError, check_min

__all__ = ["And", "BlockSparse", "Causal", "contains", "Dense", "from_dense", "Full", "Local", "Mask", "MultiHead", "Or",
           "Sink", "TreeMask"]


#: Default compute tile of the XLA backend, and the finest tile a structured mask asks for.
COARSE_TILE, FINE_TILE = 256, 64


class Mask:
  """Base class. Subclasses implement ``visible(q_idx, q_pos, k_idx, head)``."""

  #: Number of heads a head-dependent mask is defined for (None: the same for every head).
  num_heads: int | None = None

  def visible(self, q_idx, q_pos, k_idx, head=None):
    """Boolean visibility for broadcastable int arrays of row index, position, key index, head."""
    raise NotImplementedError

  @property
  def granularity(self) -> int | None:
    """Token size of the mask's structure (``None``: no finer than a default compute tile).

    Block-sparse attention skips whole compute tiles, so a layout of 64-token blocks computed in
    256-token tiles costs what a dense tile does wherever any of its 16 layout blocks is visited.
    The XLA backend sizes its tiles from this (``jaxsys.ops.attn.xla.XlaBlockSizes.for_mask``)."""
    return None

  def __or__(self, other: "Mask") -> "Mask":
    return Or((self, _as_mask(other)))

  def __and__(self, other: "Mask") -> "Mask":
    return And((self, _as_mask(other)))

  def dense(self, q_len: int, kv_len: int, *, heads: int | None = None,
            q_offset: int | None = None) -> np.ndarray:
    """Materialises ``bool[heads, q_len, kv_len]`` (heads=1 for head-independent masks)."""
    q_offset = kv_len - q_len if q_offset is None else int(q_offset)
    h = heads or self.num_heads or 1
    if self.num_heads is not None and heads is not None and heads != self.num_heads:
      raise ShapeError(f"mask is defined for {self.num_heads} heads but {heads=}")
    q_idx = np.arange(q_len)[None, :, None]
    k_idx = np.arange(kv_len)[None, None, :]
    head = np.arange(h)[:, None, None]
    out = self.visible(q_idx, q_idx + q_offset, k_idx, head)
    return np.broadcast_to(np.asarray(out, bool), (h, q_len, kv_len)).copy()


def contains(mask: Mask | None, kind: type) -> bool:
  """Whether ``mask`` or any mask it is composed of (``|``, ``&``, ``MultiHead``, a
  ``BlockSparse`` token mask) is a ``kind``."""
  if mask is None:
    return False
  if isinstance(mask, kind):
    return True
  parts = tuple(getattr(mask, "masks", ())) + (getattr(mask, "token_mask", None),)
  return any(contains(m, kind) for m in parts if m is not None)


def _as_mask(m) -> Mask:
  if not isinstance(m, Mask):
    raise ConfigError(f"expected a jaxsys.ops.masks.Mask, got {type(m).__name__}")
  return m


def _xp(*arrays):
  return np if all(isinstance(a, (np.ndarray, int, np.integer)) for a in arrays) else jnp


@dataclasses.dataclass(frozen=True)
class Full(Mask):
  def visible(self, q_idx, q_pos, k_idx, head=None):
    xp = _xp(q_pos, k_idx)
    return xp.ones(xp.broadcast_shapes(xp.shape(q_pos), xp.shape(k_idx)), bool)


@dataclasses.dataclass(frozen=True)
class Causal(Mask):
  def visible(self, q_idx, q_pos, k_idx, head=None):
    return k_idx <= q_pos


@dataclasses.dataclass(frozen=True)
class Local(Mask):
  window: int

  def __post_init__(self):
    check_min(self, 1, "window", where="Local ")

  def visible(self, q_idx, q_pos, k_idx, head=None):
    d = q_pos - k_idx
    return (d >= 0) & (d < self.window)

  @property
  def granularity(self) -> int | None:
    # a band of w keys touches w + 2 tiles' worth of keys per query tile: small tiles for
    # windows of a few default tiles (64: the LServe page)
    return FINE_TILE if self.window < 4 * COARSE_TILE else None


@dataclasses.dataclass(frozen=True)
class Sink(Mask):
  num_sink: int

  def __post_init__(self):
    check_min(self, 0, "num_sink", where="Sink ")

  def visible(self, q_idx, q_pos, k_idx, head=None):
    return (k_idx < self.num_sink) & (k_idx <= q_pos)

  @property
  def granularity(self) -> int | None:
    return FINE_TILE if 0 < self.num_sink < COARSE_TILE else None


@dataclasses.dataclass(frozen=True)
class _Combination(Mask):
  """Several masks combined elementwise by ``_op`` (``|`` for Or, ``&`` for And)."""
  masks: tuple[Mask, ...]

  @property
  def num_heads(self):  # type: ignore[override]
    return _common_heads(self.masks)

  @property
  def granularity(self) -> int | None:
    return _finest(self.masks)

  def visible(self, q_idx, q_pos, k_idx, head=None):
    out = self.masks[0].visible(q_idx, q_pos, k_idx, head)
    for m in self.masks[1:]:
      out = self._op(out, m.visible(q_idx, q_pos, k_idx, head))
    return out


@dataclasses.dataclass(frozen=True)
class Or(_Combination):
  @staticmethod
  def _op(a, b):
    return a | b


@dataclasses.dataclass(frozen=True)
class And(_Combination):
  @staticmethod
  def _op(a, b):
    return a & b


def _finest(masks) -> int | None:
  gs = [m.granularity for m in masks if m.granularity is not None]
  return min(gs) if gs else None


def _common_heads(masks):
  hs = {m.num_heads for m in masks if m.num_heads is not None}
  if len(hs) > 1:
    raise ConfigError(f"combined masks disagree on the number of heads: {sorted(hs)}")
  return hs.pop() if hs else None


@dataclasses.dataclass(frozen=True)
class MultiHead(Mask):
  """Head ``h`` uses ``masks[h]`` (e.g. retrieval heads Causal, streaming heads Sink|Local)."""
  masks: tuple[Mask, ...]

  def __init__(self, masks: Sequence[Mask]):
    masks = tuple(_as_mask(m) for m in masks)
    if not masks:
      raise ConfigError("MultiHead needs at least one mask")
    object.__setattr__(self, "masks", masks)

  @property
  def num_heads(self):  # type: ignore[override]
    return len(self.masks)

  @property
  def granularity(self) -> int | None:
    return _finest(self.masks)

  def visible(self, q_idx, q_pos, k_idx, head=None):
    if head is None:
      raise ShapeError("MultiHead masks need the head index")
    out = None
    for h, m in enumerate(self.masks):
      v = (head == h) & m.visible(q_idx, q_pos, k_idx, None)
      out = v if out is None else out | v
    return out


@dataclasses.dataclass(frozen=True, eq=False)
class BlockSparse(Mask):
  """Block layout ``bool[heads or 1, ceil(q_len/block_q), ceil(kv_len/block_k)]``."""
  layout: np.ndarray
  block_q: int
  block_k: int
  token_mask: Mask | None = None

  def __post_init__(self):
    layout = np.asarray(self.layout)
    if layout.ndim == 2:
      layout = layout[None]
    if layout.ndim != 3:
      raise ShapeError(f"BlockSparse layout must be [heads, q_blocks, k_blocks], got {layout.shape}")
    check_min(self, 1, "block_q", "block_k", where="BlockSparse ")
    object.__setattr__(self, "layout", layout.astype(bool))

  @property
  def num_heads(self):  # type: ignore[override]
    h = self.layout.shape[0]
    return None if h == 1 else h

  @property
  def granularity(self) -> int | None:
    g = min(self.block_q, self.block_k)
    if self.token_mask is not None and self.token_mask.granularity is not None:
      g = min(g, self.token_mask.granularity)
    return g

  def check_lengths(self, q_len: int, kv_len: int):
    nq, nk = -(-q_len // self.block_q), -(-kv_len // self.block_k)
    if self.layout.shape[1:] != (nq, nk):
      raise ShapeError(
          f"BlockSparse layout shape {self.layout.shape[1:]} does not match {q_len=}, {kv_len=} "
          f"with block_q={self.block_q}, block_k={self.block_k} (expected {(nq, nk)})")

  def visible(self, q_idx, q_pos, k_idx, head=None):
    xp = _xp(q_idx, k_idx) if head is None else _xp(q_idx, k_idx, head)
    layout = xp.asarray(self.layout)
    h = 0 if (head is None or self.layout.shape[0] == 1) else head
    qb = xp.clip(q_idx // self.block_q, 0, layout.shape[1] - 1)
    kb = xp.clip(k_idx // self.block_k, 0, layout.shape[2] - 1)
    out = layout[h, qb, kb]
    if self.token_mask is not None:
      out = out & self.token_mask.visible(q_idx, q_pos, k_idx, head)
    return out


@dataclasses.dataclass(frozen=True, eq=False)
class Dense(Mask):
  """A concrete visibility array ``bool[heads or 1, q_len, kv_len]`` as a lazy mask: what a
  user's dense boolean mask becomes when tiles of it are empty (:func:`from_dense`). Row index
  based, like ``BlockSparse``; kernels that evaluate masks on the chip refuse it (its values would
  have to travel as an input), the XLA paths read it as a constant."""
  values: np.ndarray

  def __post_init__(self):
    v = np.asarray(self.values, bool)
    if v.ndim == 2:
      v = v[None]
    if v.ndim != 3:
      raise ShapeError(f"Dense mask values must be [heads, q_len, kv_len], got {v.shape}")
    object.__setattr__(self, "values", v)

  @property
  def num_heads(self):  # type: ignore[override]
    h = self.values.shape[0]
    return None if h == 1 else h

  @property
  def granularity(self) -> int | None:
    return FINE_TILE

  def check_lengths(self, q_len: int, kv_len: int):
    if self.values.shape[1:] != (q_len, kv_len):
      raise ShapeError(f"Dense mask of shape {self.values.shape[1:]} for q_len={q_len}, kv_len={kv_len}")

  def visible(self, q_idx, q_pos, k_idx, head=None):
    xp = _xp(q_idx, k_idx) if head is None else _xp(q_idx, k_idx, head)
    v = xp.asarray(self.values)
    h = 0 if (head is None or v.shape[0] == 1) else head
    return v[h, xp.clip(q_idx, 0, v.shape[1] - 1), xp.clip(k_idx, 0, v.shape[2] - 1)]


#: ``from_dense`` keeps a mask dense when more than this fraction of its tiles has a visible key.
DENSE_MAX_DENSITY = 0.75


def from_dense(values, tile: int = FINE_TILE) -> Dense | None:
  """``Dense(values)`` for a concrete ``bool[heads or 1, q_len, kv_len]`` whose ``tile x tile``
  tiles are at most ``DENSE_MAX_DENSITY`` visited (document masks, block-diagonal or banded
  patterns: the tiled attention skips the rest), else None (the mask runs dense: with most tiles
  visited, tiling costs more than it saves)."""
  v = np.asarray(values, bool)
  h, tq, tk = v.shape
  nq, nk = -(-tq // tile), -(-tk // tile)
  padded = np.zeros((h, nq * tile, nk * tile), bool)
  padded[:, :tq, :tk] = v
  visited = padded.reshape(h, nq, tile, nk, tile).any(axis=(2, 4))
  return Dense(v) if visited.mean() <= DENSE_MAX_DENSITY else None


@dataclasses.dataclass(frozen=True, eq=False)
class TreeMask(Mask):
  """Prefix + tree visibility for ONE sequence (vmap over the batch): speculative decoding's
  draft tree over a cached prefix (``jaxsys.speculative.tree`` builds the trees).

  Key ``j`` is visible to query row ``i`` iff ``j < prefix_len`` or
  ``tree_start <= j < tree_start + K`` and ``tree_vis[i, j - tree_start]``; query row ``i`` is
  tree node ``i``. ``prefix_len`` / ``tree_start`` may be traced scalars.
  """
  tree_vis: Any   # bool [T_q, K]
  prefix_len: Any
  tree_start: Any

  def visible(self, q_idx, q_pos, k_idx, head=None):
    tq, tk = self.tree_vis.shape
    rel = k_idx - self.tree_start
    in_tree = (rel >= 0) & (rel < tk)
    tv = self.tree_vis[jnp.clip(q_idx, 0, tq - 1), jnp.clip(rel, 0, tk - 1)]
    return (k_idx < self.prefix_len) | (in_tree & tv)
