"""Block-sparse flash attention (forward + backward) in Pallas, for Triton (GPU) and Mosaic (TPU).

FlashAttention-2 (Dao 2023) over a *visit table*: program ``(batch, head, q block i)`` loops only
over the kv blocks listed for row ``i`` of its head's table, with the online softmax
``m' = max(m, rowmax s); l' = l e^{m-m'} + rowsum e^{s-m'}; acc' = acc e^{m-m'} + e^{s-m'} v``.
Backward (Alg. 2): a dq kernel over the same table and a dk/dv kernel over the transposed table
(per kv block, the q blocks that visit it), both recomputing ``p = exp(s - lse)``.

Tables are int32 ``tab[Ht, n, W]`` rows ``[count, ids[V], classes[V], bits[V], 0...]`` (Ht = 1
shared or one per query head): class 1 = block fully visible (no token mask), 2 = evaluate the
token mask ``visible_fn(q_idx, q_pos, k_idx, head, bits) -> bool`` given by the caller; ``bits``
carries per-block constants (e.g. block-sparse layout bits). The tables are ordinary blocked
inputs here; the Mosaic (TPU) kernels of ``flash_tpu.py`` scalar-prefetch a packed form into SMEM
and stream the visited K/V blocks through the grid (``flash_attention`` picks by backend).

Layout: q/out ``[b, h, Tq, d]``, k/v ``[b, hk, Tk, d]`` with lengths padded to block multiples
(the XLA twin is ``jaxsys.ops.attn.xla``; the wrapper is ``jaxsys.ops.attn.pallas``).
Query head ``h`` reads kv head ``h // (heads // kv_heads)``; each Triton program holds its kv
head's full K/V rows and slices the visited tiles (memory linear in length, read from L2/HBM).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import flash_tiles, flash_tpu
from pallas_kernels.backend import next_pow2, triton_params
from pallas_kernels.flash_common import (BACKENDS, F32, KernelConfig, dot, dot_ta, lse_delta,
                                         mask_scores, sum_query_groups)

__all__ = ["BACKENDS", "block_sparse_nodes", "BlockSizes", "check_kv_cells", "flash_attention",
           "KernelConfig", "layout_cells", "pack_tables"]



@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Kernel tile sizes and (Triton only) launch parameters. Hardware rules (checked by the
  compilers, not here): Triton wants powers of two (>= 16 for dots); Mosaic wants ``block_q % 8
  == 0`` and ``block_k % 128 == 0``. ``num_warps`` / ``num_stages``: None takes them from
  ``pallas_kernels.flash_tiles.TRITON_TILES`` for the call's dtype and head_dim."""
  block_q: int = 128
  block_k: int = 128
  num_warps: int | None = None
  num_stages: int | None = None

  def __post_init__(self):
    for name in ("block_q", "block_k"):
      value = getattr(self, name)
      if not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive int")
    if self.num_warps is not None and (self.num_warps < 1 or self.num_warps & (self.num_warps - 1)):
      raise ValueError(f"num_warps={self.num_warps!r} must be a power of two")
    if self.num_stages is not None and self.num_stages < 1:
      raise ValueError(f"num_stages={self.num_stages!r} must be >= 1")

  @classmethod
  def for_mask(cls, mask, *, q_len: int, kv_len: int, backend: str = "triton",
               itemsize: int | None = None, head_dim: int | None = None) -> "BlockSizes":
    """Tiles that follow the mask's structure (``mask.granularity``, as
    ``jaxsys.ops.attn.xla.XlaBlockSizes.for_mask``), within what the backend's lowering accepts.

    ``mask`` is a ``jaxsys.ops.masks.Mask`` (or None); its ``BlockSparse`` nodes (found through
    ``.masks`` / ``.token_mask``) constrain the tiles: every q tile sits inside one layout row,
    every kv tile inside one layout column or over whole columns (the kernel then masks the
    columns inside the tile from per-visit bits). The target tile is ``granularity`` capped at
    128 (the default), clipped to short lengths:

    ==========  =====================================  =======================================
    backend     block_q                                block_k
    ==========  =====================================  =======================================
    triton      power of two, 16..128, divides every   power of two, 16..128, divides every
    (cuda)      layout block_q; ``next_pow2(q_len)``   layout block_k (or, for cells < 16, is
                for short queries                      a multiple of them); short kv likewise
    mosaic      multiple of 8 (sublanes), <= 128,      128: the lane dim of the ``[1, bk]``
    (tpu)       divides every layout block_q; the      kv-segment block and of the ``[bq, bk]``
                smallest such divisor >= q_len for     score tile; the TPU lowering rejects
                short queries                          other sizes. Layout block_k must divide
                                                       128 or be a multiple of it.
    ==========  =====================================  =======================================

    Examples (q_len = kv_len = 4096): dense / Causal -> 128 x 128 on both; BlockSparse of 64-
    token blocks (and Local windows < 1024 keys: granularity 64) -> 64 x 64 on triton (every
    skipped layout block is a skipped tile), 64 x 128 on mosaic (a 128-key tile is visited when
    either of its two layout columns is; the other is masked); BlockSparse 256 -> 128 x 128.
    Mosaic's lowering checks only the ``% 8`` / ``% 128`` rule (``jax.export`` for "tpu"
    accepts ``block_q`` = 8, 16, 40, ...); bf16 packs 16 rows per vreg, so multiples of 16 waste
    less. Raises ``NotImplementedError`` when no tile meets a layout's cells on that backend.

    On Triton, given the inputs' ``itemsize`` and the padded ``head_dim``, the target tile is
    capped by that row of ``flash_tiles.TRITON_TILES`` (the largest tile that compiles for sm_90a
    without spills) and the launch parameters come from it (``flash_tiles.launch``).
    """
    if backend not in BACKENDS:
      raise ValueError(f"backend={backend!r} must be one of {BACKENDS}")
    for name, value in (("q_len", q_len), ("kv_len", kv_len)):
      if not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive int")
    g = None if mask is None else mask.granularity
    target = cls.block_q if g is None else min(cls.block_q, g)
    target_k, launch = target, (None, None)
    tuned = backend == "triton" and itemsize is not None and head_dim is not None
    if tuned:
      row = flash_tiles.triton_tile(itemsize, head_dim)
      target, target_k = min(target, row.block_q), min(target, row.block_k)
    cells_q, cells_k = layout_cells(mask)
    bq = _q_tile(target, cells_q, q_len, backend)
    if backend == "mosaic":
      bk = _MOSAIC_LANES
    else:
      bk = _pow2_floor(target_k)
      if cells_k:  # the largest power of two dividing every layout block_k
        common = math.gcd(*cells_k)
        bk = min(bk, common & -common)
      bk = max(bk, _TRITON_MIN)
      bk = min(bk, max(_TRITON_MIN, next_pow2(kv_len)))
    check_kv_cells(bk, cells_k, backend)
    if tuned:
      launch = flash_tiles.launch(bq, bk, itemsize, head_dim)
    return cls(bq, bk, *launch)


_TRITON_MIN = 16     # smallest Triton dot operand dim
_MOSAIC_SUBLANES = 8
_MOSAIC_LANES = 128


def _pow2_floor(x: int) -> int:
  return 1 << (int(x).bit_length() - 1)


def block_sparse_nodes(mask, out=None) -> list:
  """The ``BlockSparse`` nodes of ``mask``, depth first (through ``.token_mask`` / ``.masks``;
  duck-typed: a node with ``layout``, ``block_q`` and ``block_k``), so that the kernel package
  needs nothing from ``jaxsys.ops.masks``."""
  out = [] if out is None else out
  if mask is None:
    return out
  if hasattr(mask, "layout") and hasattr(mask, "block_q") and hasattr(mask, "block_k"):
    out.append(mask)
    block_sparse_nodes(getattr(mask, "token_mask", None), out)
  for child in getattr(mask, "masks", ()):
    block_sparse_nodes(child, out)
  return out


def layout_cells(mask) -> tuple[tuple[int, ...], tuple[int, ...]]:
  """``(block_q's, block_k's)`` of the BlockSparse layouts inside ``mask``."""
  nodes = block_sparse_nodes(mask)
  return tuple(int(n.block_q) for n in nodes), tuple(int(n.block_k) for n in nodes)


def _q_tile(target: int, cells_q, q_len: int, backend: str) -> int:
  """Largest allowed q tile <= target dividing every layout block_q, shrunk for short queries."""
  if backend == "triton":
    ok = lambda t: t >= _TRITON_MIN and t & (t - 1) == 0
  else:
    ok = lambda t: t % _MOSAIC_SUBLANES == 0
  divides = lambda t: all(c % t == 0 for c in cells_q)
  fits = [t for t in range(target, 0, -1) if ok(t) and divides(t)]
  if not fits:
    rule = ("a power of two >= 16" if backend == "triton" else "a multiple of 8")
    raise NotImplementedError(
        f"BlockSparse block_q {sorted(set(cells_q))} has no common divisor that is {rule} (the "
        f"{backend} tile rule) and <= {target}")
  bq = fits[0]
  if q_len < bq:  # one tile covers the queries: the smallest allowed one that does
    bq = min(t for t in range(q_len, bq + 1) if ok(t) and divides(t))
  return bq


def check_kv_cells(block_k: int, cells_k, backend: str):
  """Each BlockSparse block_k must divide ``block_k`` or be a multiple of it."""
  bad = sorted({c for c in cells_k if c % block_k and block_k % c})
  if bad:
    raise NotImplementedError(
        f"BlockSparse block_k {bad} must divide {block_k=} or be a multiple of it ({backend} "
        f"kv tiles are {'multiples of 128' if backend == 'mosaic' else 'powers of two >= 16'})")


# ----------------------------------------------------------------------------- shared pieces


def _table_reader(tab_ref, visits):
  """``read(kind, j)`` for kind in {"cnt", "idx", "cls", "bits"} of the blocked table row
  ``tab_ref [W]`` = ``[count, ids[V], classes[V], bits[V], 0...]``."""
  base = {"cnt": 0, "idx": 1, "cls": 1 + visits, "bits": 1 + 2 * visits}
  return lambda kind, j=0: tab_ref[base[kind] + j]


# ----------------------------------------------------------------------------- forward kernel


def _fwd_kernel(cfg: KernelConfig, tab_ref, scal_ref, q_ref, k_ref, v_ref, qseg_ref, kseg_ref,
                o_ref, lse_ref):
  head, i = pl.program_id(1), pl.program_id(2)
  bq, bk = cfg.block_q, cfg.block_k
  read = _table_reader(tab_ref, cfg.visits)
  q_off, kv_length = scal_ref[0], scal_ref[1]
  q = q_ref[...]                                             # [bq, d]
  qi = i * bq + lax.broadcasted_iota(jnp.int32, (bq, 1), 0)
  qseg = qseg_ref[...]                                       # [bq, 1]

  def visit(j, carry):
    m, l, acc = carry
    kb = read("idx", j)
    start = pl.multiple_of(kb * bk, bk)
    k = k_ref[pl.ds(start, bk), :]                           # [bk, d]
    v = v_ref[pl.ds(start, bk), :]
    s = dot(q, k, trans_b=True) * cfg.scale                 # [bq, bk] f32
    ki = start + lax.broadcasted_iota(jnp.int32, (1, bk), 1)
    s = mask_scores(cfg, s, read("cls", j), qi, qi + q_off, ki, head, read("bits", j), qseg,
                     kseg_ref[:, pl.ds(start, bk)], kv_length)
    m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)        # all-masked rows stay finite
    p = jnp.exp(s - m_safe)
    corr = jnp.exp(m - m_safe)
    l = l * corr + jnp.sum(p, axis=1, keepdims=True)
    acc = acc * corr + dot(p.astype(v.dtype), v)
    return m_new, l, acc

  init = (jnp.full((bq, 1), -jnp.inf, F32), jnp.zeros((bq, 1), F32),
          jnp.zeros((bq, o_ref.shape[-1]), F32))
  m, l, acc = lax.fori_loop(0, read("cnt"), visit, init)
  l_safe = jnp.where(l > 0, l, 1.0)
  o_ref[...] = (acc / l_safe).astype(o_ref.dtype)
  lse_ref[...] = jnp.where(l > 0, m + jnp.log(l_safe), -jnp.inf)


# ----------------------------------------------------------------------------- backward kernels


def _dq_kernel(cfg: KernelConfig, tab_ref, scal_ref, q_ref, k_ref, v_ref, qseg_ref, kseg_ref,
               do_ref, lse_ref, delta_ref, dq_ref):
  head, i = pl.program_id(1), pl.program_id(2)
  bq, bk = cfg.block_q, cfg.block_k
  read = _table_reader(tab_ref, cfg.visits)
  q_off, kv_length = scal_ref[0], scal_ref[1]
  q, do = q_ref[...], do_ref[...]
  lse = lse_ref[...]
  lse = jnp.where(lse == -jnp.inf, jnp.inf, lse)             # rows that see nothing: p = 0
  delta = delta_ref[...]
  qi = i * bq + lax.broadcasted_iota(jnp.int32, (bq, 1), 0)
  qseg = qseg_ref[...]

  def visit(j, dq):
    kb = read("idx", j)
    start = pl.multiple_of(kb * bk, bk)
    k = k_ref[pl.ds(start, bk), :]
    v = v_ref[pl.ds(start, bk), :]
    s = dot(q, k, trans_b=True) * cfg.scale
    ki = start + lax.broadcasted_iota(jnp.int32, (1, bk), 1)
    s = mask_scores(cfg, s, read("cls", j), qi, qi + q_off, ki, head, read("bits", j), qseg,
                     kseg_ref[:, pl.ds(start, bk)], kv_length)
    p = jnp.exp(s - lse)
    ds = p * (dot(do, v, trans_b=True) - delta)
    return dq + dot(ds.astype(k.dtype), k)

  dq = lax.fori_loop(0, read("cnt"), visit, jnp.zeros(dq_ref.shape, F32))
  dq_ref[...] = (dq * cfg.scale).astype(dq_ref.dtype)


def _dkdv_kernel(cfg: KernelConfig, tab_ref, scal_ref, q_ref, k_ref, v_ref, qseg_ref, kseg_ref,
                 do_ref, lse_ref, delta_ref, dk_ref, dv_ref):
  head, jb = pl.program_id(1), pl.program_id(2)
  bq, bk = cfg.block_q, cfg.block_k
  read = _table_reader(tab_ref, cfg.visits_t)
  q_off, kv_length = scal_ref[0], scal_ref[1]
  k, v = k_ref[...], v_ref[...]                              # [bk, d]
  ki = jb * bk + lax.broadcasted_iota(jnp.int32, (1, bk), 1)
  kseg = kseg_ref[...]                                       # [1, bk]

  def visit(t, carry):
    dk, dv = carry
    ib = read("idx", t)
    start = pl.multiple_of(ib * bq, bq)
    q = q_ref[pl.ds(start, bq), :]
    do = do_ref[pl.ds(start, bq), :]
    lse = lse_ref[pl.ds(start, bq), :]
    lse = jnp.where(lse == -jnp.inf, jnp.inf, lse)
    delta = delta_ref[pl.ds(start, bq), :]
    qi = start + lax.broadcasted_iota(jnp.int32, (bq, 1), 0)
    s = dot(q, k, trans_b=True) * cfg.scale
    s = mask_scores(cfg, s, read("cls", t), qi, qi + q_off, ki, head, read("bits", t),
                     qseg_ref[pl.ds(start, bq), :], kseg, kv_length)
    p = jnp.exp(s - lse)                                     # [bq, bk]
    dv = dv + dot_ta(p.astype(do.dtype), do)
    ds = p * (dot(do, v, trans_b=True) - delta)
    dk = dk + dot_ta(ds.astype(q.dtype), q)
    return dk, dv

  init = (jnp.zeros(dk_ref.shape, F32), jnp.zeros(dv_ref.shape, F32))
  dk, dv = lax.fori_loop(0, read("cnt"), visit, init)
  dk_ref[...] = (dk * cfg.scale).astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)


# ----------------------------------------------------------------------------- pallas_call plumbing


def pack_tables(idx, cls, cnt, bits, *, backend: str):
  """Visit tables ``idx, cls, bits [Ht, n, V]``, ``cnt [Ht, n]`` -> ``(int32 [Ht, n, W], V)`` in
  the backend's format: Triton rows ``[cnt, idx[V], cls[V], bits[V], 0...]`` padded to a power
  of two (one blocked load per program); Mosaic rows as :func:`flash_tpu.pack_tables`."""
  idx = np.asarray(idx)
  ht, n, v = idx.shape
  if backend == "mosaic":
    return flash_tpu.pack_tables(idx, cls, cnt, bits), max(v, 1)
  w = next_pow2(1 + 3 * v)
  tab = np.zeros((ht, n, w), np.int32)
  tab[..., 0] = cnt
  tab[..., 1:1 + v] = idx
  tab[..., 1 + v:1 + 2 * v] = cls
  tab[..., 1 + 2 * v:1 + 3 * v] = bits
  return tab, v


def _call(cfg: KernelConfig, kernel, name, grid, tab, scal, in_specs, arrays, out_specs, out_shape):
  """One pallas_call; each program gets its table row and its batch row's scalars as blocked
  inputs."""
  ht = cfg.table_heads
  tab_spec = pl.BlockSpec((None, None, tab.shape[-1]),
                          lambda b, h, r: (h if ht > 1 else 0, r, 0))
  scal_spec = pl.BlockSpec((None, scal.shape[-1]), lambda b, h, r: (b, 0))
  params = None
  if not cfg.interpret:
    params = triton_params(cfg.num_warps, cfg.num_stages)
  return pl.pallas_call(functools.partial(kernel, cfg), out_shape=out_shape, grid=grid,
                        in_specs=[tab_spec, scal_spec, *in_specs], out_specs=out_specs,
                        compiler_params=params, interpret=cfg.interpret, name=name)(
                            tab, scal, *arrays)


def _specs(cfg: KernelConfig, tq: int, tk: int, d: int, dv: int):
  g, bq, bk = cfg.group, cfg.block_q, cfg.block_k
  return {
      "q_blk": pl.BlockSpec((None, None, bq, d), lambda b, h, i: (b, h, i, 0)),
      "o_blk": pl.BlockSpec((None, None, bq, dv), lambda b, h, i: (b, h, i, 0)),
      "col_blk": pl.BlockSpec((None, None, bq, 1), lambda b, h, i: (b, h, i, 0)),
      "k_all": pl.BlockSpec((None, None, tk, d), lambda b, h, i: (b, lax.div(h, g), 0, 0)),
      "v_all": pl.BlockSpec((None, None, tk, dv), lambda b, h, i: (b, lax.div(h, g), 0, 0)),
      "qseg_blk": pl.BlockSpec((None, bq, 1), lambda b, h, i: (b, i, 0)),
      "kseg_all": pl.BlockSpec((None, 1, tk), lambda b, h, i: (b, 0, 0)),
      # dk/dv kernel: grid over kv blocks, full rows of q-side arrays
      "q_all": pl.BlockSpec((None, None, tq, d), lambda b, h, j: (b, h, 0, 0)),
      "do_all": pl.BlockSpec((None, None, tq, dv), lambda b, h, j: (b, h, 0, 0)),
      "col_all": pl.BlockSpec((None, None, tq, 1), lambda b, h, j: (b, h, 0, 0)),
      "k_blk": pl.BlockSpec((None, None, bk, d), lambda b, h, j: (b, lax.div(h, g), j, 0)),
      "v_blk": pl.BlockSpec((None, None, bk, dv), lambda b, h, j: (b, lax.div(h, g), j, 0)),
      "dk_blk": pl.BlockSpec((None, None, bk, d), lambda b, h, j: (b, h, j, 0)),
      "dv_blk": pl.BlockSpec((None, None, bk, dv), lambda b, h, j: (b, h, j, 0)),
      "qseg_all": pl.BlockSpec((None, tq, 1), lambda b, h, j: (b, 0, 0)),
      "kseg_blk": pl.BlockSpec((None, 1, bk), lambda b, h, j: (b, 0, j)),
  }


def _forward(cfg, tab, scal, q, k, v, qseg, kseg):
  b, h, tq, d = q.shape
  tk, dv = k.shape[2], v.shape[-1]
  sp = _specs(cfg, tq, tk, d, dv)
  out_shape = [jax.ShapeDtypeStruct((b, h, tq, dv), q.dtype),
               jax.ShapeDtypeStruct((b, h, tq, 1), F32)]
  return _call(cfg, _fwd_kernel, "flash_attention_fwd", (b, h, tq // cfg.block_q), tab, scal,
               [sp["q_blk"], sp["k_all"], sp["v_all"], sp["qseg_blk"], sp["kseg_all"]],
               [q, k, v, qseg, kseg], [sp["o_blk"], sp["col_blk"]], out_shape)


def _backward(cfg, tab, tab_t, scal, q, k, v, qseg, kseg, out, lse, do, dlse):
  b, h, tq, d = q.shape
  tk, dv = k.shape[2], v.shape[-1]
  sp = _specs(cfg, tq, tk, d, dv)
  delta = lse_delta(do, out, dlse)
  dq = _call(cfg, _dq_kernel, "flash_attention_bwd_dq", (b, h, tq // cfg.block_q), tab, scal,
             [sp["q_blk"], sp["k_all"], sp["v_all"], sp["qseg_blk"], sp["kseg_all"],
              sp["o_blk"], sp["col_blk"], sp["col_blk"]],
             [q, k, v, qseg, kseg, do, lse, delta], [sp["q_blk"]],
             [jax.ShapeDtypeStruct(q.shape, q.dtype)])[0]
  # dk/dv per query head (f32), summed over each kv head's query group afterwards.
  dk, dvv = _call(cfg, _dkdv_kernel, "flash_attention_bwd_dkdv", (b, h, tk // cfg.block_k),
                  tab_t, scal,
                  [sp["q_all"], sp["k_blk"], sp["v_blk"], sp["qseg_all"], sp["kseg_blk"],
                   sp["do_all"], sp["col_all"], sp["col_all"]],
                  [q, k, v, qseg, kseg, do, lse, delta], [sp["dk_blk"], sp["dv_blk"]],
                  [jax.ShapeDtypeStruct((b, h, tk, d), F32),
                   jax.ShapeDtypeStruct((b, h, tk, dv), F32)])
  return (dq, *sum_query_groups(cfg, dk, dvv, k.dtype, v.dtype))


def flash_attention(cfg: KernelConfig, tab, tab_t, scal, q, k, v, qseg, kseg):
  """``(out [b, h, Tq, dv], lse [b, h, Tq, 1] f32)``; differentiable in q, k, v (and via lse).

  Args:
    tab, tab_t: int32 visit tables ``[Ht, nq, W]`` / transposed ``[Ht, nk, W_t]``, packed by
      :func:`pack_tables` for ``cfg.backend``.
    scal: int32 ``[b, 2]`` = (q_offset, kv_length) per batch row.
    q ``[b, h, Tq, d]``, k ``[b, hk, Tk, d]``, v ``[b, hk, Tk, dv]`` padded to block multiples.
    qseg ``[b, Tq, 1]``, kseg ``[b, 1, Tk]`` int32 segment ids (equal ids attend).
  """

  forward, backward = ((flash_tpu.forward, flash_tpu.backward) if cfg.backend == "mosaic"
                       else (_forward, _backward))

  @jax.custom_vjp
  def attn(q, k, v):
    return forward(cfg, tab, scal, q, k, v, qseg, kseg)

  def fwd(q, k, v):
    out, lse = forward(cfg, tab, scal, q, k, v, qseg, kseg)
    return (out, lse), (q, k, v, out, lse)

  def bwd(res, cts):
    q, k, v, out, lse = res
    do, dlse = cts
    return backward(cfg, tab, tab_t, scal, q, k, v, qseg, kseg, out, lse, do, dlse)

  attn.defvjp(fwd, bwd)
  return attn(q, k, v)
