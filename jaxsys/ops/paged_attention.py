"""Decode attention over a paged KV cache: read only the pages a request selected.

One query token per request attends to the tokens of ``K`` pages per kv head, chosen by the
caller (every page for dense decode, the top-k pages of the hierarchical selector for LServe
retrieval heads, sink + local ring pages for streaming heads). The XLA path gathers the chosen
pages with one ``jnp.take`` on the flattened ``[pages * kv_heads, page, dim]`` pool (each row is a
contiguous ``page * dim`` block), then runs flash-decode: the ``K`` pages are cut into
``num_splits`` chunks, each chunk computes its softmax statistics, and the partial results are
merged with the log-sum-exp rule (FlashDecoding, Dao et al. 2023):

  m = max_s m_s,  l = sum_s exp(m_s - m) l_s,  o = sum_s exp(m_s - m) o_s / l,  lse = m + log l

Token visibility inside the chosen pages is computed from positions: slot ``j`` of a page with
logical page number ``n`` holds the token at position ``n * page_size + j``; it is visible iff
``n >= 0`` and position < ``lengths[b]`` and, for streaming heads, ``position < sink`` or
``position >= lengths[b] - window`` (the ``Sink(sink) | Local(window)`` mask of the query at
position ``lengths[b] - 1``).

Usage::

  out = paged_decode_attention(q, k_pages, v_pages, page_indices, page_numbers, lengths)

The Pallas twin is the kernel of ``pallas_kernels/paged_attention.py`` (partials) plus the
same merge (``paged_decode_pallas``).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from jaxsys.core.dispatch import Dispatcher, require_backend
from jaxsys.core.errors import ConfigError, ShapeError
from jaxsys.ops.merge import merge_lse, normalize_partial

__all__ = [
    "default_num_splits", "PAGED_DECODE", "paged_decode_attention", "paged_decode_pallas",
    "paged_decode_xla", "PAGES_PER_SPLIT", "visible_tokens",
]

PAGES_PER_SPLIT = 8  # 8 x 64-token pages x 128 dims x 4 B = 256 KiB of K per head: cache-sized


def paged_decode_attention(q, k_pages, v_pages, page_indices, page_numbers, lengths, *,
                           sink: int | None = None, window: int | None = None,
                           scale: float | None = None, k_scales=None, v_scales=None,
                           num_splits: int | None = None, return_lse: bool = False,
                           impl: str = "auto"):
  """Attention of one query token per request over selected KV pages.

  Args:
    q: ``[batch, heads, head_dim]``; query head h reads kv head ``h // (heads // kv_heads)``.
    k_pages, v_pages: ``[num_pages, kv_heads, page_size, head_dim]`` float, or int8 with
      ``k_scales``/``v_scales`` ``[num_pages, kv_heads, page_size]`` (per-token scales).
    page_indices: ``int32[batch, kv_heads, K]`` physical page read by kv head h in slot i.
    page_numbers: ``int32[batch, kv_heads, K]`` logical page number of that slot (its tokens sit
      at ``number * page_size + j``); a negative number marks an empty slot.
    lengths: ``int32[batch]`` tokens in each sequence (the query sits at ``length - 1``).
    sink, window: streaming-head mask ``Sink(sink) | Local(window)``; both None = causal.
    num_splits: split-K chunks merged by log-sum-exp (flash-decode); default
      ``default_num_splits(K)``: about ``PAGES_PER_SPLIT`` pages a split, least padding.
    return_lse: also return float32 ``lse [batch, heads]`` (-inf when nothing is visible).
    impl: "auto" | "xla" | "pallas" | "pallas_interpret" (``jaxsys.core.dispatch``; "pallas"
      compiles for GPU and reads float pages only, auto falls back to "xla" otherwise).

  Returns:
    ``out [batch, heads, head_dim]`` in q's dtype (zeros where nothing is visible), and lse.
  """
  PAGED_DECODE.check(impl)
  _validate(q, k_pages, v_pages, page_indices, page_numbers, lengths, k_scales, v_scales,
            sink, window, num_splits)
  scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
  if num_splits is None:
    num_splits = default_num_splits(page_indices.shape[-1])
  out, lse = PAGED_DECODE(impl, q, k_pages, v_pages, page_indices, page_numbers, lengths,
                          sink=sink, window=window, scale=scale, k_scales=k_scales,
                          v_scales=v_scales, num_splits=num_splits)
  return (out, lse) if return_lse else out


def default_num_splits(slots: int) -> int:
  """Split count for ``slots`` pages: about ``PAGES_PER_SPLIT`` pages a split, with the fewest
  padding slots (a padding slot is still gathered: page 0, masked). The smallest count in
  ``[s0, 2 s0]`` (``s0 = ceil(slots / PAGES_PER_SPLIT)``) that minimises the padding: 65 slots
  (64 selected pages + the newest) -> 13 splits of 5 instead of 9 of 8 (7 padding reads)."""
  s0 = max(1, -(-slots // PAGES_PER_SPLIT))
  pad = lambda s: s * -(-slots // s) - slots
  return min(range(s0, 2 * s0 + 1), key=lambda s: (pad(s), s))


def _pallas_impl(q, k_pages, v_pages, page_indices, page_numbers, lengths, *, sink, window, scale,
                 k_scales, v_scales, num_splits, interpret=False):
  if not interpret:
    require_backend("paged decode attention")  # Triton on GPU, Mosaic on TPU
  if k_scales is not None:
    raise NotImplementedError("the Pallas paged decode kernel reads float pages only; "
                              "int8 pages use impl='xla'")
  from pallas_kernels.paged_attention import PagedDecodeBlocks
  return paged_decode_pallas(q, k_pages, v_pages, page_indices, page_numbers, lengths, sink=sink,
                             window=window, scale=scale,
                             blocks=PagedDecodeBlocks(num_splits=num_splits), interpret=interpret)


def paged_decode_pallas(q, k_pages, v_pages, page_indices, page_numbers, lengths, *, sink=None,
                        window=None, scale, blocks=None, interpret: bool = False):
  """The Pallas kernel (``pallas_kernels.paged_attention``, ``blocks``: its ``PagedDecodeBlocks``)
  and the split-K merge: ``(out [b, h, d] in q.dtype, lse float32 [b, h])`` like the XLA twin."""
  from pallas_kernels import paged_attention as kernel
  b, h, d = q.shape
  g = h // k_pages.shape[1]
  o, m, l = kernel.paged_decode_partials(
      q, k_pages, v_pages, page_indices, page_numbers, lengths, sink=sink, window=window,
      scale=scale, blocks=kernel.PagedDecodeBlocks() if blocks is None else blocks,
      interpret=interpret)  # [b, hk, S, G, d], [b, hk, S, G] x2 (G: group padded for tl.dot)
  out, lse = merge_lse(*normalize_partial(o, m, l), axis=2)  # [b, hk, G, d], [b, hk, G]
  return out[:, :, :g].reshape(b, h, d).astype(q.dtype), lse[:, :, :g].reshape(b, h)


def _validate(q, k_pages, v_pages, page_indices, page_numbers, lengths, k_scales, v_scales,
              sink, window, num_splits):
  if getattr(q, "ndim", None) != 3:
    raise ShapeError(f"q must be [batch, heads, head_dim], got shape {getattr(q, 'shape', None)}")
  for name, x in (("k_pages", k_pages), ("v_pages", v_pages)):
    if getattr(x, "ndim", None) != 4:
      raise ShapeError(f"{name} must be [num_pages, kv_heads, page_size, head_dim], "
                       f"got shape {getattr(x, 'shape', None)}")
  if k_pages.shape != v_pages.shape:
    raise ShapeError(f"k_pages {k_pages.shape} and v_pages {v_pages.shape} must match")
  b, h, d = q.shape
  n, hk, p, dk = k_pages.shape
  if dk != d:
    raise ShapeError(f"page head_dim {dk} must equal q head_dim {d}")
  if hk == 0 or h % hk:
    raise ShapeError(f"heads={h} must be a multiple of kv_heads={hk}")
  for name, x in (("page_indices", page_indices), ("page_numbers", page_numbers)):
    if getattr(x, "ndim", None) != 3 or x.shape[:2] != (b, hk):
      raise ShapeError(f"{name} must be int[batch={b}, kv_heads={hk}, K], got shape "
                       f"{getattr(x, 'shape', None)}")
    if not jnp.issubdtype(x.dtype, jnp.integer):
      raise ShapeError(f"{name} must be an integer array, got {x.dtype}")
  if page_indices.shape != page_numbers.shape:
    raise ShapeError(f"page_indices {page_indices.shape} and page_numbers {page_numbers.shape} differ")
  if getattr(lengths, "shape", None) != (b,):
    raise ShapeError(f"lengths must be int[batch={b}], got shape {getattr(lengths, 'shape', None)}")
  quant = k_pages.dtype == jnp.int8
  if quant != (k_scales is not None) or (k_scales is None) != (v_scales is None):
    raise ShapeError("int8 pages need both k_scales and v_scales (and float pages neither)")
  if quant:
    for name, s in (("k_scales", k_scales), ("v_scales", v_scales)):
      if s.shape != (n, hk, p):
        raise ShapeError(f"{name} must be [num_pages, kv_heads, page_size]={(n, hk, p)}, got {s.shape}")
  elif not jnp.issubdtype(k_pages.dtype, jnp.floating):
    raise ShapeError(f"k_pages must be floating point or int8, got {k_pages.dtype}")
  if (sink is None) != (window is None):
    raise ConfigError(f"streaming heads need both sink and window ({sink=}, {window=})")
  if window is not None and (window < 1 or sink < 0):
    raise ConfigError(f"{window=} must be >= 1 and {sink=} >= 0")
  if num_splits is not None and num_splits < 1:
    raise ConfigError(f"{num_splits=} must be >= 1")


def visible_tokens(page_numbers, lengths, page_size: int, sink=None, window=None):
  """``bool[batch, kv_heads, K, page_size]``: which slots of the chosen pages are visible."""
  pos = page_numbers[..., None] * page_size + jnp.arange(page_size)  # [b, hk, K, page]
  length = lengths[:, None, None, None]
  vis = (page_numbers[..., None] >= 0) & (pos < length)
  if window is not None:
    vis = vis & ((pos < sink) | (pos >= length - window))
  return vis


@functools.partial(jax.jit, static_argnames=("sink", "window", "scale", "num_splits"))
def paged_decode_xla(q, k_pages, v_pages, page_indices, page_numbers, lengths, *, sink, window,
                     scale, k_scales=None, v_scales=None, num_splits=1):
  """Gather + split-K flash-decode. Returns ``(out [b, h, d], lse float32 [b, h])``."""
  b, h, d = q.shape
  n, hk, p, _ = k_pages.shape
  g = h // hk
  kk = page_indices.shape[-1]
  pad = -kk % num_splits
  if pad:  # empty slots (number -1) so that every split has the same size
    page_indices = jnp.pad(page_indices, ((0, 0), (0, 0), (0, pad)))
    page_numbers = jnp.pad(page_numbers, ((0, 0), (0, 0), (0, pad)), constant_values=-1)
    kk += pad
  # Row r = page * kv_heads + head of the flattened pool is one contiguous [page, dim] block.
  rows = page_indices * hk + jnp.arange(hk, dtype=page_indices.dtype)[None, :, None]  # [b, hk, K]
  qg = q.astype(jnp.float32).reshape(b, hk, g, d)  # [batch, kv_heads, group, dim]
  c = kk // num_splits
  # Split s covers slots [s * c, (s + 1) * c): [split, b, hk, c]
  rows = rows.reshape(b, hk, num_splits, c).transpose(2, 0, 1, 3)
  nums = page_numbers.reshape(b, hk, num_splits, c).transpose(2, 0, 1, 3)

  def split(_, x):
    """Gathers one split's pages (a cache-sized chunk) and returns its softmax partials."""
    r, n = x
    ks = _gather(k_pages, k_scales, r.reshape(-1), (b, hk, c * p, d))  # [b, hk, tokens, d]
    vs = _gather(v_pages, v_scales, r.reshape(-1), (b, hk, c * p, d))
    # Scores as [tokens, group] with the pages as the dot's left operand: XLA:CPU runs the
    # scores alone 2x faster than q @ k^T (contiguous keys at 16K, 8 kv heads, group 4, d=128:
    # 8.0 vs 15.6 ms); the whole op gains 0-12% (the page gather dominates it).
    s = jnp.einsum("bhtd,bhgd->bhtg", ks, qg, preferred_element_type=jnp.float32) * scale
    vis = visible_tokens(n, lengths, p, sink, window).reshape(b, hk, c * p, 1)
    s = jnp.where(vis, s, -jnp.inf)
    m = jnp.max(s, axis=-2)  # [b, hk, g]
    pr = jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0)[..., None, :])  # [b, hk, tokens, g]
    o = jnp.einsum("bhtg,bhtd->bhgd", pr, vs, preferred_element_type=jnp.float32)
    return None, normalize_partial(o, m, jnp.sum(pr, axis=-2))

  if num_splits == 1:
    _, (o, lse) = split(None, (rows[0], nums[0]))
    o, lse = o[None], lse[None]
  else:  # one chunk at a time: the gathered pages stay in cache instead of one large copy
    _, (o, lse) = jax.lax.scan(split, None, (rows, nums))
  out, lse = merge_lse(o, lse, axis=0)  # [b, hk, g, d], [b, hk, g]
  return out.reshape(b, h, d).astype(q.dtype), lse.reshape(b, h)


def _gather(pages, scales, rows, shape):
  p = pages.shape[2]
  x = jnp.take(pages.reshape(-1, p, pages.shape[-1]), rows, axis=0, mode="clip")
  if scales is not None:
    sc = jnp.take(scales.reshape(-1, p), rows, axis=0, mode="clip")
    x = x.astype(jnp.float32) * sc[..., None]
  return x.reshape(shape).astype(jnp.float32)


PAGED_DECODE = Dispatcher("paged_decode_attention", {
    "xla": paged_decode_xla,
    "pallas": _pallas_impl,
    "pallas_interpret": functools.partial(_pallas_impl, interpret=True),
})
