"""The one public attention entry point and its dispatcher.

Implementations are tried in order by the shared dispatcher (``jaxsys.core.dispatch``): one
that cannot serve a call raises ``NotImplementedError`` with the reason, and ``impl="auto"``
moves on to the next.

A ``MultiHead`` mask whose query heads of each kv group share one mask (e.g. LServe's retrieval /
streaming heads) is split here into one call per distinct mask over its kv heads: a block layout
is per call, so a single call would visit the union of all heads' blocks, while each group's call
skips every block that group never sees. The naive ``reference`` keeps the single call (it is the
oracle the split is tested against).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax.numpy as jnp
import numpy as np

from jaxsys.core.dispatch import Dispatcher, auto_order  # noqa: F401  (auto_order: part of this API)
from jaxsys.ops import masks as masks_lib
from jaxsys.ops.attn.common import AttentionArgs, validate

__all__ = ["ATTENTION", "attention", "auto_order", "head_groups", "IMPLS", "register"]

def _auto_order() -> tuple[str, ...]:
  """``impl="auto"``: the kernel on accelerators, then the short-query decode path, then the
  blockwise XLA path (each refuses, before tracing, what it cannot serve)."""
  return ("pallas", "xla_decode", "xla") if "pallas" in auto_order() else ("xla_decode", "xla")


ATTENTION = Dispatcher("attention", {
    "xla": "jaxsys.ops.attn.xla:blockwise_attention",
    "xla_decode": "jaxsys.ops.attn.decode:decode_attention",
    "pallas": "jaxsys.ops.attn.pallas:pallas_compiled",
    "pallas_interpret": "jaxsys.ops.attn.pallas:pallas_interpreted",
    "jax_triton": "jaxsys.ops.attn.jax_triton:jax_triton_attention",  # explicit only, GPU
    "reference": "jaxsys.ops.attn.reference:attention_reference",  # explicit only, never auto
}, auto=_auto_order, quiet=("xla_decode",))
IMPLS = ATTENTION.names  # ("auto", "xla", "xla_decode", "pallas", "pallas_interpret", "jax_triton", "reference")
register = ATTENTION.register


def _load(name: str) -> Callable[[AttentionArgs], tuple]:
  """The implementation ``name`` (imported on first use)."""
  return ATTENTION.get(name)


def head_groups(mask, q, k):
  """``[(mask, kv_head_ids)]`` for a ``MultiHead`` mask that is uniform within each kv group, or
  None (not a ``MultiHead`` mask, heads mixed inside a kv group, unhashable masks, or shapes that
  ``validate`` will reject)."""
  if not isinstance(mask, masks_lib.MultiHead) or getattr(q, "ndim", 0) != 4 or getattr(k, "ndim", 0) != 4:
    return None
  heads, kv_heads = q.shape[2], k.shape[2]
  if mask.num_heads != heads or heads % kv_heads:
    return None
  g = heads // kv_heads
  groups: dict = {}
  try:
    for j in range(kv_heads):
      first, *rest = mask.masks[j * g:(j + 1) * g]
      if any(m != first for m in rest):
        return None
      groups.setdefault(first, []).append(j)
  except TypeError:  # a mask field that is not hashable: keep the single call
    return None
  return [(m, np.asarray(ids)) for m, ids in groups.items()]


def _split_call(call, groups, q, k, v, return_lse: bool):
  if len(groups) == 1:  # every head has the same mask: a plain call
    return call(q, k, v, mask=groups[0][0], return_lse=return_lse)
  g = q.shape[2] // k.shape[2]
  outs, lses, order = [], [], []
  for mask, kv_ids in groups:
    q_ids = (kv_ids[:, None] * g + np.arange(g)[None]).reshape(-1)   # static head lists
    o, lse = call(q[:, :, q_ids], k[:, :, kv_ids], v[:, :, kv_ids], mask=mask, return_lse=True)
    outs.append(o)
    lses.append(lse)
    order.append(q_ids)
  inverse = np.argsort(np.concatenate(order))      # back to the caller's head order
  out = jnp.concatenate(outs, axis=2)[:, :, inverse]          # [batch, q_len, heads, head_dim]
  if not return_lse:
    return out
  return out, jnp.concatenate(lses, axis=1)[:, inverse]      # [batch, heads, q_len]


def attention(q, k, v, *, mask=None, segment_ids=None, scale=None, impl: str = "auto",
              return_lse: bool = False, q_offset=None, kv_lengths=None, check: bool = False,
              bias=None, logits_soft_cap: float | None = None):
  """Multi-head attention ``softmax(cap(q k^T * scale) + bias) v`` under a mask.

  Args:
    q: ``[batch, q_len, heads, head_dim]``.
    k, v: ``[batch, kv_len, kv_heads, head_dim]``; ``heads`` a multiple of ``kv_heads`` (query
      head h reads kv head ``h // (heads // kv_heads)``).
    mask: a lazy ``jaxsys.ops.masks.Mask`` (the fast path: blocks it hides are skipped), a dense
      array ``[batch|1, heads|1, q_len, kv_len]`` -- boolean (True: visible) or floating (added to
      the logits, e.g. 0 / -inf) -- or None (full attention). A concrete boolean array shared
      by the batch (``[1, heads|1, q, k]``) with at most 3/4 of its 64 x 64 tiles visited
      (document, block-diagonal, banded masks) becomes a ``masks.Dense`` mask whose empty tiles
      the tiled XLA path skips; any other dense array runs the dense formula (``xla``). The
      Pallas kernels refuse both and ``auto`` falls back.
    bias: floating ``[batch|1, heads|1, q_len, kv_len]`` added to the logits (differentiable).
    logits_soft_cap: ``cap``: logits become ``cap * tanh(logits / cap)`` (Gemma 2), applied
      after ``scale`` and before ``bias`` and the mask.
    segment_ids: ``int[batch, len]`` (q_len == kv_len) or a pair ``(q_ids, kv_ids)``; tokens
      attend only within equal ids (packed sequences).
    scale: logit scale, default ``1/sqrt(head_dim)``.
    impl: "auto" | "xla" | "xla_decode" (a few queries over a cache) | "pallas" |
      "pallas_interpret" | "jax_triton" | "reference".
    return_lse: also return the float32 log-sum-exp ``[batch, heads, q_len]`` (-inf for rows that
      see no key), for merging partial attentions.
    q_offset: absolute position of query row 0 (int or ``int[batch]``); default
      ``kv_len - q_len`` (bottom-right aligned).
    kv_lengths: ``int[batch]``; keys at index >= length are invisible (static-size caches).
    check: raise ``InputError`` if q, k or v contain NaN/Inf (outside jit).

  Returns:
    ``out [batch, q_len, heads, head_dim]`` in q's dtype (rows that see no key are zero), and
    ``lse`` when ``return_lse``.
  """
  ATTENTION.check(impl)
  groups = None if impl == "reference" or bias is not None else head_groups(mask, q, k)
  if groups is not None:
    call = functools.partial(attention, segment_ids=segment_ids, scale=scale, impl=impl,
                             q_offset=q_offset, kv_lengths=kv_lengths, check=check,
                             logits_soft_cap=logits_soft_cap)
    return _split_call(call, groups, q, k, v, return_lse)
  args = validate(q, k, v, mask=mask, segment_ids=segment_ids, scale=scale, q_offset=q_offset,
                  kv_lengths=kv_lengths, check=check, bias=bias, logits_soft_cap=logits_soft_cap)
  out, lse = ATTENTION(impl, args)
  return (out, lse) if return_lse else out
