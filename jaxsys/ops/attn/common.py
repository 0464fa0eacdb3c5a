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

__all__ = ["AttentionArgs", "dense_at", "soft_cap", "validate", "visible_mask"]


@dataclasses.dataclass(frozen=True)
class AttentionArgs:
  """Validated inputs. ``q_offset``: int or int32[b]; ``kv_lengths``: None or int32[b].

  Dense per-call terms (None when absent): ``token_mask`` bool ``[b|1, h|1, q, k]`` (True:
  visible), ``bias`` float ``[b|1, h|1, q, k]`` added to the logits (an additive mask is folded
  in here), ``logits_soft_cap``: logits become ``cap * tanh(logits / cap)`` before the bias.
  """
  q: Any
  k: Any
  v: Any
  mask: masks_lib.Mask | None
  q_segment_ids: Any
  kv_segment_ids: Any
  scale: float
  q_offset: Any
  kv_lengths: Any
  token_mask: Any = None
  bias: Any = None
  logits_soft_cap: float | None = None

  @property
  def dense_terms(self) -> bool:
    """A dense mask or bias: ``[q, k]`` values that no block layout describes."""
    return self.token_mask is not None or self.bias is not None

  @property
  def static_offset(self) -> int | None:
    return self.q_offset if isinstance(self.q_offset, int) else None


def validate(q, k, v, *, mask=None, segment_ids=None, scale=None, q_offset=None,
             kv_lengths=None, check=False, bias=None, logits_soft_cap=None) -> AttentionArgs:
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
  token_mask = None
  if mask is not None and not isinstance(mask, masks_lib.Mask) and hasattr(mask, "shape"):
    mask = _dense("mask", mask, b, h, tq, tk)
    if mask.dtype == jnp.bool_:
      token_mask, mask = mask, None
    else:  # an additive mask is a bias
      bias = mask if bias is None else mask + _dense("bias", bias, b, h, tq, tk)
      mask = None
  if token_mask is not None and bias is None and mask is None:
    # A concrete mask shared by the batch, with tiles that see no key, becomes a lazy Dense mask:
    # the tiled paths then skip those tiles. Traced or per-example masks run the dense formula.
    structured = _structured(token_mask)
    if structured is not None:
      token_mask, mask = None, structured
  if bias is not None:
    bias = _dense("bias", bias, b, h, tq, tk)
    if bias.dtype == jnp.bool_:
      raise ShapeError("bias must be floating point (pass a boolean visibility array as mask=)")
  if logits_soft_cap is not None:
    if not isinstance(logits_soft_cap, (int, float, np.number)) or not logits_soft_cap > 0:
      raise ShapeError(f"{logits_soft_cap=} must be a positive number or None")
    logits_soft_cap = float(logits_soft_cap)
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
  return AttentionArgs(q, k, v, mask, q_seg, kv_seg, float(scale), q_offset, kv_lengths,
                       token_mask, bias, logits_soft_cap)


def _dense(name, x, b, h, tq, tk):
  """A dense ``[b|1, h|1, q, k]`` term (bool or floating), checked by shape."""
  x = jnp.asarray(x)
  ok = (x.ndim == 4 and x.shape[0] in (1, b) and x.shape[1] in (1, h) and x.shape[2:] == (tq, tk))
  if not ok:
    raise ShapeError(f"{name} must be a Mask or an array [batch|1, heads|1, q_len, kv_len] = "
                     f"[{b}|1, {h}|1, {tq}, {tk}], got shape {x.shape}")
  if not (x.dtype == jnp.bool_ or jnp.issubdtype(x.dtype, jnp.floating)):
    raise ShapeError(f"{name} must be boolean (visibility) or floating (additive), got dtype {x.dtype}")
  return x


def _structured(token_mask):
  """``masks.from_dense`` of a concrete ``[1, h|1, q, k]`` mask, or None (traced, per example,
  or with too few empty tiles)."""
  if isinstance(token_mask, jax.core.Tracer) or token_mask.shape[0] != 1:
    return None
  return masks_lib.from_dense(np.asarray(token_mask)[0])


def soft_cap(s, cap: float | None):
  """``cap * tanh(s / cap)`` (Gemma 2's attention-logit cap), or ``s`` when ``cap`` is None."""
  return s if cap is None else cap * jnp.tanh(s / cap)


def _check_block_sparse(mask, tq, tk):
  if isinstance(mask, (masks_lib.BlockSparse, masks_lib.Dense)):
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
  if args.token_mask is not None:
    vis = vis & dense_at(args.token_mask, q_idx, k_idx, fill=False)
  tk = args.k.shape[1]
  vis = vis & (ki < tk)
  return vis


def dense_at(x, q_idx, k_idx, fill):
  """``x [b|1, h|1, q, k]`` at query / key index vectors (``fill`` outside): ``[b|1, h|1, nq, nk]``."""
  x = jnp.take(x, q_idx, axis=2, mode="fill", fill_value=fill)
  return jnp.take(x, k_idx, axis=3, mode="fill", fill_value=fill)
