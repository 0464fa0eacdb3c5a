"""The Mosaic (TPU) flash-attention kernels: visited K/V blocks streamed through the grid.

The Triton kernels (``flash_attention.py``) hold a kv head's whole K/V rows per program and
slice the visited tiles, so their VMEM grows with length: ~17 MiB at 16K forward, and the dk/dv
kernel ~16 MiB at 4K, over v5e's 16 MiB default scoped VMEM. Here, as in splash attention, the
last grid axis walks a row's visit slots ("arbitrary": sequential on one core) and the index
maps read the visit table from SMEM, so the pipeline DMAs exactly the visited ``[bk, d]`` blocks
and VMEM holds a constant number of tiles at any length:

=======  ==========================  =======================================================
kernel   grid                        streamed by the table (the rest is one block per row)
=======  ==========================  =======================================================
fwd      ``(b, h, nq, V)``           K, V, kv segment ids
dq       ``(b, h, nq, V)``           K, V, kv segment ids
dk/dv    ``(b, h, nk, V_t)``         Q, dO, lse, delta, q segment ids (transposed table)
=======  ==========================  =======================================================

Slots past a row's count repeat its last visited block (the ``data_next`` idea of splash: equal
consecutive block indices skip the DMA) and do no compute. The running max / sum / accumulator
(FlashAttention-2's ``m, l, acc``; dq; dk, dv) live in VMEM scratch, are reset at slot 0 and
written out at the last slot.

Tables (``pack_tables``): int32 ``[Ht, n, W]`` rows ``[count, word[V], bits[V]]`` with ``word =
block_id << 2 | class`` (class 1 = fully visible, 2 = evaluate the token mask) and the
``bits`` columns only when the mask has BlockSparse layouts; no power-of-two padding (SMEM reads
are scalar). A causal 32K table at 128-token tiles is 256 x 257 words (257 KiB), under
:data:`TPU_SMEM_BUDGET_BYTES`; past it, or past :data:`TPU_VMEM_BUDGET_BYTES` of estimated
VMEM (:func:`vmem_bytes`), :func:`check_budgets` raises ``NotImplementedError`` and
``impl="auto"`` runs the XLA twin. Each call sets ``vmem_limit_bytes`` from its estimate.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.flash_common import (F32, KernelConfig, dot, dot_ta, lse_delta, mask_scores,
                                         sum_query_groups)

__all__ = ["backward", "check_budgets", "forward", "pack_tables", "TPU_SMEM_BUDGET_BYTES",
           "TPU_VMEM_BUDGET_BYTES", "vmem_bytes", "vmem_limit"]

#: Half of the 1 MiB SMEM per core (TPU v4 and later): the visit table of one call must fit.
TPU_SMEM_BUDGET_BYTES = 512 * 1024
#: v5e's default scoped VMEM: an estimate above it is refused (any generation holds it).
TPU_VMEM_BUDGET_BYTES = 16 * 1024 * 1024
_LANES = 128
_CLASS_BITS = 2


# ----------------------------------------------------------------------------- tables and budgets


def pack_tables(idx, cls, cnt, bits=None) -> np.ndarray:
  """``idx, cls [Ht, n, V]``, ``cnt [Ht, n]`` (and per-visit ``bits [Ht, n, V]`` or None) ->
  int32 ``[Ht, n, 1 + V (+ V)]`` rows ``[count, block_id << 2 | class, bits]``."""
  idx, cls = np.asarray(idx, np.int64), np.asarray(cls, np.int64)
  ht, n, v = idx.shape
  words = [np.asarray(cnt, np.int64)[..., None], (idx << _CLASS_BITS) | cls]
  if bits is not None and np.any(bits):
    words.append(np.asarray(bits, np.int64))
  if v == 0:  # a call that sees nothing still needs one slot per row
    words = [words[0], np.zeros((ht, n, 1), np.int64)]
  return np.concatenate(words, axis=-1).astype(np.int32)


def _tile_bytes(rows: int, cols: int, itemsize: int) -> int:
  """VMEM bytes of a ``[rows, cols]`` tile: (8 x 128) words, 16 rows per sublane group in bf16."""
  sub = 8 * max(1, 4 // itemsize)
  return -(-rows // sub) * sub * -(-cols // _LANES) * _LANES * itemsize


def vmem_bytes(kernel: str, block_q: int, block_k: int, d: int, dv: int, itemsize: int) -> int:
  """Estimated VMEM of one grid step of ``kernel`` ("fwd", "dq", "dkdv"): the double-buffered
  input and output blocks, the f32 scratch, and the ``[bq, bk]`` f32 intermediates (s, p, dp,
  ds). Independent of sequence length: the blocks are streamed."""
  bq, bk = block_q, block_k
  t = _tile_bytes
  col, seg_q, seg_k = t(bq, 1, 4), t(bq, 1, 4), t(1, bk, 4)
  kv = t(bk, d, itemsize) + t(bk, dv, itemsize)
  if kernel == "fwd":
    blocks = t(bq, d, itemsize) + kv + seg_q + seg_k + t(bq, dv, itemsize) + col
    scratch, tiles = 2 * t(bq, _LANES, 4) + t(bq, dv, 4), 3
  elif kernel == "dq":
    blocks = t(bq, d, itemsize) + kv + seg_q + seg_k + t(bq, dv, itemsize) + 2 * col + t(bq, d, itemsize)
    scratch, tiles = t(bq, d, 4), 4
  elif kernel == "dkdv":
    blocks = (t(bq, d, itemsize) + kv + seg_q + seg_k + t(bq, dv, itemsize) + 2 * col
              + t(bk, d, 4) + t(bk, dv, 4))
    scratch, tiles = t(bk, d, 4) + t(bk, dv, 4), 4
  else:
    raise ValueError(f"kernel={kernel!r} must be 'fwd', 'dq' or 'dkdv'")
  return 2 * blocks + scratch + tiles * t(bq, bk, 4)


def vmem_limit(estimate: int) -> int:
  """``vmem_limit_bytes`` for a call: twice the estimate (Mosaic's own temporaries), at least
  4 MiB, rounded up to a MiB."""
  mib = 1 << 20
  return max(4 * mib, -(-2 * estimate // mib) * mib)


def check_budgets(tab_bytes: int, block_q: int, block_k: int, d: int, dv: int, itemsize: int):
  """Refuses (``NotImplementedError``, before anything is traced) a call whose visit table
  exceeds :data:`TPU_SMEM_BUDGET_BYTES` or whose largest kernel's VMEM estimate exceeds
  :data:`TPU_VMEM_BUDGET_BYTES`; returns that estimate."""
  if tab_bytes > TPU_SMEM_BUDGET_BYTES:
    raise NotImplementedError(
        f"flash attention on TPU: visit table of {tab_bytes} bytes exceeds the SMEM budget "
        f"{TPU_SMEM_BUDGET_BYTES} (more heads with their own tables, or smaller tiles, than fit);"
        " the XLA twin runs this call")
  est = max(vmem_bytes(k, block_q, block_k, d, dv, itemsize) for k in ("fwd", "dq", "dkdv"))
  if est > TPU_VMEM_BUDGET_BYTES:
    raise NotImplementedError(
        f"flash attention on TPU: {block_q}x{block_k} tiles at head_dim {d}/{dv} need ~{est} bytes "
        f"of VMEM, over the budget {TPU_VMEM_BUDGET_BYTES}; the XLA twin runs this call")
  return est


# ----------------------------------------------------------------------------- table reads


class _Visits:
  """Slot ``j`` of table row ``row`` of head ``head``, read from SMEM (scalar reads)."""

  def __init__(self, cfg: KernelConfig, tab_ref, head, row, visits: int):
    self.tab, self.row, self.v = tab_ref, row, visits
    self.th = head if cfg.table_heads > 1 else 0
    self.has_bits = tab_ref.shape[-1] == 1 + 2 * visits

  def count(self):
    return self.tab[self.th, self.row, 0]

  def slot(self, j):
    """``j`` clamped to the row's last visit: past the count the index maps repeat a block."""
    return jnp.minimum(j, jnp.maximum(self.count() - 1, 0))

  def block(self, j):
    return self.tab[self.th, self.row, 1 + self.slot(j)] >> _CLASS_BITS

  def cls(self, j):
    return self.tab[self.th, self.row, 1 + j] & ((1 << _CLASS_BITS) - 1)

  def bits(self, j):
    return self.tab[self.th, self.row, 1 + self.v + j] if self.has_bits else jnp.int32(0)


def _block_spec(cfg, shape, which, visits=None):
  """BlockSpec of one operand on the ``(b, h, row, slot)`` grid, block ``shape`` (leading Nones
  squeezed). Its block index on the sequence axis is the grid row (``visits=None``: read once per
  row, resident across the slots) or the block visited at ``slot`` (streamed by the table).
  ``which`` says whose index the other axes take: "kv" (kv head h // group), "q" (query head
  h), "seg_q" / "seg_k" (segment ids: no head axis)."""
  g = cfg.group

  def index(b, h, r, t, tab_ref, scal_ref):
    blk = r if visits is None else _Visits(cfg, tab_ref, h, r, visits).block(t)
    if which == "seg_q":
      return b, blk, 0
    if which == "seg_k":
      return b, 0, blk
    return b, lax.div(h, g) if which == "kv" else h, blk, 0
  return pl.BlockSpec(shape, index)


# ----------------------------------------------------------------------------- kernels


def _fwd_kernel(cfg: KernelConfig, tab_ref, scal_ref, q_ref, k_ref, v_ref, qseg_ref, kseg_ref,
                o_ref, lse_ref, m_scr, l_scr, acc_scr):
  b, head, i, j = (pl.program_id(a) for a in range(4))
  bq, bk = cfg.block_q, cfg.block_k
  row = _Visits(cfg, tab_ref, head, i, cfg.visits)

  @pl.when(j == 0)
  def _init():
    m_scr[...] = jnp.full(m_scr.shape, -jnp.inf, F32)
    l_scr[...] = jnp.zeros(l_scr.shape, F32)
    acc_scr[...] = jnp.zeros(acc_scr.shape, F32)

  @pl.when(j < row.count())
  def _visit():
    start = row.block(j) * bk
    q, k, v = q_ref[...], k_ref[...], v_ref[...]              # [bq, d], [bk, d], [bk, dv]
    s = dot(q, k, trans_b=True) * cfg.scale                   # [bq, bk] f32
    qi = i * bq + lax.broadcasted_iota(jnp.int32, (bq, 1), 0)
    ki = start + lax.broadcasted_iota(jnp.int32, (1, bk), 1)
    s = mask_scores(cfg, s, row.cls(j), qi, qi + scal_ref[b, 0], ki, head, row.bits(j),
                    qseg_ref[...], kseg_ref[...], scal_ref[b, 1])
    m = m_scr[:, :1]                                          # [bq, 1] of the lane-wide scratch
    m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)         # all-masked rows stay finite
    p = jnp.exp(s - m_safe)
    corr = jnp.exp(m - m_safe)
    l_new = l_scr[:, :1] * corr + jnp.sum(p, axis=1, keepdims=True)
    m_scr[...] = jnp.broadcast_to(m_new, m_scr.shape)
    l_scr[...] = jnp.broadcast_to(l_new, l_scr.shape)
    acc_scr[...] = acc_scr[...] * corr + dot(p.astype(v.dtype), v)

  @pl.when(j == cfg.visits - 1)
  def _finish():
    l = l_scr[:, :1]
    l_safe = jnp.where(l > 0, l, 1.0)
    o_ref[...] = (acc_scr[...] / l_safe).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(l > 0, m_scr[:, :1] + jnp.log(l_safe), -jnp.inf)


def _p_ds(cfg, q, k, v, do, lse, delta, s_mask):
  """``p = exp(s - lse)`` and ``ds = p (dO V^T - delta)`` of one ``[bq, bk]`` tile (Alg. 2)."""
  lse = jnp.where(lse == -jnp.inf, jnp.inf, lse)              # rows that see nothing: p = 0
  s = s_mask(dot(q, k, trans_b=True) * cfg.scale)
  p = jnp.exp(s - lse)
  return p, p * (dot(do, v, trans_b=True) - delta)


def _dq_kernel(cfg: KernelConfig, tab_ref, scal_ref, q_ref, k_ref, v_ref, qseg_ref, kseg_ref,
               do_ref, lse_ref, delta_ref, dq_ref, dq_scr):
  b, head, i, j = (pl.program_id(a) for a in range(4))
  bq, bk = cfg.block_q, cfg.block_k
  row = _Visits(cfg, tab_ref, head, i, cfg.visits)

  @pl.when(j == 0)
  def _init():
    dq_scr[...] = jnp.zeros(dq_scr.shape, F32)

  @pl.when(j < row.count())
  def _visit():
    qi = i * bq + lax.broadcasted_iota(jnp.int32, (bq, 1), 0)
    ki = row.block(j) * bk + lax.broadcasted_iota(jnp.int32, (1, bk), 1)
    s_mask = lambda s: mask_scores(cfg, s, row.cls(j), qi, qi + scal_ref[b, 0], ki, head,
                                   row.bits(j), qseg_ref[...], kseg_ref[...], scal_ref[b, 1])
    k = k_ref[...]
    _, ds = _p_ds(cfg, q_ref[...], k, v_ref[...], do_ref[...], lse_ref[...], delta_ref[...], s_mask)
    dq_scr[...] += dot(ds.astype(k.dtype), k)

  @pl.when(j == cfg.visits - 1)
  def _finish():
    dq_ref[...] = (dq_scr[...] * cfg.scale).astype(dq_ref.dtype)


def _dkdv_kernel(cfg: KernelConfig, tab_ref, scal_ref, q_ref, k_ref, v_ref, qseg_ref, kseg_ref,
                 do_ref, lse_ref, delta_ref, dk_ref, dv_ref, dk_scr, dv_scr):
  b, head, jb, t = (pl.program_id(a) for a in range(4))
  bq, bk = cfg.block_q, cfg.block_k
  row = _Visits(cfg, tab_ref, head, jb, cfg.visits_t)

  @pl.when(t == 0)
  def _init():
    dk_scr[...] = jnp.zeros(dk_scr.shape, F32)
    dv_scr[...] = jnp.zeros(dv_scr.shape, F32)

  @pl.when(t < row.count())
  def _visit():
    qi = row.block(t) * bq + lax.broadcasted_iota(jnp.int32, (bq, 1), 0)
    ki = jb * bk + lax.broadcasted_iota(jnp.int32, (1, bk), 1)
    s_mask = lambda s: mask_scores(cfg, s, row.cls(t), qi, qi + scal_ref[b, 0], ki, head,
                                   row.bits(t), qseg_ref[...], kseg_ref[...], scal_ref[b, 1])
    q, do = q_ref[...], do_ref[...]
    p, ds = _p_ds(cfg, q, k_ref[...], v_ref[...], do, lse_ref[...], delta_ref[...], s_mask)
    dv_scr[...] += dot_ta(p.astype(do.dtype), do)
    dk_scr[...] += dot_ta(ds.astype(q.dtype), q)

  @pl.when(t == cfg.visits_t - 1)
  def _finish():
    dk_ref[...] = dk_scr[...] * cfg.scale
    dv_ref[...] = dv_scr[...]


# ----------------------------------------------------------------------------- pallas_call plumbing


def _call(cfg: KernelConfig, kernel, name, kind, rows, visits, tab, scal, in_specs, arrays,
          out_specs, out_shape, scratch):
  b, h = arrays[0].shape[:2]
  d, dv = arrays[0].shape[-1], arrays[2].shape[-1]
  est = vmem_bytes(kind, cfg.block_q, cfg.block_k, d, dv, jnp.dtype(arrays[0].dtype).itemsize)
  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=2, grid=(b, h, rows, visits), in_specs=in_specs, out_specs=out_specs,
      scratch_shapes=scratch)
  params = None if cfg.interpret else pltpu.CompilerParams(
      dimension_semantics=("parallel", "parallel", "parallel", "arbitrary"),
      vmem_limit_bytes=vmem_limit(est))
  return pl.pallas_call(functools.partial(kernel, cfg), out_shape=out_shape, grid_spec=grid_spec,
                        compiler_params=params, interpret=cfg.interpret, name=name)(
                            tab, scal, *arrays)


def _specs(cfg: KernelConfig, d: int, dv: int, visits: int):
  bq, bk = cfg.block_q, cfg.block_k
  sq = lambda shape, which: _block_spec(cfg, shape, which, visits)  # noqa: E731
  rw = functools.partial(_block_spec, cfg)
  return {
      # forward / dq: rows are q blocks, K/V streamed
      "q_row": rw((None, None, bq, d), "q"), "o_row": rw((None, None, bq, dv), "q"),
      "col_row": rw((None, None, bq, 1), "q"), "qseg_row": rw((None, bq, 1), "seg_q"),
      "k_vis": sq((None, None, bk, d), "kv"), "v_vis": sq((None, None, bk, dv), "kv"),
      "kseg_vis": sq((None, 1, bk), "seg_k"),
      # dk/dv: rows are kv blocks, the q side streamed
      "k_row": rw((None, None, bk, d), "kv"), "v_row": rw((None, None, bk, dv), "kv"),
      "dk_row": rw((None, None, bk, d), "q"), "dv_row": rw((None, None, bk, dv), "q"),
      "kseg_row": rw((None, 1, bk), "seg_k"),
      "q_vis": sq((None, None, bq, d), "q"), "do_vis": sq((None, None, bq, dv), "q"),
      "col_vis": sq((None, None, bq, 1), "q"), "qseg_vis": sq((None, bq, 1), "seg_q"),
  }


def forward(cfg: KernelConfig, tab, scal, q, k, v, qseg, kseg):
  """``(out [b, h, Tq, dv], lse [b, h, Tq, 1] f32)``; arguments as ``flash_attention``."""
  b, h, tq, d = q.shape
  dv = v.shape[-1]
  sp = _specs(cfg, d, dv, cfg.visits)
  out_shape = [jax.ShapeDtypeStruct((b, h, tq, dv), q.dtype),
               jax.ShapeDtypeStruct((b, h, tq, 1), F32)]
  scratch = [pltpu.VMEM((cfg.block_q, _LANES), F32), pltpu.VMEM((cfg.block_q, _LANES), F32),
             pltpu.VMEM((cfg.block_q, dv), F32)]
  return _call(cfg, _fwd_kernel, "flash_attention_fwd", "fwd", tq // cfg.block_q, cfg.visits,
               tab, scal, [sp["q_row"], sp["k_vis"], sp["v_vis"], sp["qseg_row"], sp["kseg_vis"]],
               [q, k, v, qseg, kseg], [sp["o_row"], sp["col_row"]], out_shape, scratch)


def backward(cfg: KernelConfig, tab, tab_t, scal, q, k, v, qseg, kseg, out, lse, do, dlse):
  """``(dq, dk, dv)``: the dq kernel over ``tab``, the dk/dv kernel over ``tab_t``."""
  b, h, tq, d = q.shape
  tk, dv = k.shape[2], v.shape[-1]
  delta = lse_delta(do, out, dlse)
  sp = _specs(cfg, d, dv, cfg.visits)
  dq = _call(cfg, _dq_kernel, "flash_attention_bwd_dq", "dq", tq // cfg.block_q, cfg.visits, tab,
             scal, [sp["q_row"], sp["k_vis"], sp["v_vis"], sp["qseg_row"], sp["kseg_vis"],
                    sp["o_row"], sp["col_row"], sp["col_row"]],
             [q, k, v, qseg, kseg, do, lse, delta], [sp["q_row"]],
             [jax.ShapeDtypeStruct(q.shape, q.dtype)], [pltpu.VMEM((cfg.block_q, d), F32)])[0]
  spt = _specs(cfg, d, dv, cfg.visits_t)
  # dk/dv per query head (f32), summed over each kv head's query group afterwards.
  dk, dvv = _call(cfg, _dkdv_kernel, "flash_attention_bwd_dkdv", "dkdv", tk // cfg.block_k,
                  cfg.visits_t, tab_t, scal,
                  [spt["q_vis"], spt["k_row"], spt["v_row"], spt["qseg_vis"], spt["kseg_row"],
                   spt["do_vis"], spt["col_vis"], spt["col_vis"]],
                  [q, k, v, qseg, kseg, do, lse, delta], [spt["dk_row"], spt["dv_row"]],
                  [jax.ShapeDtypeStruct((b, h, tk, d), F32), jax.ShapeDtypeStruct((b, h, tk, dv), F32)],
                  [pltpu.VMEM((cfg.block_k, d), F32), pltpu.VMEM((cfg.block_k, dv), F32)])
  return (dq, *sum_query_groups(cfg, dk, dvv, k.dtype, v.dtype))
