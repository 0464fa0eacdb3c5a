"""Pallas backends of ``attention``: ``"pallas"`` (Triton on GPU, Mosaic on TPU) and
``"pallas_interpret"`` (the same kernel interpreted on CPU, for tests).

This wrapper compiles the mask to the kernel's block layout (``layout.py``), packs the visit
tables, pads lengths / head_dim to the kernel's hardware-friendly sizes and calls
``pallas_kernels.flash_attention``. Token masks are evaluated in-kernel from the lazy mask;
``BlockSparse`` layouts become per-visit bits: each kernel tile sits inside one layout row, and
inside one layout column or over whole columns (a 128-key Mosaic tile over 64-key columns
carries one bit per column) — otherwise ``NotImplementedError`` (and ``impl="auto"`` falls back
to ``xla``). Without explicit block sizes the tiles follow the mask
(``BlockSizes.for_mask``): a 64-token layout runs in 64-key tiles on Triton, so skipped layout
blocks are skipped tiles.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax
import numpy as np

from jaxsys.core.dispatch import require_backend
from jaxsys.ops import masks as M
from jaxsys.ops.attn import layout as layout_lib
from jaxsys.ops.attn.common import AttentionArgs
from pallas_kernels import flash_attention as fa
from pallas_kernels import flash_tpu
from pallas_kernels import flash_tiles as fta
from pallas_kernels.backend import next_pow2

__all__ = ["BlockSizes", "pallas_attention", "pallas_compiled", "pallas_interpreted"]

BlockSizes = fa.BlockSizes


def _bit_slots(nodes, block_k: int) -> list[tuple[int, int]]:
  """``(first bit, columns)`` per BlockSparse node: a kv tile over ``c`` whole layout columns
  carries ``c`` bits (column ``s`` of the tile at bit ``first + s``)."""
  slots, first = [], 0
  for n in nodes:
    cols = block_k // n.block_k if block_k > n.block_k else 1
    slots.append((first, cols))
    first += cols
  if first > 31:
    raise NotImplementedError(
        f"BlockSparse layouts need {first} bits per kernel block ({len(nodes)} masks, kv tile "
        f"{block_k=} over layout block_k {[n.block_k for n in nodes]}); at most 31 fit")
  return slots


def _visible_fn(mask, nodes, slots):
  """``(qi, qpos, ki, head, bits) -> bool``: the mask with BlockSparse layouts read from bits."""
  ids = {id(n): t for t, n in enumerate(nodes)}

  def layout_bit(m, ki, bits):
    first, cols = slots[ids[id(m)]]
    if cols == 1:
      return ((bits >> first) & 1) == 1
    # [1, bk] layout column inside the tile; ki >= 0, so truncating div/rem (floor division
    # lowers through sign(), which Mosaic's lowering needs a TPU generation for)
    col = lax.rem(lax.div(ki, jnp.int32(m.block_k)), jnp.int32(cols))
    vis = jnp.zeros(ki.shape, bool)
    for c in range(cols):  # scalar shifts only (no per-lane variable shift in the kernel)
      vis = vis | ((col == c) & (((bits >> (first + c)) & 1) == 1))
    return vis

  def ev(m, qi, qpos, ki, head, bits):
    if isinstance(m, M.BlockSparse):
      vis = layout_bit(m, ki, bits)
      if m.token_mask is not None:
        vis = vis & ev(m.token_mask, qi, qpos, ki, head, bits)
      return vis
    if isinstance(m, (M.Or, M.And)):
      out = ev(m.masks[0], qi, qpos, ki, head, bits)
      for c in m.masks[1:]:
        nxt = ev(c, qi, qpos, ki, head, bits)
        out = (out | nxt) if isinstance(m, M.Or) else (out & nxt)
      return out
    if isinstance(m, M.MultiHead):
      out = jnp.zeros(jnp.broadcast_shapes(qi.shape, ki.shape), bool)
      for h, c in enumerate(m.masks):
        out = out | ((head == h) & ev(c, qi, qpos, ki, head, bits))
      return out
    return m.visible(qi, qpos, ki, None)

  def fn(qi, qpos, ki, head, bits):
    if mask is None:
      return jnp.ones(jnp.broadcast_shapes(qi.shape, ki.shape), bool)
    return ev(mask, qi, qpos, ki, head, bits)
  return fn


def _choose_blocks(bs: fa.BlockSizes | None, mask, tq, tk, nodes, backend, itemsize=None,
                   head_dim=None):
  if bs is None:
    bs = fa.BlockSizes.for_mask(mask, q_len=tq, kv_len=tk, backend=backend, itemsize=itemsize,
                                head_dim=head_dim)
    return bs.block_q, bs.block_k
  # Explicit sizes, clipped to short lengths and shrunk to a common divisor of the layout cells
  # (each tile inside one cell); Mosaic kv tiles instead stay over whole columns when they can
  # (below 128 keys the TPU lowering refuses them).
  bq = min(bs.block_q, max(16, next_pow2(tq)))
  bk = min(bs.block_k, max(16, next_pow2(tk)))
  for n in nodes:
    bq = math.gcd(bq, n.block_q)
    if backend != "mosaic" or bk % n.block_k:
      bk = math.gcd(bk, n.block_k)
  if backend == "triton" and (bq < 16 or bk < 16):
    raise NotImplementedError(
        f"BlockSparse block sizes need a common power-of-two tile >= 16 (got block_q={bq}, "
        f"block_k={bk})")
  fa.check_kv_cells(bk, [n.block_k for n in nodes], backend)
  return bq, bk


def _block_bits(nodes, slots, lay: layout_lib.BlockLayout):
  """int64 ``[Ht, nq, nk]``: the layout bits of every BlockSparse node at each kernel block."""
  nq, nk = lay.num_q_blocks, lay.num_k_blocks
  ht = lay.cls.shape[0]
  bits = np.zeros((ht, nq, nk), np.int64)
  qb = np.arange(nq) * lay.block_q
  kb = np.arange(nk) * lay.block_k
  for n, (first, cols) in zip(nodes, slots):
    L = n.layout
    a = np.clip(qb // n.block_q, 0, L.shape[1] - 1)
    for s in range(cols):
      c = np.clip(kb // n.block_k + s, 0, L.shape[2] - 1)
      val = L[:, a][:, :, c].astype(np.int64)                  # [H_n, nq, nk]
      if val.shape[0] != ht:
        val = np.broadcast_to(val[:1] if ht == 1 else val, (ht, nq, nk))
      bits |= val << (first + s)
  return bits


def pallas_attention(args: AttentionArgs, block_sizes: fa.BlockSizes | None = None, *,
                     backend: str = "triton", interpret: bool = False, num_warps: int | None = None,
                     num_stages: int | None = None):
  """``(out [b, q, h, dv], lse [b, h, q])`` via the Pallas kernel.

  Compiled Triton calls take their tiles and launch parameters from
  ``pallas_kernels.flash_tiles.TRITON_TILES`` (the verified sm_90a table) unless ``block_sizes``
  / ``num_warps`` / ``num_stages`` say otherwise, and refuse with ``NotImplementedError`` --
  before anything is traced, so ``impl="auto"`` falls back -- a head_dim beyond the table or
  tiles whose shared memory exceeds an H100's (``flash_tiles.check_smem``)."""
  if args.dense_terms or args.logits_soft_cap is not None or M.contains(args.mask, M.Dense):
    # the kernel evaluates lazy masks only; these run on the XLA path (auto falls back)
    raise NotImplementedError("the Pallas attention kernel takes no dense mask, bias or logits_soft_cap")
  q, k, v = args.q, args.k, args.v
  b, tq, h, d = q.shape
  tk, hk, dv = k.shape[1], k.shape[2], v.shape[-1]
  nodes = fa.block_sparse_nodes(args.mask)
  if len(nodes) > 31:
    raise NotImplementedError(f"at most 31 BlockSparse masks per call, got {len(nodes)}")
  d_p = max(16, next_pow2(d)) if backend == "triton" else d
  dv_p = max(16, next_pow2(dv)) if backend == "triton" else dv
  hw = backend == "triton" and not interpret  # the sm_90a budgets apply to compiled Triton only
  size = jnp.dtype(q.dtype).itemsize
  bq, bk = _choose_blocks(block_sizes, args.mask, tq, tk, nodes, backend,
                          *((size, max(d_p, dv_p)) if hw else (None, None)))
  num_warps, num_stages = _launch(block_sizes, bq, bk, size, max(d_p, dv_p), num_warps, num_stages, hw)
  if hw:
    fta.check_smem(bq, bk, d_p, dv_p, size, num_stages)
  slots = _bit_slots(nodes, bk)
  lay = layout_lib.compile_layout(args.mask, heads=h, q_len=tq, kv_len=tk, block_q=bq,
                                  block_k=bk, q_offset=args.static_offset)
  cls = lay.cls
  if args.q_segment_ids is not None or args.kv_lengths is not None:
    cls = np.where(cls == layout_lib.FULL, layout_lib.PARTIAL, cls).astype(np.int8)
  lay = layout_lib.BlockLayout(cls, bq, bk, tq, tk)
  tables, tables_t = lay.tables, lay.transposed_tables
  bits = _block_bits(nodes, slots, lay)                                     # [Ht, nq, nk]
  bits_g = np.take_along_axis(bits, tables[0], axis=-1)
  bits_t = np.take_along_axis(np.swapaxes(bits, 1, 2), tables_t[0], axis=-1)
  tab, v_fwd = fa.pack_tables(*tables, bits_g, backend=backend)
  tab_t, v_bwd = fa.pack_tables(*tables_t, bits_t, backend=backend)
  if backend == "mosaic" and not interpret:  # the TPU budgets: SMEM tables, streamed VMEM tiles
    flash_tpu.check_budgets(max(tab.nbytes, tab_t.nbytes), bq, bk, d_p, dv_p, size)

  def padded(length, blk):
    n = -(-length // blk)
    return blk * (next_pow2(n) if backend == "triton" else n)

  tq_p, tk_p = padded(tq, bq), padded(tk, bk)
  # Padding rows of the tables (beyond the real block count) visit nothing.
  tab = _pad_rows(tab, tq_p // bq)
  tab_t = _pad_rows(tab_t, tk_p // bk)
  cfg = fa.KernelConfig(heads=h, kv_heads=hk, table_heads=cls.shape[0], visits=v_fwd,
                        visits_t=v_bwd, block_q=bq, block_k=bk, scale=args.scale, q_len=tq,
                        kv_len=tk, visible_fn=_visible_fn(args.mask, nodes, slots), backend=backend,
                        interpret=interpret, num_warps=num_warps, num_stages=num_stages)

  def prep(x, length, dim):  # [b, t, heads, d] -> [b, heads, T, D] zero padded
    x = jnp.pad(x, ((0, 0), (0, length - x.shape[1]), (0, 0), (0, dim - x.shape[-1])))
    return x.transpose(0, 2, 1, 3)

  qp, kp, vp = prep(q, tq_p, d_p), prep(k, tk_p, d_p), prep(v, tk_p, dv_p)
  if args.q_segment_ids is not None:
    qseg = jnp.pad(args.q_segment_ids, ((0, 0), (0, tq_p - tq)), constant_values=-1)
    kseg = jnp.pad(args.kv_segment_ids, ((0, 0), (0, tk_p - tk)), constant_values=-2)
  else:
    qseg = jnp.zeros((b, tq_p), jnp.int32)
    kseg = jnp.zeros((b, tk_p), jnp.int32)
  off = args.q_offset
  off = jnp.full((b,), off, jnp.int32) if isinstance(off, int) else off.astype(jnp.int32)
  lens = jnp.full((b,), tk, jnp.int32) if args.kv_lengths is None else args.kv_lengths
  scal = jnp.stack([off, lens.astype(jnp.int32)], axis=1)            # [b, 2]
  out, lse = fa.flash_attention(cfg, jnp.asarray(tab), jnp.asarray(tab_t), scal, qp, kp, vp,
                                qseg[:, :, None], kseg[:, None, :])
  out = out.transpose(0, 2, 1, 3)[:, :tq, :, :dv]                     # [b, q, h, dv]
  return out, lse[:, :, :tq, 0]


def _launch(bs, bq, bk, itemsize, head_dim, num_warps, num_stages, hw):
  """``(num_warps, num_stages)``: the arguments, else ``bs``'s, else the verified table's (compiled
  Triton) or the kernel's defaults (4, 2)."""
  warps = num_warps or (bs.num_warps if bs is not None else None)
  stages = num_stages or (bs.num_stages if bs is not None else None)
  if warps is None or stages is None:
    table = fta.launch(bq, bk, itemsize, head_dim) if hw else (4, 2)
    warps, stages = warps or table[0], stages or table[1]
  return warps, stages


def _pad_rows(tab, n):
  if tab.shape[1] >= n:
    return tab
  pad = np.zeros((tab.shape[0], n - tab.shape[1], tab.shape[2]), np.int32)
  return np.concatenate([tab, pad], axis=1)


def pallas_compiled(args: AttentionArgs):
  """``impl="pallas"``: Triton on GPU, Mosaic on TPU."""
  require_backend("attention")
  return pallas_attention(args, backend="triton" if jax.default_backend() == "gpu" else "mosaic")


def pallas_interpreted(args: AttentionArgs):
  """``impl="pallas_interpret"``: the same kernel interpreted (any backend; tests on CPU)."""
  return pallas_attention(args, backend="triton", interpret=True)
