"""``impl="jax_triton"``: the forward through the Triton-language kernel of
``pallas_kernels/triton_flash.py`` (called with ``jax_triton``, the GPU route JAX 0.11 points to
after deprecating Pallas' Triton backend; the module docstring there gives the reason), the
backward through the XLA twin (``custom_vjp``: the probabilities are recomputed from q, k, v).

Explicit only (``auto`` keeps ``pallas`` then ``xla`` until this route passes the device suite).
It serves dense and causal masks with a static ``q_offset``, no segment ids or ``kv_lengths``,
bf16 / f16 inputs and head_dim up to 128 (padded to a power of two); anything else raises
``NotImplementedError`` with the reason before tracing, as does a host without a GPU or without
``jax_triton`` (``pip install jax-triton``).
"""

from __future__ import annotations

import dataclasses
import importlib.util

import jax
import jax.numpy as jnp

from jaxsys.core.dispatch import require_backend
from jaxsys.ops import masks as M
from jaxsys.ops.attn import xla
from jaxsys.ops.attn.common import AttentionArgs
from pallas_kernels import triton_flash
from pallas_kernels.backend import next_pow2

__all__ = ["check", "jax_triton_attention"]


def check(args: AttentionArgs) -> triton_flash.TritonFlashTiles:
  """The tiles for this call, or ``NotImplementedError`` naming what the route cannot serve."""
  mask = args.mask
  causal = isinstance(mask, M.Causal)
  if not (mask is None or causal or isinstance(mask, M.Full)):
    raise NotImplementedError(f"jax_triton attention serves dense or causal masks, not {type(mask).__name__}")
  if args.q_segment_ids is not None or args.kv_lengths is not None:
    raise NotImplementedError("jax_triton attention takes no segment_ids or kv_lengths")
  if args.dense_terms or args.logits_soft_cap is not None:
    raise NotImplementedError("jax_triton attention takes no dense mask, bias or logits_soft_cap")
  if args.static_offset is None:
    raise NotImplementedError("jax_triton attention needs a static (int) q_offset")
  if args.q.dtype not in (jnp.bfloat16, jnp.float16):
    raise NotImplementedError(f"jax_triton attention runs bf16 / f16 inputs, not {args.q.dtype}")
  d = max(16, next_pow2(args.q.shape[-1]))
  if d not in triton_flash.TILES or args.v.shape[-1] != args.q.shape[-1]:
    raise NotImplementedError(f"jax_triton attention has no verified tile for head_dim "
                              f"{args.q.shape[-1]} / {args.v.shape[-1]}")
  return triton_flash.TILES[d]


def _forward(args: AttentionArgs, tiles, q, k, v):
  """``(out [b, q, h, d], lse [b, h, q])`` from the kernel, with lengths and head_dim padded."""
  b, tq, h, d = q.shape
  tk = k.shape[1]
  d_p = max(16, next_pow2(d))
  tq_p = -(-tq // tiles.block_m) * tiles.block_m
  tk_p = -(-tk // tiles.block_n) * tiles.block_n

  def prep(x, length):  # [b, t, heads, d] -> [b, heads, T, D], zero padded
    return jnp.pad(x, ((0, 0), (0, length - x.shape[1]), (0, 0), (0, d_p - d))).transpose(0, 2, 1, 3)

  out, lse = triton_flash.flash_forward(
      prep(q, tq_p), prep(k, tk_p), prep(v, tk_p), scale=args.scale, kv_len=tk,
      q_offset=args.static_offset, causal=isinstance(args.mask, M.Causal), tiles=tiles)
  return out.transpose(0, 2, 1, 3)[:, :tq, :, :d], lse[:, :, :tq]


def jax_triton_attention(args: AttentionArgs):
  """``(out [b, q, h, dv], lse [b, h, q])``: forward on the Triton kernel, backward on XLA."""
  require_backend("attention (jax_triton)", ("gpu",), "GPU")
  if importlib.util.find_spec("jax_triton") is None:
    raise NotImplementedError("impl='jax_triton' needs the jax-triton package (pip install jax-triton)")
  tiles = check(args)

  def twin(q, k, v):
    return xla.blockwise_attention(dataclasses.replace(args, q=q, k=k, v=v))

  @jax.custom_vjp
  def attn(q, k, v):
    return _forward(args, tiles, q, k, v)

  def fwd(q, k, v):
    return _forward(args, tiles, q, k, v), (q, k, v)

  def bwd(res, cts):
    return jax.vjp(twin, *res)[1](cts)

  attn.defvjp(fwd, bwd)
  return attn(args.q, args.k, args.v)
