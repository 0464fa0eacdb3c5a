"""Pallas page scorer for hierarchical page selection (LServe / Quest bound).

XLA twin: ``jaxsys.serving.page_select.page_scores_xla``.

Grid ``(batch, kv_heads, max_pages)``: program (b, h, j) reads the statistics of physical page
``block_table[b, j]`` for kv head h, ``kmin, kmax [logical_pages, dim]``, and writes

  score = max_{query head g of h} max_{logical page l starting before length}
          sum_i max(q_gi kmax_li, q_gi kmin_li)

(-inf when no logical page of it starts before the length). Top-k stays in XLA.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.errors import ConfigError


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


def page_scores_pallas(q, kmin, kmax, block_table, lengths, *, page_size, logical_page_size,
                       blocks: PageSelectBlocks = PageSelectBlocks(), interpret: bool = False):
  """``float32[b, kv_heads, max_pages]`` page scores (same contract as the XLA twin)."""
  b, h, d = q.shape
  n, hk, nl, _ = kmin.shape
  g = h // hk
  m = block_table.shape[1]
  full = lambda shape: pl.BlockSpec(shape, lambda i, k, j, _n=len(shape): (0,) * _n)
  params = None
  if not interpret:
    from jax.experimental.pallas import triton as plgpu
    params = plgpu.CompilerParams(num_warps=blocks.num_warps, num_stages=blocks.num_stages)
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
  )(q.reshape(b, hk, g, d), block_table.astype(jnp.int32), lengths.astype(jnp.int32), kmin, kmax)
