"""Argument validation and token-level visibility shared by every attention backend."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxsys.core.errors import InputError, ShapeError
from jaxsys.ops import masks as masks_lib

__all__ = ["AttentionArgs", "validate", "visible_mask"]


@dataclasses.dataclass(frozen=True)
class AttentionArgs:
  """Validated inputs. ``q_offset``: int or int32[b]; ``kv_lengths``: None or int32[b]."""
  q: Any
  k: Any
  v: Any
  mask: masks_lib.Mask | None
  q_segment_ids: Any
  kv_segment_ids: Any
  scale: float
  q_offset: Any
  kv_lengths: Any

  @property
  def static_offset(self) -> int | None:
    return self.q_offset if isinstance(self.q_offset, int) else None


def validate(q, k, v, *, mask=None, segment_ids=None, scale=None, q_offset=None,
             kv_lengths=None, check=False) -> AttentionArgs:
  for name, x in (("q", q), ("k", k), ("v", v)):
    if getattr(x, "ndim", None) != 4:
      raise ShapeError(f"{name} must be [batch, len, heads, head_dim], got shape {getattr(x, 'shape', None)}")
    if not jnp.issubdtype(x.dtype, jnp.floating):
      raise ShapeError(f"{name} must be floating point, got dtype {x.dtype}")
  if not (q.dtype == k.dtype == v.dtype):
    raise ShapeError(f"q, k, v dtypes differ: {q.dtype=}, {k.dtype=}, {v.dtype=}")
  b, tq, h, d = q.shape
  if k.shape[:3] != v.shape[:3] or k.shape[0] != b:
    raise ShapeError(f"k {k.shape} and v {v.shape} must share [batch, kv_len, kv_heads] with batch={b}")
  if k.shape[-1] != d:
    raise ShapeError(f"k head_dim {k.shape[-1]} must equal q head_dim {d}")
  hk = k.shape[2]
  if h % hk:
    raise ShapeError(f"heads={h} must be a multiple of kv_heads={hk}")
  tk = k.shape[1]
  if mask is not None:
    mask = masks_lib._as_mask(mask)
    if mask.num_heads is not None and mask.num_heads != h:
      raise ShapeError(f"mask is defined for {mask.num_heads} heads but q has heads={h}")
    _check_block_sparse(mask, tq, tk)
  q_seg, kv_seg = _segments(segment_ids, b, tq, tk)
  if q_offset is None:
    q_offset = tk - tq
  elif not isinstance(q_offset, (int, np.integer)):
    q_offset = jnp.asarray(q_offset, jnp.int32)
    if q_offset.ndim == 0:
      q_offset = jnp.broadcast_to(q_offset, (b,))
    if q_offset.shape != (b,):
      raise ShapeError(f"q_offset must be an int or int[batch={b}], got shape {q_offset.shape}")
  else:
    q_offset = int(q_offset)
  if kv_lengths is not None:
    kv_lengths = jnp.asarray(kv_lengths, jnp.int32)
    if kv_lengths.shape != (b,):
      raise ShapeError(f"kv_lengths must be int[batch={b}], got shape {kv_lengths.shape}")
  if scale is None:
    scale = 1.0 / math.sqrt(d)
  if check:
    for name, x in (("q", q), ("k", k), ("v", v)):
      if not isinstance(x, jax.core.Tracer) and not bool(jnp.all(jnp.isfinite(x))):
        raise InputError(f"{name} contains NaN or Inf values")
  return AttentionArgs(q, k, v, mask, q_seg, kv_seg, float(scale), q_offset, kv_lengths)


def _check_block_sparse(mask, tq, tk):
  if isinstance(mask, masks_lib.BlockSparse):
    mask.check_lengths(tq, tk)
  for child in getattr(mask, "masks", ()):
    _check_block_sparse(child, tq, tk)
  if isinstance(mask, masks_lib.BlockSparse) and mask.token_mask is not None:
    _check_block_sparse(mask.token_mask, tq, tk)


def _segments(segment_ids, b, tq, tk):
  if segment_ids is None:
    return None, None
  if isinstance(segment_ids, (tuple, list)):
    if len(segment_ids) != 2:
      raise ShapeError("segment_ids must be an array [batch, len] or a pair (q_segment_ids, kv_segment_ids)")
    q_seg, kv_seg = (jnp.asarray(s) for s in segment_ids)
  else:
    q_seg = kv_seg = jnp.asarray(segment_ids)
    if tq != tk:
      raise ShapeError(f"a single segment_ids array needs q_len == kv_len ({tq=}, {tk=}); pass a pair")
  if q_seg.shape != (b, tq):
    raise ShapeError(f"q segment_ids must have shape {(b, tq)}, got {q_seg.shape}")
  if kv_seg.shape != (b, tk):
    raise ShapeError(f"kv segment_ids must have shape {(b, tk)}, got {kv_seg.shape}")
  if not jnp.issubdtype(q_seg.dtype, jnp.integer) or not jnp.issubdtype(kv_seg.dtype, jnp.integer):
    raise ShapeError("segment_ids must be integer arrays")
  return q_seg.astype(jnp.int32), kv_seg.astype(jnp.int32)


def visible_mask(args: AttentionArgs, q_idx, k_idx, head_axis: bool = True):
  """Token visibility ``bool[b or 1, h or 1, len(q_idx), len(k_idx)]`` for index vectors."""
  h = args.q.shape[2]
  qi = q_idx[None, None, :, None]
  ki = k_idx[None, None, None, :]
  if isinstance(args.q_offset, int):
    qp = qi + args.q_offset
  else:
    qp = qi + args.q_offset[:, None, None, None]
  vis = jnp.ones((1, 1, 1, 1), bool)
  if args.mask is not None:
    head = jnp.arange(h)[None, :, None, None] if args.mask.num_heads is not None else None
    vis = vis & args.mask.visible(qi, qp, ki, head)
  if args.q_segment_ids is not None:
    qs = jnp.take(args.q_segment_ids, q_idx, axis=1, mode="fill", fill_value=-1)
    ks = jnp.take(args.kv_segment_ids, k_idx, axis=1, mode="fill", fill_value=-2)
    vis = vis & (qs[:, None, :, None] == ks[:, None, None, :])
  if args.kv_lengths is not None:
    vis = vis & (ki < args.kv_lengths[:, None, None, None])
  tk = args.k.shape[1]
  vis = vis & (ki < tk)
  return vis
