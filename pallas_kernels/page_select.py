"""Pallas page scorer for hierarchical page selection (LServe / Quest bound), Triton and Mosaic.

XLA twin: ``jaxsys.serving.page_select.page_scores_xla``.

Grid ``(batch, kv_heads, max_pages)``: program (b, h, j) reads the statistics of physical page
``block_table[b, j]`` for kv head h, ``kmin, kmax [logical_pages, dim]``, and writes

  score = max_{query head g of h} max_{logical page l starting before length}
          sum_i max(q_gi kmax_li, q_gi kmin_li)

(-inf when no logical page of it starts before the length). Top-k stays in XLA.

Triton ("triton"): the block table and lengths are whole blocked inputs read per program; the
score is an elementwise max-sum over ``[group, logical, dim]``.
Mosaic ("mosaic", TPU): the block table and lengths are scalar-prefetched into SMEM and the
statistics block of page ``block_table[b, j]`` is chosen by the index map, so only that page is
copied into VMEM. Since ``kmax >= kmin``, ``sum_i max(q_i hi_i, q_i lo_i) = max(q, 0) . hi +
min(q, 0) . lo``: two small matmuls on 2-D tiles (Mosaic has no 3-D broadcast reductions to
spare). One score per program is written as a lane-broadcast ``[1, 128]`` row (a block's last
two dims must be (8, 128)-multiples or the full dims), sliced back to ``[b, hk, m]`` outside.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.errors import ConfigError

from pallas_kernels.backend import BACKENDS, next_pow2, require_triton_pow2, resolve_backend, triton_params  # noqa: F401  (re-exported)

__all__ = ["BACKENDS", "resolve_backend", "page_scores_pallas", "PageSelectBlocks", "TPU_SMEM_BUDGET_BYTES"]

# SMEM holds the scalar-prefetched block table and lengths (1 MiB per core from TPU v4 on;
# half is left to the compiler).
TPU_SMEM_BUDGET_BYTES = 512 * 1024
_LANES = 128


@dataclasses.dataclass(frozen=True)
class PageSelectBlocks:
  """Triton launch parameters (one program per page; the block is the page's statistics)."""
  num_warps: int = 1
  num_stages: int = 1

  def __post_init__(self):
    if self.num_warps < 1 or self.num_warps & (self.num_warps - 1):
      raise ConfigError(f"num_warps={self.num_warps} must be a power of two")
    if self.num_stages < 1:
      raise ConfigError(f"num_stages={self.num_stages} must be >= 1")


def _kernel(q_ref, bt_ref, len_ref, lo_ref, hi_ref, o_ref, *, logical_page_size):
  b, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  pid = bt_ref[b, j]
  q = q_ref[...].astype(jnp.float32)  # [group, dim]
  lo = lo_ref[pid, h].astype(jnp.float32)  # [logical, dim]
  hi = hi_ref[pid, h].astype(jnp.float32)
  s = jnp.sum(jnp.maximum(q[:, None, :] * hi[None], q[:, None, :] * lo[None]), axis=-1)  # [g, l]
  nl = lo.shape[0]
  start = (j * nl + jax.lax.broadcasted_iota(jnp.int32, s.shape, 1)) * logical_page_size
  s = jnp.where(start < len_ref[b], s, -jnp.inf)
  o_ref[...] = jnp.full((1,), jnp.max(s), jnp.float32)


def _dot_t(a, b):  # a [m, d] . b [n, d]^T -> [m, n] f32
  return lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def _mosaic_kernel(bt_ref, len_ref, q_ref, lo_ref, hi_ref, o_ref, *, logical_page_size):
  b, j = pl.program_id(0), pl.program_id(2)
  q = q_ref[...].astype(jnp.float32)      # [group, dim]
  lo = lo_ref[...].astype(jnp.float32)    # [logical, dim] of page block_table[b, j]
  hi = hi_ref[...].astype(jnp.float32)
  s = _dot_t(jnp.maximum(q, 0.0), hi) + _dot_t(jnp.minimum(q, 0.0), lo)  # [group, logical]
  nl = lo.shape[0]
  start = (j * nl + lax.broadcasted_iota(jnp.int32, s.shape, 1)) * logical_page_size
  s = jnp.where(start < len_ref[b], s, -jnp.inf)
  best = jnp.max(jnp.max(s, axis=1, keepdims=True), axis=0, keepdims=True)  # [1, 1]
  o_ref[...] = jnp.broadcast_to(best, o_ref.shape)


def _mosaic_call(qg, block_table, lengths, kmin, kmax, *, logical_page_size, interpret):
  from jax.experimental.pallas import tpu as pltpu
  b, hk, g, d = qg.shape
  _, _, nl, _ = kmin.shape
  m = block_table.shape[1]
  smem = 4 * (block_table.size + lengths.size)
  if smem > TPU_SMEM_BUDGET_BYTES:
    raise NotImplementedError(
        f"the Mosaic page scorer prefetches the block table into SMEM: {smem} bytes exceed "
        f"{TPU_SMEM_BUDGET_BYTES}; use the XLA twin")
  stats = pl.BlockSpec((None, None, nl, d), lambda i, k, j, bt, ln: (bt[i, j], k, 0, 0))
  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=2, grid=(b, hk, m),
      in_specs=[pl.BlockSpec((None, None, g, d), lambda i, k, j, bt, ln: (i, k, 0, 0)),
                stats, stats],
      out_specs=pl.BlockSpec((None, None, None, 1, _LANES),
                             lambda i, k, j, bt, ln: (i, k, j, 0, 0)))
  out = pl.pallas_call(
      functools.partial(_mosaic_kernel, logical_page_size=logical_page_size),
      grid_spec=grid_spec,
      out_shape=jax.ShapeDtypeStruct((b, hk, m, 1, _LANES), jnp.float32),
      compiler_params=None if interpret else pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel", "parallel")),
      interpret=interpret,
      name="lserve_page_scores",
  )(block_table, lengths, qg, kmin, kmax)
  return out[..., 0, 0]  # [b, hk, m]


def page_scores_pallas(q, kmin, kmax, block_table, lengths, *, page_size, logical_page_size,
                       blocks: PageSelectBlocks = PageSelectBlocks(), interpret: bool = False,
                       backend: str | None = None):
  """``float32[b, kv_heads, max_pages]`` page scores (same contract as the XLA twin).

  ``backend``: "triton", "mosaic" or None (Mosaic on a TPU default backend, else Triton);
  ``blocks`` only tunes the Triton launch. The Mosaic path raises ``NotImplementedError`` when
  the block table does not fit ``TPU_SMEM_BUDGET_BYTES`` (callers fall back to the XLA twin).
  On Triton the GQA group is padded to a power of two with copies of the group's first query
  head (the score is a max over the group, so copies leave it unchanged: SmolLM2's group of 3
  runs as 4); a head_dim or logical-page count that is not a power of two raises
  ``NotImplementedError`` before tracing (``impl="auto"`` then runs the XLA twin).
  """
  backend = resolve_backend(backend)
  b, h, d = q.shape
  n, hk, nl, _ = kmin.shape
  require_triton_pow2("page scores", backend, interpret, head_dim=d, logical_pages=nl)
  g = h // hk
  m = block_table.shape[1]
  qg = q.reshape(b, hk, g, d)
  if backend == "triton" and g & (g - 1):  # [b, hk, G, d], G the next power of two
    gp = next_pow2(g)
    qg = jnp.concatenate([qg, jnp.broadcast_to(qg[:, :, :1], (b, hk, gp - g, d))], axis=2)
    g = gp
  bt, lens = block_table.astype(jnp.int32), lengths.astype(jnp.int32)
  if backend == "mosaic":
    return _mosaic_call(qg, bt, lens, kmin, kmax, logical_page_size=logical_page_size,
                        interpret=interpret)
  full = lambda shape: pl.BlockSpec(shape, lambda i, k, j, _n=len(shape): (0,) * _n)
  params = None
  if not interpret:
    params = triton_params(blocks.num_warps, blocks.num_stages)
  return pl.pallas_call(
      functools.partial(_kernel, logical_page_size=logical_page_size),
      grid=(b, hk, m),
      in_specs=[pl.BlockSpec((None, None, g, d), lambda i, k, j: (i, k, 0, 0)),
                full(block_table.shape), full(lengths.shape), full(kmin.shape), full(kmax.shape)],
      out_specs=pl.BlockSpec((None, None, 1), lambda i, k, j: (i, k, j)),
      out_shape=jax.ShapeDtypeStruct((b, hk, m), jnp.float32),
      compiler_params=params,
      interpret=interpret,
      name="lserve_page_scores",
  )(qg, bt, lens, kmin, kmax)
