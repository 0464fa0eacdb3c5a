"""What the flash-attention kernels of both lowerings share: the static call description and the
in-kernel math (products with f32 accumulation, the mask applied to a score tile).

``flash_attention.py`` holds the Triton kernels (whole K/V rows per program, the visited tiles
sliced out), ``flash_tpu.py`` the Mosaic ones (visited K/V blocks streamed through the grid).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
from jax import lax

__all__ = ["BACKENDS", "dot", "dot_ta", "F32", "KernelConfig", "lse_delta", "mask_scores", "sum_query_groups"]

F32 = jnp.float32
BACKENDS = ("triton", "mosaic")


@dataclasses.dataclass(frozen=True, eq=False)
class KernelConfig:
  """Static description of one call (shapes are the padded kernel shapes)."""
  heads: int
  kv_heads: int
  table_heads: int               # 1 (shared table) or heads
  visits: int                    # V: table slots per row
  visits_t: int                  # V of the transposed table
  block_q: int
  block_k: int
  scale: float
  q_len: int                     # real (unpadded) lengths
  kv_len: int
  visible_fn: Callable[..., Any]  # (q_idx [bq,1], q_pos, k_idx [1,bk], head, bits) -> bool
  backend: str = "triton"
  interpret: bool = False
  num_warps: int = 4
  num_stages: int = 2

  def __post_init__(self):
    if self.backend not in BACKENDS:
      raise ValueError(f"backend={self.backend!r} must be one of {BACKENDS}")
    if self.heads % self.kv_heads:
      raise ValueError(f"heads={self.heads} must be divisible by kv_heads={self.kv_heads}")

  @property
  def group(self) -> int:
    return self.heads // self.kv_heads


def dot(a, b, trans_b=False):
  """``a b`` (or ``a b^T``) of 2-D tiles, accumulated in f32."""
  dims = (((1,), (1 if trans_b else 0,)), ((), ()))
  return lax.dot_general(a, b, dims, preferred_element_type=F32)


def dot_ta(a, b):
  """``a^T b`` for a ``[m, k]``, b ``[m, n]``."""
  return lax.dot_general(a, b, (((0,), (0,)), ((), ())), preferred_element_type=F32)


def mask_scores(cfg: KernelConfig, s, cls, qi, qpos, ki, head, bits, qseg, kseg, kv_length):
  """Sets invisible logits of the ``[bq, bk]`` tile ``s`` to -inf; class-1 (fully visible)
  blocks skip the token mask. ``qi [bq, 1]`` / ``ki [1, bk]``: token indices; ``qseg`` /
  ``kseg``: segment ids (equal ids attend); ``kv_length``: this batch row's valid keys."""
  vis = (ki < cfg.kv_len) & (ki < kv_length) & (qseg == kseg)
  vis = vis & cfg.visible_fn(qi, qpos, ki, head, bits)
  return jnp.where((cls == 1) | vis, s, -jnp.inf)


def lse_delta(do, out, dlse):
  """``delta [b, h, Tq, 1] = rowsum(dO * O) - dlse``: FlashAttention-2's delta, with the lse
  cotangent folded in (d lse / d s = p)."""
  return jnp.sum(do.astype(F32) * out.astype(F32), axis=-1, keepdims=True) - dlse


def sum_query_groups(cfg: KernelConfig, dk, dv, k_dtype, v_dtype):
  """Per-query-head ``dk, dv [b, h, Tk, d]`` (f32) summed over each kv head's query group, in the
  inputs' dtypes: ``[b, kv_heads, Tk, d]``."""
  b, _, tk, _ = dk.shape
  group = lambda x: x.reshape(b, cfg.kv_heads, cfg.group, tk, x.shape[-1]).sum(2)  # noqa: E731
  return group(dk).astype(k_dtype), group(dv).astype(v_dtype)
