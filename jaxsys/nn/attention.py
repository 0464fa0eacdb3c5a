"""Grouped-query self-attention with RoPE (Flax NNX), calling attention through a hook.

``Attention`` splits into pieces other systems reuse with their own attention and caches:

* ``project_qkv(x, positions) -> (q, k, v)``: projections (+ optional bias, Qwen2) and RoPE;
  q ``[batch, seq, heads, head_dim]``, k/v ``[batch, seq, kv_heads, head_dim]``.
* ``project_out(o)``: ``[batch, seq, heads, head_dim] -> [batch, seq, embed]``.
* ``__call__``: both, with ``attention_fn`` (default :func:`jaxsys.ops.attention`) in between,
  or, given a cache (``jaxsys.decoding.cache``), the cache's own write and attention.

``attention_fn`` has the signature of ``jaxsys.ops.attention`` (q, k, v, mask=, segment_ids=,
scale=, q_offset=, kv_lengths=); only non-None keywords are passed, so a sequence-parallel
attention without cache support can be dropped in (``functools.partial(fn, mesh=...)``).

A cached call of a few queries (decode, a speculative tree) goes through the same
``jaxsys.ops.attention``; its dispatcher serves it with the short-query ``"xla_decode"``
implementation (no copy of the cache per layer per step) where that applies.

GQA (Ainslie et al., 2023): query head h reads kv head ``h // (heads // kv_heads)``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax.numpy as jnp
from flax import nnx

from jaxsys.nn.explicit import explicit_ok
from jaxsys.core.errors import ConfigError, ShapeError
from jaxsys.nn.layers import DecodeWeight, constrain, param
from jaxsys.nn.rope import RopeConfig, apply_rope
from jaxsys.ops import masks

__all__ = ["Attention", "default_attention_fn"]


def default_attention_fn(impl: str = "auto") -> Callable:
  from jaxsys.ops.attn import attention
  return functools.partial(attention, impl=impl)


class Attention(nnx.Module):
  """Causal (optionally sliding-window) grouped-query self-attention with RoPE.

  ``x [..., seq, dim]``, ``positions int[..., seq]`` -> ``[..., seq, dim]`` in ``dtype`` (any
  number of leading batch axes without a cache; ``[batch, seq, dim]`` with one). Parameters
  ``wq [dim, heads, head_dim]``, ``wk, wv [dim, kv_heads, head_dim]``, ``wo [heads, head_dim,
  dim]`` (logical ``embed`` / ``heads`` / ``kv_heads`` / ``head_dim``) in ``param_dtype``, with
  optional biases ``bq, bk, bv`` (``qkv_bias``, Qwen2) and ``bo``.

  Example::

    attn = Attention(64, heads=4, kv_heads=2, head_dim=16, rope=RopeConfig(), rngs=nnx.Rngs(0))
    x = jnp.ones((2, 8, 64))
    pos = jnp.broadcast_to(jnp.arange(8), (2, 8))
    y, _ = attn(x, pos)                       # [2, 8, 64]
  """

  def __init__(self, dim: int, heads: int, kv_heads: int, head_dim: int, *,
               rope: RopeConfig, qkv_bias: bool = False, o_bias: bool = False,
               sliding_window: int | None = None, attention_fn: Callable | None = None,
               dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs):
    if heads % kv_heads:
      raise ConfigError(f"{heads=} must be divisible by {kv_heads=}")
    if sliding_window is not None and sliding_window < 1:
      raise ConfigError(f"{sliding_window=} must be >= 1 or None")
    self.dim, self.heads, self.kv_heads, self.head_dim = dim, heads, kv_heads, head_dim
    self.rope, self.sliding_window, self.dtype = rope, sliding_window, dtype
    self.attention_fn = attention_fn or default_attention_fn()
    p = functools.partial(param, rngs, dtype=param_dtype)
    self.wq = p((dim, heads, head_dim), ("embed", "heads", "head_dim"))
    self.wk = p((dim, kv_heads, head_dim), ("embed", "kv_heads", "head_dim"))
    self.wv = p((dim, kv_heads, head_dim), ("embed", "kv_heads", "head_dim"))
    self.wo = p((heads, head_dim, dim), ("heads", "head_dim", "embed"))
    if qkv_bias:
      self.bq = p((heads, head_dim), ("heads", "head_dim"), init="zeros")
      self.bk = p((kv_heads, head_dim), ("kv_heads", "head_dim"), init="zeros")
      self.bv = p((kv_heads, head_dim), ("kv_heads", "head_dim"), init="zeros")
    else:
      self.bq = self.bk = self.bv = None
    self.bo = p((dim,), ("embed",), init="zeros") if o_bias else None
    # decode storage (see pack): q|k|v fused into one [embed, (heads + 2 kv_heads) head_dim] map
    self.packed_qkv: DecodeWeight | None = None
    self.packed_o: DecodeWeight | None = None

  def pack(self, fmt: str):
    """Replaces wq/wk/wv/wo by :class:`DecodeWeight` s: one fused qkv read per step (three small
    gemvs cost more than one; each call has a fixed overhead on CPU)."""
    d = self.dim
    qkv = jnp.concatenate([self.wq[...].reshape(d, -1), self.wk[...].reshape(d, -1),
                           self.wv[...].reshape(d, -1)], axis=1)
    self.packed_qkv = nnx.data(DecodeWeight(qkv, fmt, logical=("embed", "heads")))
    self.packed_o = nnx.data(DecodeWeight(self.wo[...].reshape(-1, d), fmt,
                                             logical=("heads", "embed")))
    self.wq = self.wk = self.wv = self.wo = None

  @property
  def mask(self) -> masks.Mask:
    """Causal, or ``Local(sliding_window)`` (which is causal within the window)."""
    return masks.Causal() if self.sliding_window is None else masks.Local(self.sliding_window)

  def _proj(self, x, w, b):
    y = jnp.einsum("bsd,dhk->bshk", x, w[...].astype(self.dtype))  # [batch, seq, heads, head_dim]
    return y if b is None else y + b[...].astype(self.dtype)

  def project_qkv(self, x, positions):
    """``x [batch, seq, embed]``, ``positions int[batch, seq]`` -> q, k, v after RoPE."""
    if x.ndim != 3 or x.shape[-1] != self.dim:
      raise ShapeError(f"x must be [batch, seq, {self.dim}], got shape {x.shape}")
    x = x.astype(self.dtype)
    if self.packed_qkv is not None:
      q, k, v = self._packed_qkv(x)
    else:
      q = self._proj(x, self.wq, self.bq)
      k = self._proj(x, self.wk, self.bk)
      v = self._proj(x, self.wv, self.bv)
    q, k = apply_rope(q, positions, self.rope), apply_rope(k, positions, self.rope)
    q = constrain(q, ("batch", "seq", "heads", "head_dim"))
    k = constrain(k, ("batch", "seq", "kv_heads", "head_dim"))
    v = constrain(v, ("batch", "seq", "kv_heads", "head_dim"))
    return q, k, v

  def _packed_qkv(self, x):
    b, s = x.shape[:2]
    hd, nq, nk = self.head_dim, self.heads * self.head_dim, self.kv_heads * self.head_dim
    y = self.packed_qkv(x).astype(self.dtype)                       # [batch, seq, nq + 2 nk]
    q = y[..., :nq].reshape(b, s, self.heads, hd)
    k = y[..., nq:nq + nk].reshape(b, s, self.kv_heads, hd)
    v = y[..., nq + nk:].reshape(b, s, self.kv_heads, hd)
    add = lambda t, bias: t if bias is None else t + bias[...].astype(self.dtype)
    return add(q, self.bq), add(k, self.bk), add(v, self.bv)

  def project_out(self, o):
    """``o [batch, seq, heads, head_dim] -> [batch, seq, embed]``."""
    if self.packed_o is not None:
      b, s = o.shape[:2]
      out = self.packed_o(o.reshape(b, s, -1).astype(self.dtype)).astype(self.dtype)
    else:
      out = jnp.einsum("bshk,hkd->bsd", o.astype(self.dtype), self.wo[...].astype(self.dtype))
    if self.bo is not None:
      out = out + self.bo[...].astype(self.dtype)
    return constrain(out, ("batch", "seq", "embed"))

  def attend(self, q, k, v, *, extra_mask: masks.Mask | None = None, **kwargs):
    """Calls ``attention_fn`` with this layer's mask (AND ``extra_mask``), dropping None keywords."""
    kwargs = {k_: v_ for k_, v_ in kwargs.items() if v_ is not None}
    mask = self.mask if extra_mask is None else self.mask & extra_mask
    return self.attention_fn(q, k, v, mask=mask, **kwargs)

  @explicit_ok
  def __call__(self, x, positions, *, mask=None, segment_ids=None, cache=None, layer: int = 0):
    """``out [..., seq, dim]``, or ``(out, cache)`` when a cache is passed in.

    Without a cache, ``attention_fn`` runs over this call's tokens with the layer's mask
    (causal or sliding window) AND'ed with ``mask``: a lazy ``jaxsys.ops.masks.Mask``, or a
    dense array ``[..., heads|1, seq, seq]`` (leading axes as x's, or 1) -- boolean (True:
    visible) or additive (added to the logits, as ``jaxsys.ops.attention``'s ``bias``).
    With a cache (see ``jaxsys.decoding.cache``), the cache writes this layer's new keys/values
    where it keeps them and computes the attention: ``cache.attend(layer, self, q, k, v)``.
    """
    if cache is not None:
      if segment_ids is not None or mask is not None:
        raise NotImplementedError("segment_ids or a per-call mask with a KV cache are not "
                                  "supported; pack without a cache")
      q, k, v = self.project_qkv(x, positions)
      o, cache = cache.attend(layer, self, q, k, v)
      return self.project_out(o), cache
    if x.ndim < 2:
      raise ShapeError(f"x must be [..., seq, {self.dim}], got shape {x.shape}")
    lead, seq = x.shape[:-2], x.shape[-2]
    bias = None
    if mask is not None and not isinstance(mask, masks.Mask):
      mask = jnp.asarray(mask)
      if mask.ndim != len(lead) + 3:
        raise ShapeError(f"mask must be a Mask or an array [..., heads|1, seq, seq] with the "
                         f"leading axes {lead} (or 1), got shape {mask.shape}")
      mask = jnp.broadcast_to(mask, (*lead, *mask.shape[-3:])).reshape(-1, *mask.shape[-3:])
      # boolean visibility becomes an additive 0 / -inf term beside the layer's lazy mask
      bias = jnp.where(mask, 0.0, -jnp.inf) if mask.dtype == jnp.bool_ else mask
      mask = None
    flat = lambda t: None if t is None else jnp.reshape(t, (-1, seq))  # noqa: E731
    q, k, v = self.project_qkv(x.reshape(-1, seq, x.shape[-1]), flat(positions))
    o = self.attend(q, k, v, segment_ids=flat(segment_ids), bias=bias, extra_mask=mask)
    return self.project_out(o).reshape(*lead, seq, self.dim)
