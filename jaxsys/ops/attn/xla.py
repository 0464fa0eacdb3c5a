"""Blockwise (flash-style) attention in pure JAX: the fast path on CPU.

Online softmax over key blocks (Milakov & Gimelshein 2018; Dao et al. 2022, Alg. 1): for each
query block ``i`` and each *visited* key block ``j`` (from the static layout tables of
``layout.py``)::

    s = (scale * q_i) k_j^T,  m' = max(m, rowmax s),  p = exp(s - m'),
    l' = l e^{m - m'} + rowsum p,  acc' = acc e^{m - m'} + p v_j,   out_i = acc / l,  lse = m + log l

Only visited blocks are gathered and computed, so a 10%-dense layout costs ~10% of dense; memory
is linear in length (one ``[block_q, block_k]`` tile per head live at a time). Statistics and
accumulators are float32 whatever the input dtype; rows that see no key give zeros and
``lse = -inf``. GQA groups query heads per kv head, so K/V are never repeated.

Gradients (``jax.custom_vjp``) recompute ``p = exp(s - lse)`` per visited block (FlashAttention
backward): ``dv += p^T dO``, ``ds = p * (dO v^T - rowsum(dO * out))``, ``dq += ds k``,
``dk += ds^T q``; dk/dv are accumulated in place at the visited block ids, so the backward visits
exactly the forward's blocks.

Visits are ordered FULL blocks first (no token mask: the common case), then PARTIAL blocks (token
mask evaluated from the lazy mask, segments, ``kv_lengths`` and padding), as two branch-free loops.
When classes depend on traced inputs (segments, ``kv_lengths``) each visit instead picks skip /
full / partial with ``lax.switch`` (e.g. blocks of disjoint packed segments are skipped).

Calls of at most ``SINGLE_TILE_MAX_Q`` queries whose keys fit one tile (decode steps, draft-tree
verification) use the plain formula of ``reference.py`` at default precision instead: for one tile
the loop is pure overhead. So do calls with a dense mask or bias ``[b|1, h|1, q, k]``: the array is
already quadratic in length and no static layout describes it, so tiling saves neither memory nor
work (the bias gets its gradient from autodiff).

``logits_soft_cap`` (Gemma 2): ``s = cap * tanh(s / cap)`` per visited tile; the backward
recomputes ``t = tanh(s_raw / cap)`` and scales ``ds`` by ``1 - t^2``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxsys.core.errors import check_positive
from jaxsys.ops.attn import reference
from jaxsys.ops.attn import layout as layout_lib
from jaxsys.ops.attn.common import AttentionArgs, soft_cap

__all__ = ["blockwise_attention", "MIN_TILE", "SINGLE_TILE_MAX_Q", "XlaBlockSizes"]

_F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class XlaBlockSizes:
  """Query / key tile sizes; clipped to the (8-rounded) lengths for short inputs.

  256 x 256 was the fastest square tile on a 2-core CPU with both cores busy (4K tokens,
  4 heads, d=64; 128..1024): a ``[heads, 256, 256]`` f32 tile set stays cache-resident; it is
  kept for packed segments and short calls. Unmasked calls use ``DENSE``, masks without a finer
  structure (causal, wide windows) ``UNSTRUCTURED`` (see ``for_mask``): with the second core
  free, taller tiles win for causal masks too (4K forward: 256x256 138..151 ms, 512x256 86,
  512x512 79; forward+backward 447 vs 323 for 512x256).

  ``even_q``: split the queries into ``ceil(q_len / block_q)`` tiles of equal (8-rounded) size
  rather than full tiles plus a padded remainder: 1500 queries run as 2 x 752, not 2 x 1024
  (only where no mask structure ties tiles to a grid). ``even_k``: the same for the keys, so
  262 keys run as 2 x 136, not 2 x 256 (half the tile area of a 264-query tile: the update
  pass of a 262-token row took 0.174 s on 256-key tiles, 8 rows, 8 heads of 8, 2 CPU cores).
  ``backward``: tiles of the backward
  pass when they differ from the forward's (its own layout tables; ``None``: the same).
  """
  block_q: int = 256
  block_k: int = 256
  even_q: bool = False
  even_k: bool = False
  backward: "XlaBlockSizes | None" = None

  def __post_init__(self):
    check_positive(self, "block_q", "block_k", integer=True)

  @classmethod
  def for_mask(cls, mask, *, packed: bool = False, q_len: int | None = None) -> "XlaBlockSizes":
    """Tiles that follow the mask's structure (``Mask.granularity``): a block-sparse layout of
    ``g``-token blocks (or a sink / short local window) is computed in ``g x g`` tiles, so work
    tracks the visited blocks; unstructured masks (causal, wide windows) get ``UNSTRUCTURED``
    (512 x 256). No mask gets ``DENSE``. Both keep the default 256 x 256 with ``packed``
    segments (disjoint blocks are skipped at tile granularity) and for
    ``q_len <= SINGLE_TILE_MAX_Q`` (decode steps keep 256 keys in the one-tile path).

    Measured on 2 CPU cores (8K tokens, 4 heads, d=64, f32, 10% of a random layout visited),
    fraction of the ideal speedup over dense reached, forward:

    ========  ==========  ==========  ==========  ======
    layout    tiles 256   tiles 128   tiles 64    ours
    ========  ==========  ==========  ==========  ======
    64        0.11        0.44        0.72        0.72
    128       0.26        0.69        --          0.69
    256       0.85        --          --          0.85
    ========  ==========  ==========  ==========  ======

    (That table is against the old 256 x 256 dense tiles.) Against ``DENSE`` the fine rows
    fall to ~0.4..0.5 with the second core free, ~0.6..0.8 when only one core runs (taskset):
    ``DENSE``'s 1024 x 256 dots are split over both cores, a 64-row tile's are not. Gathering
    several visited key tiles into one wider dot (a compact 64 x 512 key buffer per step, with
    or without several query tiles batched per step, rows sorted by visit count) measured
    slower, not faster (8K, 64-token layout, 25%, forward: 263 ms one tile a visit, 290..420 ms
    chunked; the gather itself was not the cost), so fine layouts keep one tile per visit.

    Tiles below ``MIN_TILE`` tokens lose more to per-visit overhead than they skip, so a finer
    layout uses the smallest multiple of its block at or above it.
    """
    g = None if mask is None else mask.granularity
    if g is None and not packed and (q_len is None or q_len > SINGLE_TILE_MAX_Q):
      return DENSE if mask is None else UNSTRUCTURED
    if g is None or g >= cls.block_q:
      return cls()
    tile = g * -(-MIN_TILE // g)
    return cls(tile, tile)

  def for_lengths(self, q_len: int, kv_len: int) -> tuple[int, int]:
    return _tile(q_len, self.block_q, self.even_q), _tile(kv_len, self.block_k, self.even_k)


# Unmasked attention: nothing to skip, so tiles only trade matmul size against cache residency.
# Larger tiles make larger dots and stream K/V 4x less often than 256-row tiles; most of their
# gain shows only while the second core is free (larger dots get split over both cores, it
# seems; with both cores busy it is ~15%). Measured on 2 shared CPU cores
# (b=1, 4 heads, d=64, f32, 4K tokens, interleaved, ms), forward with the other core mostly
# idle: 1024x128 146, 1024x256 126, 512x256 141, 2048x256 114, 1024x512 120 (256x256: ~240);
# with both cores busy the tall tiles were all within 5% (195..205) against 235 for 256x256.
# Forward+backward (forward 1024x256): backward 512x256 550, 1024x128 549, 512x128 679,
# 256x256 706; the same tile for both passes (1024x256) 632.
DENSE = XlaBlockSizes(1024, 256, even_q=True, even_k=True,
                      backward=XlaBlockSizes(512, 256, even_q=True, even_k=True))
# Causal / wide-window masks: 4K forward 256x256 138..151 ms, 512x256 86, 512x512 79.
UNSTRUCTURED = XlaBlockSizes(512, 256, even_q=True, even_k=True)

MIN_TILE = 32  # the smallest tile for_mask picks
SINGLE_TILE_MAX_Q = 16  # queries up to which a one-key-tile call skips the blockwise loop


def _round_up(x: int, m: int) -> int:
  return -(-x // m) * m


def _tile(length: int, block: int, even: bool) -> int:
  """Tile size for ``length`` tokens: ``block`` (at most the 8-rounded length) or, ``even``, the
  same number of tiles made equal: ``ceil(length / ceil(length / block))`` rounded up to 8."""
  t = min(block, _round_up(length, 8))
  return _round_up(-(-length // -(-length // t)), 8) if even else t


@dataclasses.dataclass(frozen=True, eq=False)
class _Plan:
  """Static description of one call: shapes, layout tables, mask."""
  args: AttentionArgs           # only static fields are read inside the loops
  b: int
  tq: int
  tk: int
  h: int
  hk: int
  d: int
  dv: int
  bq: int
  bk: int
  nq: int
  nk: int
  ht: int                        # table heads: 1 (shared) or h
  idx: np.ndarray                # int32[ht, nq, V]
  cls: np.ndarray                # int8[ht, nq, V]
  trips: np.ndarray              # int32[nq]: visits of the busiest head per q block
  nfull: np.ndarray              # int32[nq]: leading slots that are FULL for every head

  @property
  def g(self) -> int:
    return self.h // self.hk


def blockwise_attention(args: AttentionArgs, block_sizes: XlaBlockSizes | None = None):
  """``(out [b, q, h, dv] in q.dtype, lse [b, h, q] f32)`` visiting only non-empty blocks."""
  q, k, v = args.q, args.k, args.v
  tq, tk = q.shape[1], k.shape[1]
  block_sizes = block_sizes or XlaBlockSizes.for_mask(
      args.mask, packed=args.q_segment_ids is not None, q_len=tq)
  bq, bk = block_sizes.for_lengths(tq, tk)
  if (tq <= SINGLE_TILE_MAX_Q and tk <= bk) or args.dense_terms:
    # Decode / tree verification: a few queries over one key tile. The online-softmax loop and
    # its custom backward buy nothing for a single tile; the plain formula (autodiff backward)
    # is the same math without the loop and per-visit masking overhead. A dense mask / bias
    # (see the module docstring) runs the same formula.
    return reference.attention_reference(args, precision=lax.Precision.DEFAULT)
  plan = _make_plan(args, bq, bk)
  plan_bwd = plan
  if block_sizes.backward is not None:
    plan_bwd = _make_plan(args, *block_sizes.backward.for_lengths(tq, tk))
  return _attention(plan, plan_bwd, q, k, v)


def _make_plan(args: AttentionArgs, bq: int, bk: int) -> _Plan:
  b, tq, h, d = args.q.shape
  tk, hk, dv = args.k.shape[1], args.k.shape[2], args.v.shape[-1]
  lay = layout_lib.compile_layout(args.mask, heads=h, q_len=tq, kv_len=tk, block_q=bq,
                                  block_k=bk, q_offset=args.static_offset)
  idx, cls, cnt = lay.tables
  # FULL visits first, then PARTIAL (softmax is order-free): a mask-free loop, then a masked one.
  order = np.argsort(np.where(cls == layout_lib.FULL, 0, np.where(cls == layout_lib.PARTIAL, 1, 2)),
                     axis=-1, kind="stable")
  idx, cls = np.take_along_axis(idx, order, -1), np.take_along_axis(cls, order, -1)
  nfull = (cls == layout_lib.FULL).cumprod(-1).sum(-1).min(0).astype(np.int32)
  return _Plan(args, b, tq, tk, h, hk, d, dv, bq, bk, lay.num_q_blocks, lay.num_k_blocks,
               idx.shape[0], idx, cls, cnt.max(0).astype(np.int32), nfull)


# ----------------------------------------------------------------------------- dynamic classes


def _dynamic_classes(plan: _Plan):
  """Refines static classes with traced inputs; returns ``{"cls", "branch"}`` arrays.

  ``cls [B', ht, nq, V]`` (B' = 1 or batch) and ``branch [nq, V]``: 0 skip / 1 full / 2 partial
  for the whole (batch, head) tile of a visit; ``branch`` is None when classes are static.
  """
  a = plan.args
  cls = jnp.asarray(plan.cls)[None]                            # [1, ht, nq, V]
  if a.kv_lengths is None and a.q_segment_ids is None:
    return {"cls": cls, "branch": None}
  kb0 = jnp.asarray(plan.idx) * plan.bk                        # first key of each visited block
  if a.kv_lengths is not None:
    lens = a.kv_lengths[:, None, None, None]
    beyond = kb0[None] >= lens                                 # block entirely past the length
    cut = kb0[None] + plan.bk > lens                           # block straddles the length
    cls = jnp.where(beyond, 0, jnp.where(cut & (cls == 1), 2, cls))
  if a.q_segment_ids is not None:
    qlo, qhi = _block_range(a.q_segment_ids, plan.bq, plan.nq, plan.tq)  # [b, nq]
    klo, khi = _block_range(a.kv_segment_ids, plan.bk, plan.nk, plan.tk)  # [b, nk]
    klo_v = jnp.take(klo, jnp.asarray(plan.idx), axis=1)       # [b, ht, nq, V]
    khi_v = jnp.take(khi, jnp.asarray(plan.idx), axis=1)
    ql, qh = qlo[:, None, :, None], qhi[:, None, :, None]
    disjoint = (qh < klo_v) | (khi_v < ql)
    single = (ql == qh) & (klo_v == khi_v) & (ql == klo_v)
    cls = jnp.where(disjoint, 0, jnp.where(single, cls, jnp.where(cls == 1, 2, cls)))
  cls = cls.astype(jnp.int8)
  all0 = jnp.all(cls == 0, axis=(0, 1))
  all1 = jnp.all(cls == 1, axis=(0, 1))
  branch = jnp.where(all0, 0, jnp.where(all1, 1, 2)).astype(jnp.int32)
  return {"cls": cls, "branch": branch}


def _block_range(seg, block, n, length):
  """Min / max segment id of each block's real tokens: ``[b, n]`` each."""
  pad = n * block - length
  lo = jnp.pad(seg, ((0, 0), (0, pad)), constant_values=jnp.iinfo(jnp.int32).max)
  hi = jnp.pad(seg, ((0, 0), (0, pad)), constant_values=jnp.iinfo(jnp.int32).min)
  return (lo.reshape(seg.shape[0], n, block).min(-1), hi.reshape(seg.shape[0], n, block).max(-1))


# ----------------------------------------------------------------------------- layout helpers


def _to_blocks(plan: _Plan, q, k, v):
  """Pads and reshapes to tiles (f32, q pre-scaled).

  q -> ``[nq, b, hk, g, bq, d]`` (scanned over), k/v -> ``[b, hk, nk, bk, d]`` (gathered).
  """
  p = plan
  qf = jnp.pad(q.astype(_F32) * p.args.scale, ((0, 0), (0, p.nq * p.bq - p.tq), (0, 0), (0, 0)))
  qf = qf.reshape(p.b, p.nq, p.bq, p.hk, p.g, p.d).transpose(1, 0, 3, 4, 2, 5)
  def kv(x):
    x = jnp.pad(x.astype(_F32), ((0, 0), (0, p.nk * p.bk - p.tk), (0, 0), (0, 0)))
    return x.reshape(p.b, p.nk, p.bk, p.hk, x.shape[-1]).transpose(0, 3, 1, 2, 4)
  return qf, kv(k), kv(v)


def _gather(plan: _Plan, x, kb):
  """Key tile(s) ``kb`` of ``x [b, hk, nk, bk, d]``: ``[b, hk, bk, d]`` (shared table) or
  ``[b, hk, g, bk, d]`` (per-head table, ``kb [h]``)."""
  if plan.ht == 1:
    return lax.dynamic_index_in_dim(x, kb[0], axis=2, keepdims=False)
  kb = kb.reshape(plan.hk, plan.g)
  return x[:, jnp.arange(plan.hk)[:, None], kb]


def _scores(plan: _Plan, qb, kt):
  """``[b, hk, g, bq, bk]`` f32 logits of q tile ``[b, hk, g, bq, d]`` against key tile(s)."""
  if plan.ht == 1:
    return jnp.einsum("bhgqd,bhkd->bhgqk", qb, kt, preferred_element_type=_F32)
  return jnp.einsum("bhgqd,bhgkd->bhgqk", qb, kt, preferred_element_type=_F32)


def _pv(plan: _Plan, p, vt):
  if plan.ht == 1:
    return jnp.einsum("bhgqk,bhkd->bhgqd", p, vt, preferred_element_type=_F32)
  return jnp.einsum("bhgqk,bhgkd->bhgqd", p, vt, preferred_element_type=_F32)


def _visible(plan: _Plan, aux, i, j, kb):
  """Token visibility ``bool[b|1, hk, g|1, bq, bk]`` of visit ``j`` of q block ``i``."""
  a, p = plan.args, plan
  q_idx = i * p.bq + jnp.arange(p.bq)                                # [bq]
  k_idx = kb[:, None] * p.bk + jnp.arange(p.bk)[None, :]             # [ht, bk]
  qi = q_idx[None, None, :, None]
  ki = k_idx[None, :, None, :]                                       # [1, ht, 1, bk]
  qp = qi + (a.q_offset if isinstance(a.q_offset, int) else a.q_offset[:, None, None, None])
  vis = (ki < p.tk) & (qi < p.tq)
  if a.mask is not None:
    head = jnp.arange(p.h)[None, :, None, None] if a.mask.num_heads is not None else None
    vis = vis & a.mask.visible(qi, qp, ki, head)
  if a.q_segment_ids is not None:
    qs = jnp.take(a.q_segment_ids, q_idx, axis=1, mode="fill", fill_value=-1)   # [b, bq]
    ks = jnp.take(a.kv_segment_ids, k_idx, axis=1, mode="fill", fill_value=-2)  # [b, ht, bk]
    vis = vis & (qs[:, None, :, None] == ks[:, :, None, :])
  if a.kv_lengths is not None:
    vis = vis & (ki < a.kv_lengths[:, None, None, None])
  c = lax.dynamic_index_in_dim(lax.dynamic_index_in_dim(aux["cls"], i, 2, False), j, 2, False)
  vis = vis & (c != 0)[:, :, None, None]                             # padding slots / skipped heads
  bb, hh = vis.shape[:2]
  if hh == p.h:
    return vis.reshape(bb, p.hk, p.g, p.bq, p.bk)
  return vis.reshape(bb, 1, 1, p.bq, p.bk)


# ----------------------------------------------------------------------------- forward


def _forward(plan: _Plan, q, k, v, aux):
  p = plan
  qt, kt, vt = _to_blocks(p, q, k, v)
  vt = jnp.concatenate([vt, jnp.ones(vt.shape[:-1] + (1,), _F32)], axis=-1)  # [.., dv + 1]
  idx = jnp.asarray(p.idx)

  def q_block(_, xs):
    i, qb = xs                                                       # qb [b, hk, g, bq, d]
    m0 = jnp.full((p.b, p.hk, p.g, p.bq), -jnp.inf, _F32)
    acc0 = jnp.zeros((p.b, p.hk, p.g, p.bq, p.dv + 1), _F32)

    def visit(j, carry, branch):
      kb = idx[:, i, j]                                              # [ht]
      s = soft_cap(_scores(p, qb, _gather(p, kt, kb)), p.args.logits_soft_cap)
      if branch == layout_lib.PARTIAL:
        s = jnp.where(_visible(p, aux, i, j, kb), s, -jnp.inf)
      return _online_update(p, carry, s, _gather(p, vt, kb))

    m, acc = _visit_loops(p, aux, i, visit, (m0, acc0))
    acc, l = acc[..., :-1], acc[..., -1]
    l_safe = jnp.where(l > 0, l, 1.0)
    out = acc / l_safe[..., None]
    lse = jnp.where(l > 0, m + jnp.log(l_safe), -jnp.inf)
    return None, (out, lse)

  _, (out, lse) = lax.scan(q_block, None, (jnp.arange(p.nq), qt))
  # out [nq, b, hk, g, bq, dv] -> [b, tq, h, dv];  lse [nq, b, hk, g, bq] -> [b, h, tq]
  out = out.transpose(1, 0, 4, 2, 3, 5).reshape(p.b, p.nq * p.bq, p.h, p.dv)[:, :p.tq]
  lse = lse.transpose(1, 2, 3, 0, 4).reshape(p.b, p.h, p.nq * p.bq)[:, :, :p.tq]
  return out, lse


def _visit_loops(plan: _Plan, aux, i, visit, carry):
  """Runs ``visit(j, carry, branch)`` over the visits of q block ``i``.

  Static classes: slots ``[0, nfull)`` unmasked, then ``[nfull, trips)`` masked (no branching).
  Traced classes (segments, kv_lengths): ``lax.switch`` per visit over skip / full / partial.
  """
  trips = jnp.asarray(plan.trips)[i]
  if aux["branch"] is None:
    nfull = jnp.asarray(plan.nfull)[i]
    carry = lax.fori_loop(0, nfull, lambda j, c: visit(j, c, layout_lib.FULL), carry)
    return lax.fori_loop(nfull, trips, lambda j, c: visit(j, c, layout_lib.PARTIAL), carry)
  branches = (lambda j, c: c, lambda j, c: visit(j, c, layout_lib.FULL),
              lambda j, c: visit(j, c, layout_lib.PARTIAL))
  return lax.fori_loop(0, trips, lambda j, c: lax.switch(aux["branch"][i, j], branches, j, c), carry)


def _online_update(plan, carry, s, vb):
  """One online-softmax step; ``s`` may hold -inf (masked) entries, rows may be all -inf.

  ``vb`` carries a trailing ones column, so ``p @ vb`` also yields the row sums ``l`` (the
  last accumulator column) without another pass over ``p``.
  """
  m, acc = carry
  m_new = jnp.maximum(m, jnp.max(s, axis=-1))
  m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)                 # all-masked rows stay finite
  pr = jnp.exp(s - m_safe[..., None])
  corr = jnp.exp(m - m_safe)
  acc = acc * corr[..., None] + _pv(plan, pr, vb)
  return m_new, acc


# ----------------------------------------------------------------------------- backward


def _backward(plan: _Plan, q, k, v, aux, out, lse, dout, dlse):
  p = plan
  qt, kt, vt = _to_blocks(p, q, k, v)
  idx = jnp.asarray(p.idx)

  def rows(x, last):  # [b, tq, h, last] -> [nq, b, hk, g, bq, last]
    x = jnp.pad(x.astype(_F32), ((0, 0), (0, p.nq * p.bq - p.tq), (0, 0), (0, 0)))
    return x.reshape(p.b, p.nq, p.bq, p.hk, p.g, last).transpose(1, 0, 3, 4, 2, 5)

  do_t = rows(dout, p.dv)
  delta = jnp.sum(do_t * rows(out, p.dv), axis=-1)                   # [nq, b, hk, g, bq]
  dlse = jnp.pad(dlse.astype(_F32), ((0, 0), (0, 0), (0, p.nq * p.bq - p.tq)))
  delta = delta - dlse.reshape(p.b, p.hk, p.g, p.nq, p.bq).transpose(3, 0, 1, 2, 4)
  lse_t = jnp.pad(lse, ((0, 0), (0, 0), (0, p.nq * p.bq - p.tq)), constant_values=-jnp.inf)
  lse_t = lse_t.reshape(p.b, p.hk, p.g, p.nq, p.bq).transpose(3, 0, 1, 2, 4)
  lse_t = jnp.where(jnp.isfinite(lse_t), lse_t, jnp.inf)             # rows seeing nothing: p = 0
  acc_shape = (p.b, p.hk, p.nk, p.bk) if p.ht == 1 else (p.b, p.hk, p.g, p.nk, p.bk)
  dk0 = jnp.zeros(acc_shape + (p.d,), _F32)
  dv0 = jnp.zeros(acc_shape + (p.dv,), _F32)

  def q_block(carry, xs):
    i, qb, dob, lb, db = xs

    def visit(j, c, branch):
      kb = idx[:, i, j]
      dq, dk, dv = c
      kblk, vblk = _gather(p, kt, kb), _gather(p, vt, kb)
      s = _scores(p, qb, kblk)                                     # [b, hk, g, bq, bk]
      cap = p.args.logits_soft_cap
      if cap is not None:
        t = jnp.tanh(s / cap)
        s = cap * t
      pr = jnp.exp(s - lb[..., None])
      if branch == layout_lib.PARTIAL:
        pr = jnp.where(_visible(p, aux, i, j, kb), pr, 0.0)
      dp = _scores(p, dob, vblk)                                   # dO v^T
      ds = pr * (dp - db[..., None])
      if cap is not None:                                          # d cap tanh(s / cap) / ds
        ds = ds * (1.0 - t * t)
      dq = dq + _pv(p, ds, kblk)
      if p.ht == 1:
        dv_b = jnp.einsum("bhgqk,bhgqd->bhkd", pr, dob, preferred_element_type=_F32)
        dk_b = jnp.einsum("bhgqk,bhgqd->bhkd", ds, qb, preferred_element_type=_F32)
      else:
        dv_b = jnp.einsum("bhgqk,bhgqd->bhgkd", pr, dob, preferred_element_type=_F32)
        dk_b = jnp.einsum("bhgqk,bhgqd->bhgkd", ds, qb, preferred_element_type=_F32)
      return dq, _scatter_add(p, dk, kb, dk_b), _scatter_add(p, dv, kb, dv_b)

    dk, dv = carry
    dq0 = jnp.zeros((p.b, p.hk, p.g, p.bq, p.d), _F32)
    dq, dk, dv = _visit_loops(p, aux, i, visit, (dq0, dk, dv))
    return (dk, dv), dq

  (dk, dv), dq = lax.scan(q_block, (dk0, dv0), (jnp.arange(p.nq), qt, do_t, lse_t, delta))
  dq = (dq * p.args.scale).transpose(1, 0, 4, 2, 3, 5).reshape(p.b, p.nq * p.bq, p.h, p.d)
  dq = dq[:, :p.tq]
  if p.ht != 1:  # per-query-head accumulators -> kv heads
    dk, dv = dk.sum(2), dv.sum(2)
  dk = dk.transpose(0, 2, 3, 1, 4).reshape(p.b, p.nk * p.bk, p.hk, p.d)[:, :p.tk]
  dv = dv.transpose(0, 2, 3, 1, 4).reshape(p.b, p.nk * p.bk, p.hk, p.dv)[:, :p.tk]
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


def _scatter_add(plan: _Plan, acc, kb, blk):
  if plan.ht == 1:
    cur = lax.dynamic_index_in_dim(acc, kb[0], axis=2, keepdims=False)
    return lax.dynamic_update_index_in_dim(acc, cur + blk, kb[0], axis=2)
  kb = kb.reshape(plan.hk, plan.g)
  return acc.at[:, jnp.arange(plan.hk)[:, None], jnp.arange(plan.g)[None, :], kb].add(blk)


# ----------------------------------------------------------------------------- custom_vjp


def _attention(plan: _Plan, plan_bwd: _Plan, q, k, v):
  # Traced per-call inputs (segment ids, kv_lengths, a traced q_offset, the refined block
  # classes) travel as explicit arguments of the custom_vjp, never as closed-over values: a
  # closure over tracers leaks them when the op runs under shard_map, remat or nested vjps.
  a = plan.args
  traced_offset = not isinstance(a.q_offset, int)
  aux = _dynamic_classes(plan)
  aux_bwd = aux if plan_bwd is plan else _dynamic_classes(plan_bwd)
  dyn = {"aux": aux, "aux_bwd": aux_bwd, "q_offset": a.q_offset if traced_offset else None,
         "kv_lengths": a.kv_lengths, "q_seg": a.q_segment_ids, "kv_seg": a.kv_segment_ids}
  static_args = dataclasses.replace(a, q=None, k=None, v=None, kv_lengths=None,
                                    q_segment_ids=None, kv_segment_ids=None,
                                    q_offset=None if traced_offset else a.q_offset)
  static_plan = dataclasses.replace(plan, args=static_args)
  static_plan_bwd = dataclasses.replace(plan_bwd, args=static_args)

  def rebuild(dyn, backward=False):
    args = dataclasses.replace(
        static_args, kv_lengths=dyn["kv_lengths"], q_segment_ids=dyn["q_seg"],
        kv_segment_ids=dyn["kv_seg"],
        q_offset=dyn["q_offset"] if traced_offset else static_args.q_offset)
    if backward:
      return dataclasses.replace(static_plan_bwd, args=args), dyn["aux_bwd"]
    return dataclasses.replace(static_plan, args=args), dyn["aux"]

  @jax.custom_vjp
  def attn(q, k, v, dyn):
    p, ax = rebuild(dyn)
    out, lse = _forward(p, q, k, v, ax)
    return out.astype(q.dtype), lse

  def fwd(q, k, v, dyn):
    p, ax = rebuild(dyn)
    out, lse = _forward(p, q, k, v, ax)
    out = out.astype(q.dtype)
    return (out, lse), (q, k, v, out, lse, dyn)

  def bwd(res, cts):
    q, k, v, out, lse, dyn = res
    p, ax = rebuild(dyn, backward=True)
    dout, dlse = cts  # d lse / d s = p, so dlse folds into delta: ds = p (dp - delta + dlse)
    dq, dk, dv = _backward(p, q, k, v, ax, out, lse, dout, dlse)
    return dq, dk, dv, jax.tree.map(_zero_cotangent, dyn)

  attn.defvjp(fwd, bwd)
  return attn(q, k, v, dyn)


def _zero_cotangent(x):
  if jnp.issubdtype(x.dtype, jnp.inexact):
    return jnp.zeros_like(x)
  return np.zeros(x.shape, jax.dtypes.float0)
