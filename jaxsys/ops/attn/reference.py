"""Naive dense attention: softmax(cap(Q K^T * scale) + bias, masked) V in float32 at HIGHEST precision.

The ground truth every implementation is tested against. Memory is quadratic in length.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxsys.ops.attn.common import AttentionArgs, soft_cap, visible_mask

__all__ = ["attention_reference"]


def attention_reference(args: AttentionArgs, precision=jax.lax.Precision.HIGHEST):
  """Returns ``(out [b, q, h, d] in q.dtype, lse [b, h, q] float32)``.

  ``precision`` of the two einsums: HIGHEST for the oracle; the XLA backend reuses this formula
  at DEFAULT for problems of a single tile (see ``xla.blockwise_attention``).
  """
  q, k, v = args.q, args.k, args.v
  b, tq, h, d = q.shape
  hk = k.shape[2]
  g = h // hk
  qf = q.astype(jnp.float32).reshape(b, tq, hk, g, d)  # [batch, q, kv_heads, group, dim]
  kf, vf = k.astype(jnp.float32), v.astype(jnp.float32)
  s = jnp.einsum("bqkgd,bskd->bkgqs", qf, kf, precision=precision) * args.scale
  s = soft_cap(s.reshape(b, h, tq, k.shape[1]), args.logits_soft_cap)  # [batch, heads, q, kv]
  vis = visible_mask(args, jnp.arange(tq), jnp.arange(k.shape[1]))  # [b or 1, h or 1, q, kv]
  if args.bias is not None:
    # -inf entries (an additive mask) hide their keys; only finite values enter the arithmetic,
    # so no inf - inf reaches the backward pass
    bias = args.bias.astype(jnp.float32)
    vis = vis & (bias > -jnp.inf)
    s = s + jnp.where(bias > -jnp.inf, bias, 0.0)
  s = jnp.where(vis, s, -jnp.inf)
  m = jnp.max(s, axis=-1, keepdims=True)
  m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
  p = jnp.exp(s - m_safe)
  l = jnp.sum(p, axis=-1, keepdims=True)
  lse = jnp.where(l > 0, jnp.log(jnp.where(l > 0, l, 1.0)) + m_safe, -jnp.inf)[..., 0]
  p = p / jnp.where(l > 0, l, 1.0)  # fully masked rows: p == 0 -> output 0
  p = p.reshape(b, hk, g, tq, k.shape[1])
  out = jnp.einsum("bkgqs,bskd->bqkgd", p, vf, precision=precision)
  return out.reshape(b, tq, h, v.shape[-1]).astype(q.dtype), lse
