"""The one public attention entry point and its dispatcher.

Implementations are tried in order; one that cannot serve a call raises
``NotImplementedError`` with the reason, and ``impl="auto"`` moves on to the next.
"""

from __future__ import annotations

from collections.abc import Callable

import jax

from jaxsys.ops.attention.common import AttentionArgs, validate

IMPLS = ("auto", "xla", "pallas", "pallas_interpret", "reference")
_REGISTRY: dict[str, Callable[[AttentionArgs], tuple]] = {}


def register(name: str):
  def deco(fn):
    _REGISTRY[name] = fn
    return fn
  return deco


def _load(name: str):
  if name not in _REGISTRY:
    if name == "reference":
      from jaxsys.ops.attention import reference
      register("reference")(reference.attention_reference)
    elif name == "xla":
      try:
        from jaxsys.ops.attention import xla  # noqa: F401  (registers itself)
      except ImportError:
        from jaxsys.ops.attention import reference
        register("xla")(reference.attention_reference)
    elif name in ("pallas", "pallas_interpret"):
      try:
        from jaxsys.ops.attention import pallas  # noqa: F401  (registers itself)
      except ImportError as e:
        raise NotImplementedError(f"{name} attention is unavailable: {e}") from e
  if name not in _REGISTRY:
    raise NotImplementedError(f"attention implementation {name!r} is not available")
  return _REGISTRY[name]


def auto_order() -> tuple[str, ...]:
  return ("pallas", "xla") if jax.default_backend() in ("gpu", "tpu") else ("xla",)


def attention(q, k, v, *, mask=None, segment_ids=None, scale=None, impl: str = "auto",
              return_lse: bool = False, q_offset=None, kv_lengths=None, check: bool = False):
  """Multi-head attention ``softmax(q k^T * scale) v`` under a lazy mask.

  Args:
    q: ``[batch, q_len, heads, head_dim]``.
    k, v: ``[batch, kv_len, kv_heads, head_dim]``; ``heads`` a multiple of ``kv_heads`` (query
      head h reads kv head ``h // (heads // kv_heads)``).
    mask: a ``jaxsys.ops.masks.Mask`` or None (full attention).
    segment_ids: ``int[batch, len]`` (q_len == kv_len) or a pair ``(q_ids, kv_ids)``; tokens
      attend only within equal ids (packed sequences).
    scale: logit scale, default ``1/sqrt(head_dim)``.
    impl: "auto" | "xla" | "pallas" | "pallas_interpret" | "reference".
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
  if impl not in IMPLS:
    raise ValueError(f"{impl=} must be one of {IMPLS}")
  args = validate(q, k, v, mask=mask, segment_ids=segment_ids, scale=scale, q_offset=q_offset,
                  kv_lengths=kv_lengths, check=check)
  order = auto_order() if impl == "auto" else (impl,)
  errors = []
  for name in order:
    try:
      out, lse = _load(name)(args)
    except NotImplementedError as e:
      if impl != "auto":
        raise
      errors.append(f"{name}: {e}")
      continue
    return (out, lse) if return_lse else out
  raise NotImplementedError("no attention implementation could serve this call: " + "; ".join(errors))
