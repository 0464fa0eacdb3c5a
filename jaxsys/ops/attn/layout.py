"""Compile a lazy mask to a static block layout and per-(head, q-block) visit tables.

Every block ``(head, q block, kv block)`` gets a class: ``SKIP`` (no visible key: never
computed), ``FULL`` (every real token pair visible: no token mask needed) or ``PARTIAL`` (the
token mask is evaluated inside the block). Classes are derived analytically from interval logic
over blocks (``Causal``, ``Local``, ``Sink``), rectangle counts over ``BlockSparse`` layouts
(2-D prefix sums) and ``|`` / ``&`` / ``MultiHead`` composition — never by materialising a lazy
mask; a ``Dense`` mask (a concrete array already) is reduced per block exactly. Composition is conservative (``a | b`` is FULL only if one side is
FULL; ``a & b`` is visited if both sides are), so a class can only err towards more work,
never towards a wrong answer: token masks are re-applied inside every PARTIAL block.

When ``q_offset`` is traced (decode against a static cache) position-dependent masks become
PARTIAL everywhere (all blocks visited, masks applied per token); ``BlockSparse`` layouts are
row-index based and still prune.

Tables (numpy, static): ``idx[Ht, nq, V]`` kv-block ids of the visited blocks of q block i (in
increasing order, padded with the last valid id), ``cls[Ht, nq, V]`` their classes (0 = padding),
``cnt[Ht, nq]`` visit counts; ``Ht`` is 1 for head-independent masks, else ``heads``. The
transposed tables (per kv block, the q blocks visiting it) serve backward passes.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from jaxsys.ops import masks as M

__all__ = ["BlockLayout", "compile_layout"]

SKIP, FULL, PARTIAL = 0, 1, 2


@dataclasses.dataclass(frozen=True, eq=False)
class BlockLayout:
  """Static block structure of one attention call (see module docstring)."""
  cls: np.ndarray        # int8[Ht, nq, nk] block classes
  block_q: int
  block_k: int
  q_len: int
  kv_len: int

  @property
  def num_q_blocks(self) -> int:
    return self.cls.shape[1]

  @property
  def num_k_blocks(self) -> int:
    return self.cls.shape[2]

  @property
  def density(self) -> float:
    """Fraction of blocks visited (the compute fraction relative to dense)."""
    return float(np.mean(self.cls != SKIP))

  @functools.cached_property
  def tables(self):
    """``(idx, cls, cnt)`` per q block: the kv blocks it visits."""
    return _tables(self.cls)

  @functools.cached_property
  def transposed_tables(self):
    """``(idx, cls, cnt)`` per kv block: the q blocks that visit it."""
    return _tables(np.swapaxes(self.cls, 1, 2))


def _tables(cls: np.ndarray):
  """``cls[Ht, n, m]`` -> ``idx[Ht, n, V]``, ``cls[Ht, n, V]``, ``cnt[Ht, n]`` with V >= 1."""
  visited = cls != SKIP
  cnt = visited.sum(-1).astype(np.int32)
  v = max(int(cnt.max(initial=0)), 1)
  # Stable sort puts visited block ids first, in increasing order.
  order = np.argsort(~visited, axis=-1, kind="stable")[..., :v].astype(np.int32)
  slot = np.arange(v)
  valid = slot[None, None, :] < cnt[..., None]
  last = np.take_along_axis(order, np.maximum(cnt - 1, 0)[..., None], axis=-1)
  idx = np.where(valid, order, last).astype(np.int32)  # padding repeats the last id (no new DMA)
  c = np.where(valid, np.take_along_axis(cls, order, axis=-1), SKIP).astype(np.int8)
  return idx, c, cnt


def compile_layout(mask: M.Mask | None, *, heads: int, q_len: int, kv_len: int, block_q: int,
                   block_k: int, q_offset: int | None) -> BlockLayout:
  """Classifies every ``(head, q block, kv block)``; ``q_offset=None`` means traced/unknown."""
  nq, nk = -(-q_len // block_q), -(-kv_len // block_k)
  r0 = np.arange(nq) * block_q
  r1 = np.minimum(r0 + block_q, q_len) - 1           # last real row of each q block
  k0 = np.arange(nk) * block_k
  k1 = np.minimum(k0 + block_k, kv_len) - 1          # last real key of each kv block
  g = _Grid(r0[:, None], r1[:, None], k0[None, :], k1[None, :], q_offset, block_q, block_k)
  if mask is None:
    any_, all_ = np.ones((1, nq, nk), bool), np.ones((1, nq, nk), bool)
  else:
    any_, all_ = _classify(mask, g, heads)
  any_, all_ = np.broadcast_arrays(any_, all_)
  # Keys past kv_len in the last block are padding: the block needs the token mask.
  kpad = (k0 + block_k > kv_len)[None, None, :]
  cls = np.where(any_, np.where(all_ & ~kpad, FULL, PARTIAL), SKIP).astype(np.int8)
  return BlockLayout(cls, block_q, block_k, q_len, kv_len)


@dataclasses.dataclass(frozen=True)
class _Grid:
  """Per-block row range [r0, r1], key range [k0, k1] (broadcast [nq, 1] x [1, nk])."""
  r0: np.ndarray
  r1: np.ndarray
  k0: np.ndarray
  k1: np.ndarray
  offset: int | None
  block_q: int
  block_k: int

  @property
  def shape(self):
    return (self.r0.shape[0], self.k0.shape[1])


def _classify(mask: M.Mask, g: _Grid, heads: int):
  """``(any_visible, all_visible)`` bool ``[Ht, nq, nk]`` with Ht in {1, heads}."""
  shape = g.shape
  if isinstance(mask, M.Full):
    return np.ones((1, *shape), bool), np.ones((1, *shape), bool)
  if isinstance(mask, (M.Causal, M.Local, M.Sink)):
    if g.offset is None:  # traced offset: visit every block, mask every token
      return np.ones((1, *shape), bool), np.zeros((1, *shape), bool)
    p0, p1 = g.r0 + g.offset, g.r1 + g.offset  # first / last query position of the block
    if isinstance(mask, M.Causal):              # j <= p
      a, b = g.k0 <= p1, g.k1 <= p0
    elif isinstance(mask, M.Local):             # p - w < j <= p
      w = int(mask.window)
      a, b = (g.k0 <= p1) & (g.k1 > p0 - w), (g.k1 <= p0) & (g.k0 > p1 - w)
    else:                                       # j < n and j <= p
      n = int(mask.num_sink)
      a, b = (g.k0 < n) & (g.k0 <= p1), (g.k1 < n) & (g.k1 <= p0)
    return np.broadcast_to(a, shape)[None], np.broadcast_to(b, shape)[None]
  if isinstance(mask, (M.Or, M.And)):
    parts = [_classify(m, g, heads) for m in mask.masks]
    red = np.logical_or if isinstance(mask, M.Or) else np.logical_and
    return (functools.reduce(red, [p[0] for p in parts]),
            functools.reduce(red, [p[1] for p in parts]))
  if isinstance(mask, M.MultiHead):
    parts = [_classify(m, g, heads) for m in mask.masks]
    return (np.concatenate([np.broadcast_to(p[0], (1, *shape)) for p in parts]),
            np.concatenate([np.broadcast_to(p[1], (1, *shape)) for p in parts]))
  if isinstance(mask, M.Dense):
    return _dense(mask.values, g)
  if isinstance(mask, M.BlockSparse):
    a, b = _block_sparse(mask, g)
    if mask.token_mask is not None:
      ta, tb = _classify(mask.token_mask, g, heads)
      a, b = a & ta, b & tb
    return a, b
  # Unknown mask type: correct but unpruned (every block visited, token mask everywhere).
  return np.ones((1, *shape), bool), np.zeros((1, *shape), bool)


def _dense(values: np.ndarray, g: _Grid):
  """Exact classes of a concrete mask: any / all visible over each block's real rows and keys."""
  r0, k0 = g.r0[:, 0], g.k0[0]
  any_ = np.logical_or.reduceat(np.logical_or.reduceat(values, r0, axis=1), k0, axis=2)
  all_ = np.logical_and.reduceat(np.logical_and.reduceat(values, r0, axis=1), k0, axis=2)
  return any_, all_


def _block_sparse(mask: M.BlockSparse, g: _Grid):
  """Counts visited layout cells inside each kernel block with 2-D prefix sums."""
  lay = mask.layout.astype(np.int64)                       # [H, LQ, LK]
  lq, lk = lay.shape[1:]
  pre = np.zeros((lay.shape[0], lq + 1, lk + 1), np.int64)
  pre[:, 1:, 1:] = lay.cumsum(1).cumsum(2)
  a0 = np.clip(g.r0 // mask.block_q, 0, lq - 1)[:, 0]      # layout rows covered: [a0, a1]
  a1 = np.clip(g.r1 // mask.block_q, 0, lq - 1)[:, 0]
  c0 = np.clip(g.k0 // mask.block_k, 0, lk - 1)[0]
  c1 = np.clip(g.k1 // mask.block_k, 0, lk - 1)[0]
  A0, A1, C0, C1 = a0[:, None], a1[:, None] + 1, c0[None, :], c1[None, :] + 1
  count = pre[:, A1, C1] - pre[:, A0, C1] - pre[:, A1, C0] + pre[:, A0, C0]
  area = (A1 - A0) * (C1 - C0)
  return count > 0, count == area
