"""``impl="xla_decode"``: attention of a few queries over a contiguous cache, without moving the
cache. ``impl="auto"`` tries it first on every backend after ``pallas``: it refuses (before
tracing) calls with more than :data:`DECODE_MAX_Q` queries, with segment ids, or without a
cache (no ``kv_lengths`` and no speculative ``TreeMask``: short training calls), and ``xla``
serves those.

``q [b, s, heads, d]``, caches ``[b, T, kv_heads, d]``. Batched per kv head, the usual GQA
contraction needs the cache as ``[b, kv_heads, T, d]``: XLA copies both caches every layer of
every step (as many bytes as the weights at a few thousand tokens). Here the cache is read as
the matrix ``[b, T, kv_heads * d]`` (a free reshape) against block-diagonal queries ``[b,
kv_heads * d, heads * s]`` (query head h in kv head h // g's block), so ``scores [b, T, heads *
s]`` is one plain matmul; ``p^T [heads * s, T] @ V [T, kv_heads * d]`` gives every (head, kv
head) pair and the diagonal blocks are the outputs. The extra ``kv_heads``-fold multiply-adds
are tiny next to reading the cache. Visibility (mask, query offsets, lengths) is the op's own
(``visible_mask``); statistics are float32.
"""

from __future__ import annotations

import jax.numpy as jnp

from jaxsys.ops.attn.common import AttentionArgs, soft_cap, visible_mask
from jaxsys.ops.masks import TreeMask

__all__ = ["DECODE_MAX_Q", "decode_attention"]

#: Queries per row up to which this path serves a call (decode steps, speculative trees).
DECODE_MAX_Q = 16


def decode_attention(args: AttentionArgs):
  """``(out [b, s, heads, d], lse [b, heads, s])``; see the module docstring."""
  q, k_cache, v_cache = args.q, args.k, args.v
  b, s, h, d = q.shape
  if s > DECODE_MAX_Q:
    raise NotImplementedError(f"xla_decode serves at most {DECODE_MAX_Q} queries per row, got {s}")
  if args.q_segment_ids is not None:
    raise NotImplementedError("xla_decode takes no segment ids")
  if args.dense_terms:
    raise NotImplementedError("xla_decode takes no dense mask or bias")
  if args.kv_lengths is None and not isinstance(args.mask, TreeMask):
    # a short training or prefill call (no cache): the blockwise path, differentiable and
    # shard_map-safe, serves it (the block-diagonal product is for reading a cache in place)
    raise NotImplementedError("xla_decode serves cached calls: kv_lengths given, or a speculative TreeMask")
  t, hk = k_cache.shape[1], k_cache.shape[2]
  if v_cache.shape[-1] != d:
    raise NotImplementedError("xla_decode needs v's head_dim equal to q's")
  g = h // hk
  qf = q.astype(jnp.float32) * args.scale
  qf = qf.reshape(b, s, hk, g, d).transpose(0, 2, 4, 3, 1)               # [b, hk, d, g, s]
  eye = jnp.eye(hk, dtype=jnp.float32)
  qbd = (eye[None, :, None, :, None, None] * qf[:, :, :, None]).reshape(b, hk * d, h * s)
  kf = k_cache.astype(jnp.float32).reshape(b, t, hk * d)
  vf = v_cache.astype(jnp.float32).reshape(b, t, hk * d)
  sc = soft_cap(jnp.einsum("btc,bcj->btj", kf, qbd), args.logits_soft_cap)  # [b, T, heads * s]
  vis = visible_mask(args, jnp.arange(s), jnp.arange(t))                  # [b|1, h|1, s, T]
  vis = jnp.broadcast_to(vis, (vis.shape[0], h, s, t)).transpose(0, 3, 1, 2).reshape(-1, t, h * s)
  sc = jnp.where(vis, sc, -jnp.inf)
  m = jnp.max(sc, axis=1, keepdims=True)
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  p = jnp.exp(sc - m)                                                     # [b, T, heads * s]
  l = jnp.sum(p, axis=1)                                                  # [b, heads * s]
  o = jnp.einsum("btj,btc->bjc", p, vf).reshape(b, hk, g, s, hk, d)       # every kv head
  o = jnp.einsum("bkgskd->bkgsd", o)                                      # its own block
  o = o / jnp.where(l > 0, l, 1.0).reshape(b, hk, g, s)[..., None]        # unseen rows: 0
  lse = jnp.where(l > 0, m[:, 0] + jnp.log(jnp.where(l > 0, l, 1.0)), -jnp.inf).reshape(b, h, s)
  return o.reshape(b, h, s, d).transpose(0, 2, 1, 3).astype(q.dtype), lse
