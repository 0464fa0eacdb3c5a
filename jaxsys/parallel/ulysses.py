"""DeepSpeed-Ulysses sequence parallelism (Jacobs et al. 2023) as a shard_map program.

Each of ``P`` ranks holds ``[b, s/P, h, d]``. One all-to-all splits heads and gathers the
sequence, ``[b, s/P, h, d] -> [b, s, h/P, d]``; every rank then runs ordinary attention over the
whole sequence for its ``h/P`` heads, and the inverse all-to-all brings ``[b, s/P, h, d]`` back.
Per layer each rank sends ``4 * (P-1)/P * b*s/P*h*d`` elements (q, k, v in, o out) — constant in
``P`` for a fixed per-rank length, which is why Ulysses scales until ``P`` reaches the head count.

GQA/MQA: with ``kv_heads % P != 0`` each kv head is repeated ``P / kv_heads`` times before the
all-to-all (the minimal replication that gives every rank exactly the kv head its query heads
read, keeping the group ratio); this needs ``P % kv_heads == 0``.

Usage (inside ``shard_map`` over axis "ulysses")::

  out = ulysses_attention_shard(q, k, v, axis="ulysses", size=4, mask=masks.Causal())
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxsys.core.errors import ShapeError
from jaxsys.ops.attn.api import attention


def check_heads(heads: int, kv_heads: int, size: int, what: str = "ulysses degree"):
  """Raises ``ShapeError`` unless ``heads`` split over ``size`` ranks and kv heads can follow."""
  if heads % size:
    raise ShapeError(f"heads={heads} must be divisible by the {what} ({size}) to split heads")
  if kv_heads % size and size % kv_heads:
    raise ShapeError(f"kv_heads={kv_heads} must divide or be divisible by the {what} ({size}) "
                     f"(kv heads are split, or repeated minimally, across ranks)")


def replicate_kv_heads(k, size: int):
  """``[b, n, hk, d] -> [b, n, max(hk, size), d]``: repeat each kv head ``size/hk`` times if needed.

  Query head ``i`` of ``h`` reads kv head ``i // (h/hk)``; after repeating, the rank holding query
  heads ``[r h/P, (r+1) h/P)`` holds kv head ``r`` of the repeated set, which is original head
  ``r // (P/hk)`` = the head those queries read.
  """
  hk = k.shape[2]
  if hk % size == 0:
    return k
  return jnp.repeat(k, size // hk, axis=2)


def seq_to_heads(x, axis):
  """``[b, n, h, d] -> [b, n*P, h/P, d]``: split heads, gather the sequence (rank order)."""
  return jax.lax.all_to_all(x, axis, split_axis=2, concat_axis=1, tiled=True)


def heads_to_seq(x, axis):
  """``[b, s, h/P, d] -> [b, s/P, h, d]``: the inverse all-to-all."""
  return jax.lax.all_to_all(x, axis, split_axis=1, concat_axis=2, tiled=True)


def gather_seq(x, axis):
  """``[b, n] -> [b, n*P]`` (segment ids travel whole: they are small)."""
  return None if x is None else jax.lax.all_gather(x, axis, axis=1, tiled=True)


def _split_segments(segment_ids):
  if segment_ids is None:
    return None, None
  if isinstance(segment_ids, (tuple, list)):
    return tuple(jnp.asarray(s, jnp.int32) for s in segment_ids)
  s = jnp.asarray(segment_ids, jnp.int32)
  return s, s


def ulysses_attention_shard(q, k, v, *, axis, size: int, mask=None, segment_ids=None, scale=None,
                            impl: str = "auto", inner: Callable | None = None):
  """Ulysses attention on local shards (call inside ``shard_map``).

  Args:
    q: ``[batch, n, heads, dim]``; k, v: ``[batch, n, kv_heads, dim]`` (``n = seq/size``).
    axis: mesh axis name (or tuple) of the Ulysses group; ``size`` its degree.
    inner: attention on the gathered sequence, ``inner(q, k, v, (q_ids, kv_ids) | None)``;
      default ``jaxsys.ops.attention`` over the full sequence (any head-independent mask).
  """
  b, n, h, d = q.shape
  check_heads(h, k.shape[2], size)
  if mask is not None and mask.num_heads is not None and size > 1:
    raise NotImplementedError("head-dependent masks are not split across Ulysses ranks; "
                              "use strategy='ring' or 'allgather'")
  q_seg, k_seg = _split_segments(segment_ids)
  k, v = replicate_kv_heads(k, size), replicate_kv_heads(v, size)
  # [batch, seq/P, heads, dim] -> [batch, seq, heads/P, dim]
  qh, kh, vh = (seq_to_heads(t, axis) for t in (q, k, v))
  seg = None if q_seg is None else (gather_seq(q_seg, axis), gather_seq(k_seg, axis))
  if inner is None:
    out = attention(qh, kh, vh, mask=mask, segment_ids=seg, scale=scale, impl=impl, q_offset=0)
  else:
    out = inner(qh, kh, vh, seg)
  return heads_to_seq(out, axis)  # [batch, seq/P, heads, dim]


def ulysses_comm_elements(batch: int, seq: int, heads: int, kv_heads: int, dim: int,
                          size: int) -> dict:
  """Elements one rank sends per attention layer (forward): all-to-alls of q, k, v and o."""
  if size == 1:
    return {"all-to-all": 0}
  hk = max(kv_heads, size) if kv_heads % size else kv_heads
  n = seq // size
  frac = (size - 1) / size
  return {"all-to-all": int(batch * n * dim * frac * (2 * heads + 2 * hk))}


__all__ = ["ulysses_attention_shard", "seq_to_heads", "heads_to_seq", "replicate_kv_heads",
           "check_heads", "ulysses_comm_elements"]
