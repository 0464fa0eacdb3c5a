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

Mosaic (TPU) path: the page table, page numbers and lengths are scalar-prefetched into SMEM and
the grid gains a fourth, sequential axis over a split's slots, ``(batch, kv_heads, num_splits,
per_split)``: the index map of K/V picks page ``page_indices[b, h, s * per_split + t]``, so the
pipeline DMAs exactly the selected ``[page, dim]`` tiles from HBM (no whole-pool copy into VMEM).
The partials live in the output blocks, resident across the slot axis, and are updated by the
same online softmax; ``m``/``l`` are ``[G, 1]`` columns (a block's last two dims must be
(8, 128)-multiples or the full dims) and the group is padded to a multiple of 8 sublanes. The
page tables must fit ``TPU_SMEM_BUDGET_BYTES``; beyond that the wrapper raises
``NotImplementedError`` and the op falls back to its XLA twin.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.errors import ConfigError

from pallas_kernels.backend import BACKENDS, require_triton_pow2, resolve_backend, triton_params  # noqa: F401  (re-exported)

__all__ = ["BACKENDS", "resolve_backend", "paged_decode_partials", "PagedDecodeBlocks", "TPU_SMEM_BUDGET_BYTES"]

# SMEM holds the scalar-prefetched page tables (1 MiB on current TPU cores; half is left spare).
TPU_SMEM_BUDGET_BYTES = 512 * 1024


@dataclasses.dataclass(frozen=True)
class PagedDecodeBlocks:
  """``num_splits``: split-K programs per (request, kv head) on both backends;
  ``num_warps``/``num_stages``: Triton only (on Mosaic the block is one ``[page, dim]`` page)."""
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


def _mosaic_kernel(idx_ref, num_ref, len_ref, q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, *,
                   scale, per_split, sink, window):
  b, h, s, t = (pl.program_id(a) for a in range(4))
  page = k_ref.shape[0]
  length = len_ref[b]
  num = num_ref[b, h, s * per_split + t]

  @pl.when(t == 0)
  def _init():
    o_ref[...] = jnp.zeros(o_ref.shape, jnp.float32)
    m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)

  # Empty slots and pages past the length change nothing: skip their arithmetic.
  @pl.when((num >= 0) & (num * page < length))
  def _visit():
    q = q_ref[...].astype(jnp.float32)  # [G, dim]
    k = k_ref[...].astype(jnp.float32)  # [page, dim] of page idx[b, h, slot]
    v = v_ref[...].astype(jnp.float32)
    sc = lax.dot_general(q, k, (((1,), (1,)), ((), ())),
                         preferred_element_type=jnp.float32) * scale  # [G, page]
    pos = num * page + lax.broadcasted_iota(jnp.int32, sc.shape, 1)
    vis = pos < length
    if window is not None:
      vis = vis & ((pos < sink) | (pos >= length - window))
    sc = jnp.where(vis, sc, -jnp.inf)
    m = m_ref[...]                                             # [G, 1]
    m_new = jnp.maximum(m, jnp.max(sc, axis=1, keepdims=True))
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    alpha = jnp.where(m == -jnp.inf, 0.0, jnp.exp(m - m_safe))
    p = jnp.where(vis, jnp.exp(sc - m_safe), 0.0)
    o_ref[...] = alpha * o_ref[...] + jnp.dot(p, v, preferred_element_type=jnp.float32)
    m_ref[...] = m_new
    l_ref[...] = alpha * l_ref[...] + jnp.sum(p, axis=1, keepdims=True)


def _mosaic_partials(qg, k_pages, v_pages, page_indices, page_numbers, lengths, *, scale,
                     per_split, splits, sink, window, interpret):
  from jax.experimental.pallas import tpu as pltpu
  b, hk, gp, d = qg.shape
  page = k_pages.shape[2]
  smem = 4 * (page_indices.size + page_numbers.size + lengths.size)
  if smem > TPU_SMEM_BUDGET_BYTES:
    raise NotImplementedError(
        f"the Mosaic paged decode kernel prefetches the page tables into SMEM: {smem} bytes "
        f"exceed {TPU_SMEM_BUDGET_BYTES}; use the XLA twin")
  n = k_pages.shape[0]
  # Clamped so that a stray index in an empty slot never makes the DMA read outside the pool.
  kv = pl.BlockSpec((None, None, page, d), lambda i, j, s, t, idx, num, ln: (
      jnp.clip(idx[i, j, s * per_split + t], 0, n - 1), j, 0, 0))
  part = lambda *tail: pl.BlockSpec((None, None, None, *tail),
                                    lambda i, j, s, t, idx, num, ln: (i, j, s, 0, 0))
  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=3, grid=(b, hk, splits, per_split),
      in_specs=[pl.BlockSpec((None, None, gp, d), lambda i, j, s, t, idx, num, ln: (i, j, 0, 0)),
                kv, kv],
      out_specs=[part(gp, d), part(gp, 1), part(gp, 1)])
  kernel = functools.partial(_mosaic_kernel, scale=scale, per_split=per_split, sink=sink,
                             window=window)
  o, m, l = pl.pallas_call(
      kernel, grid_spec=grid_spec,
      out_shape=[jax.ShapeDtypeStruct((b, hk, splits, gp, d), jnp.float32),
                 jax.ShapeDtypeStruct((b, hk, splits, gp, 1), jnp.float32),
                 jax.ShapeDtypeStruct((b, hk, splits, gp, 1), jnp.float32)],
      compiler_params=None if interpret else pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
      interpret=interpret,
      name="lserve_paged_decode",
  )(page_indices, page_numbers, lengths, qg, k_pages, v_pages)
  return o, m[..., 0], l[..., 0]


def paged_decode_partials(q, k_pages, v_pages, page_indices, page_numbers, lengths, *, sink=None,
                          window=None, scale, blocks: PagedDecodeBlocks = PagedDecodeBlocks(),
                          interpret: bool = False, backend: str | None = None):
  """Unnormalised partials ``(o [b, hk, S, G, d], m, l [b, hk, S, G])``; G = padded group.

  ``backend``: "triton", "mosaic" or None (Mosaic on a TPU default backend, else Triton). Triton
  needs a power-of-two ``head_dim`` and page size (SmolLM2's 64 and Llama's 128 are); other sizes
  raise ``NotImplementedError`` before tracing, and ``impl="auto"`` runs the XLA twin (padding
  the head dim would copy the whole KV pool every step). Any GQA group runs: it is padded.
  """
  backend = resolve_backend(backend)
  b, h, d = q.shape
  n, hk, p, _ = k_pages.shape
  require_triton_pow2("paged decode", backend, interpret, head_dim=d, page_size=p)
  g = h // hk
  # Triton: a power of two >= 16 rows for tl.dot; Mosaic: whole 8-row sublane tiles.
  gp = max(16, pl.next_power_of_2(g)) if backend == "triton" else -(-g // 8) * 8
  splits = blocks.num_splits
  kk = page_indices.shape[-1]
  pad = -kk % splits
  if pad:
    page_indices = jnp.pad(page_indices, ((0, 0), (0, 0), (0, pad)))
    page_numbers = jnp.pad(page_numbers, ((0, 0), (0, 0), (0, pad)), constant_values=-1)
  per_split = (kk + pad) // splits
  qg = jnp.pad(q.reshape(b, hk, g, d), ((0, 0), (0, 0), (0, gp - g), (0, 0)))  # [b, hk, G, d]
  page_indices, page_numbers = page_indices.astype(jnp.int32), page_numbers.astype(jnp.int32)
  lengths = lengths.astype(jnp.int32)
  if backend == "mosaic":
    return _mosaic_partials(qg, k_pages, v_pages, page_indices, page_numbers, lengths,
                            scale=scale, per_split=per_split, splits=splits, sink=sink,
                            window=window, interpret=interpret)
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
  )(qg, page_indices, page_numbers, lengths, k_pages, v_pages)


def _triton_params(blocks):
  return triton_params(blocks.num_warps, blocks.num_stages)

