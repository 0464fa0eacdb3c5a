"""Pallas flash-decode over selected KV pages, read through the page table.

XLA twin: ``jaxsys.ops.paged_attention.paged_decode_xla`` (same arguments, same results once
``jaxsys.ops.paged_attention.paged_decode_pallas`` has merged this kernel's partials).

Grid ``(batch, kv_heads, num_splits)``: program (b, h, s) walks its share of the ``K`` selected
slots, loads page ``page_indices[b, h, i]`` of kv head h straight from the pool
``[num_pages, kv_heads, page, dim]`` (no gathered copy), masks slots by token position
(``page_numbers``, length, optional sink/window) and keeps an online softmax over the query
heads of the group. Each split writes an unnormalised partial ``(o, m, l)``; the partials are
merged with the log-sum-exp rule outside the kernel (split-K flash-decode). The group is padded
to 16 rows so the two products are ``tl.dot``-sized on Triton.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class PagedDecodeBlocks:
  """``num_splits``: split-K programs per (request, kv head); ``num_warps``/``num_stages``: Triton."""
  num_splits: int = 1
  num_warps: int = 4
  num_stages: int = 2

  def __post_init__(self):
    if self.num_splits < 1:
      raise ConfigError(f"num_splits={self.num_splits} must be >= 1")
    if self.num_warps < 1 or self.num_warps & (self.num_warps - 1):
      raise ConfigError(f"num_warps={self.num_warps} must be a power of two")
    if self.num_stages < 1:
      raise ConfigError(f"num_stages={self.num_stages} must be >= 1")


def _kernel(q_ref, idx_ref, num_ref, len_ref, k_ref, v_ref, o_ref, m_ref, l_ref, *,
            scale, per_split, sink, window):
  b, h, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  q = q_ref[...].astype(jnp.float32)  # [group, dim]
  page = k_ref.shape[2]
  length = len_ref[b]
  base = s * per_split

  def body(i, carry):
    o, m, l = carry
    pid = idx_ref[b, h, base + i]
    num = num_ref[b, h, base + i]
    k = k_ref[pid, h].astype(jnp.float32)  # [page, dim]
    v = v_ref[pid, h].astype(jnp.float32)
    sc = jnp.dot(q, k.T) * scale  # [group, page]
    pos = num * page + jax.lax.broadcasted_iota(jnp.int32, sc.shape, 1)
    vis = (num >= 0) & (pos < length)
    if window is not None:
      vis = vis & ((pos < sink) | (pos >= length - window))
    sc = jnp.where(vis, sc, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(sc, axis=1))
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    alpha = jnp.where(m == -jnp.inf, 0.0, jnp.exp(m - m_safe))
    p = jnp.where(vis, jnp.exp(sc - m_safe[:, None]), 0.0)
    return alpha[:, None] * o + jnp.dot(p, v), m_new, alpha * l + jnp.sum(p, axis=1)

  g, d = q.shape
  init = (jnp.zeros((g, d), jnp.float32), jnp.full((g,), -jnp.inf, jnp.float32),
          jnp.zeros((g,), jnp.float32))
  o, m, l = jax.lax.fori_loop(0, per_split, body, init)
  o_ref[...] = o
  m_ref[...] = m
  l_ref[...] = l


def paged_decode_partials(q, k_pages, v_pages, page_indices, page_numbers, lengths, *, sink=None,
                          window=None, scale, blocks: PagedDecodeBlocks = PagedDecodeBlocks(),
                          interpret: bool = False):
  """Unnormalised partials ``(o [b, hk, S, G, d], m, l [b, hk, S, G])``; G = padded group."""
  b, h, d = q.shape
  n, hk, p, _ = k_pages.shape
  g = h // hk
  gp = max(16, pl.next_power_of_2(g))
  splits = blocks.num_splits
  kk = page_indices.shape[-1]
  pad = -kk % splits
  if pad:
    page_indices = jnp.pad(page_indices, ((0, 0), (0, 0), (0, pad)))
    page_numbers = jnp.pad(page_numbers, ((0, 0), (0, 0), (0, pad)), constant_values=-1)
  per_split = (kk + pad) // splits
  qg = jnp.pad(q.reshape(b, hk, g, d), ((0, 0), (0, 0), (0, gp - g), (0, 0)))  # [b, hk, G, d]
  kernel = functools.partial(_kernel, scale=scale, per_split=per_split, sink=sink, window=window)
  # Page tables, lengths and pools are whole arrays indexed inside the kernel.
  full = lambda shape: pl.BlockSpec(shape, lambda i, j, s, _n=len(shape): (0,) * _n)
  compiler_params = None if interpret else _triton_params(blocks)
  return pl.pallas_call(
      kernel,
      grid=(b, hk, splits),
      in_specs=[
          pl.BlockSpec((None, None, gp, d), lambda i, j, s: (i, j, 0, 0)),
          full(page_indices.shape), full(page_numbers.shape), full(lengths.shape),
          full(k_pages.shape), full(v_pages.shape),
      ],
      out_specs=[
          pl.BlockSpec((None, None, None, gp, d), lambda i, j, s: (i, j, s, 0, 0)),
          pl.BlockSpec((None, None, None, gp), lambda i, j, s: (i, j, s, 0)),
          pl.BlockSpec((None, None, None, gp), lambda i, j, s: (i, j, s, 0)),
      ],
      out_shape=[
          jax.ShapeDtypeStruct((b, hk, splits, gp, d), jnp.float32),
          jax.ShapeDtypeStruct((b, hk, splits, gp), jnp.float32),
          jax.ShapeDtypeStruct((b, hk, splits, gp), jnp.float32),
      ],
      compiler_params=compiler_params,
      interpret=interpret,
      name="lserve_paged_decode",
  )(qg, page_indices.astype(jnp.int32), page_numbers.astype(jnp.int32), lengths.astype(jnp.int32),
    k_pages, v_pages)


def _triton_params(blocks):
  from jax.experimental.pallas import triton as plgpu
  return plgpu.CompilerParams(num_warps=blocks.num_warps, num_stages=blocks.num_stages)

