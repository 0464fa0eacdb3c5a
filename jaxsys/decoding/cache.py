"""The cache protocol: how a decoder block reads and writes its attention state.

``Decoder.forward_hidden`` is the only loop over the blocks. It threads one *cache* object
through them; each ``Attention`` layer hands its projected ``q, k, v`` to the cache, which
writes the new keys/values where it keeps them and returns the attention output (Levanter's
``KvPageCache.update``, Gemma's per-layer cache). A cache is a pytree (it crosses ``jax.jit``
and ``lax.while_loop``) with:

* ``lengths``: ``int32[batch]`` tokens already held per row, or ``None``. The model's default
  positions are ``lengths + arange(seq)`` (``arange(seq)`` for ``None``).
* ``attend(layer, attn, q, k, v) -> (o, cache)``: ``q [batch, seq, heads, head_dim]``,
  ``k, v [batch, seq, kv_heads, head_dim]`` (after RoPE) -> ``o [batch, seq, heads, head_dim]``
  and the cache with layer ``layer``'s state updated. ``attn`` is the calling
  :class:`jaxsys.nn.attention.Attention` (its mask, sliding window and attention hook).
* ``advance(seq) -> cache``: called once after the last block of a forward over ``seq`` tokens.

Implementations:

* :class:`KVCache` (here): contiguous ``[batch, max_len, kv_heads, head_dim]`` buffers per layer,
  the cache of ``generate`` and of the rollout engine.
* :class:`TreeCache` (here): a view of a :class:`KVCache` for speculative verification: the new
  tokens are written at ``write_start + arange(T)`` and see the committed prefix plus the rows
  their ancestor matrix allows (SpecInfer tree attention); ``advance`` keeps the lengths (the
  accepted path is committed afterwards).
* ``jaxsys.serving.paged_views``: the paged cache with LServe's two pools, for chunked hybrid
  prefill (``PagedPrefill``) and page-selected decode (``PagedDecode``).
* ``jaxsys.serving.streaming.GateMix``: no storage; DuoAttention's per-head mix of full and
  streaming attention, for learning the gates.

Usage::

  cache = KVCache.init(model.config, batch=2, max_len=128)
  out = model(prompt_tokens, cache=cache)          # DecoderOutput(logits, cache, hidden)
  cache = out.cache.with_lengths(true_prompt_lengths)
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from jaxsys.core.errors import ConfigError, ShapeError
# re-exported: the queries per row up to which attention's "xla_decode" path serves a cached call
# (decode steps, draft verification); longer ones (chunked prefill) take the blockwise path
from jaxsys.ops.attn.decode import DECODE_MAX_Q  # noqa: F401

__all__ = ["DECODE_MAX_Q", "KVCache", "Prefill", "replace_at", "TreeCache", "write_rows"]



def write_rows(buf, new, start):
  """Writes ``new [b, T, ...]`` into ``buf [b, S, ...]`` at rows ``start[b] + arange(T)``
  (rows past ``S`` are dropped; in place when ``buf`` is donated)."""
  b, t = new.shape[:2]
  rows = start[:, None] + jnp.arange(t, dtype=jnp.int32)  # [b, T]
  return buf.at[jnp.arange(b)[:, None], rows].set(new.astype(buf.dtype), mode="drop")


def replace_at(items: tuple, i: int, new) -> tuple:
  """``items`` with entry ``i`` replaced (per-layer state kept as tuples inside caches)."""
  return items[:i] + (new,) + items[i + 1:]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
  """Contiguous KV cache: row ``b`` holds its tokens at indices ``0 .. lengths[b]-1``.

  A forward over ``seq`` tokens writes their keys/values at ``lengths + arange(seq)`` with a
  scatter that XLA performs in place when the cache is donated, attends over rows
  ``< lengths + seq`` with the layer's mask at absolute offsets, and returns the cache with
  ``lengths + seq``. Right-padded prompts: prefill the padded batch, then ``with_lengths``.
  """
  k: tuple[Any, ...]   # per layer [batch, max_len, kv_heads, head_dim]
  v: tuple[Any, ...]
  lengths: Any         # int32[batch]

  @classmethod
  def init(cls, config, batch: int, max_len: int, dtype=None) -> "KVCache":
    """Zeros for ``config`` (a DecoderConfig); ``dtype`` defaults to the activation dtype."""
    if batch < 1 or max_len < 1:
      raise ConfigError(f"{batch=} and {max_len=} must be >= 1")
    dtype = jnp.dtype(dtype or config.dtype)
    shape = (batch, max_len, config.num_kv_heads, config.head_dim)
    zeros = tuple(jnp.zeros(shape, dtype) for _ in range(config.num_layers))
    zeros_v = tuple(jnp.zeros(shape, dtype) for _ in range(config.num_layers))
    return cls(zeros, zeros_v, jnp.zeros((batch,), jnp.int32))

  @property
  def batch(self) -> int:
    return self.k[0].shape[0]

  @property
  def max_len(self) -> int:
    return self.k[0].shape[1]

  @property
  def num_layers(self) -> int:
    return len(self.k)

  def replace(self, **changes) -> "KVCache":
    return dataclasses.replace(self, **changes)

  def with_lengths(self, lengths) -> "KVCache":
    """Sets the valid length of every row (e.g. true prompt lengths after a padded prefill)."""
    lengths = jnp.asarray(lengths, jnp.int32)
    if lengths.shape != (self.batch,):
      raise ShapeError(f"lengths must be int[batch={self.batch}], got shape {lengths.shape}")
    return self.replace(lengths=lengths)

  def repeat(self, group: int) -> "KVCache":
    """Each row repeated ``group`` times (row ``i * group + j``): ``group`` continuations of one
    prefilled prompt share its keys/values (the copies then diverge as they decode)."""
    if group < 1:
      raise ConfigError(f"{group=} must be >= 1")
    rep = lambda x: jnp.repeat(x, group, axis=0)  # noqa: E731
    return self.replace(k=tuple(map(rep, self.k)), v=tuple(map(rep, self.v)), lengths=rep(self.lengths))

  def nbytes(self) -> int:
    return sum(x.size * x.dtype.itemsize for x in self.k + self.v)

  def check_layers(self, num_layers: int) -> None:
    if len(self.k) != num_layers:
      raise ShapeError(f"cache has {len(self.k)} layers but the model has {num_layers}")

  def write(self, layer: int, k, v, start) -> "KVCache":
    """Layer ``layer``'s new ``k, v [b, T, kv_heads, head_dim]`` at rows ``start[b] + arange(T)``."""
    return self.replace(k=replace_at(self.k, layer, write_rows(self.k[layer], k, start)),
                        v=replace_at(self.v, layer, write_rows(self.v[layer], v, start)))

  def layer_as(self, layer: int, dtype):
    """Layer ``layer``'s ``(keys, values)`` in the compute ``dtype``."""
    return self.k[layer].astype(dtype), self.v[layer].astype(dtype)

  # -- the protocol ---------------------------------------------------------------------------
  def attend(self, layer: int, attn, q, k, v):
    s = q.shape[1]
    new = self.write(layer, k, v, self.lengths)
    kc, vc = new.layer_as(layer, q.dtype)
    # a decode step's few queries: the dispatcher picks the short-query path ("xla_decode")
    o = attn.attend(q, kc, vc, q_offset=self.lengths, kv_lengths=self.lengths + s)
    return o, new

  def advance(self, seq: int) -> "KVCache":
    return self.replace(lengths=self.lengths + seq)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TreeCache:
  """A :class:`KVCache` seen by ``T`` tree tokens per row (speculative verification, drafting).

  Token ``i`` of row ``b`` is written at cache row ``write_start[b] + i`` and sees the rows
  ``< prefix_len[b]`` plus the rows ``tree_start[b] + j`` with ``vis[b, i, j]``
  (``jaxsys.speculative.tree.TreeMask``). With ``vis`` lower-triangular this is causal decoding
  of ``T`` tokens; with an ancestor matrix it is tree attention. ``lengths`` (the model's
  default positions) are ``write_start``; ``advance`` leaves the cache's lengths alone.
  """
  kv: KVCache
  vis: Any           # bool[b, T, K]
  prefix_len: Any    # int32[b]
  write_start: Any   # int32[b]
  tree_start: Any    # int32[b]
  impl: str = dataclasses.field(default="auto", metadata=dict(static=True))

  @classmethod
  def over(cls, kv: KVCache, vis, start=None, *, prefix_len=None, tree_start=None,
           impl: str = "auto") -> "TreeCache":
    """Tree tokens at rows ``start + arange(T)`` (default ``kv.lengths``) seeing rows ``< start``
    (or ``< prefix_len``) and the tree rows from ``tree_start`` (default ``start``)."""
    start = kv.lengths if start is None else start
    return cls(kv, vis, start if prefix_len is None else prefix_len, start,
               start if tree_start is None else tree_start, impl)

  @property
  def lengths(self):
    return self.write_start

  def check_layers(self, num_layers: int) -> None:
    self.kv.check_layers(num_layers)

  def attend(self, layer: int, attn, q, k, v):
    from jaxsys.ops import attention
    from jaxsys.ops.masks import TreeMask
    if attn.sliding_window is not None:
      raise NotImplementedError("tree attention over sliding-window layers is not supported")
    kv = self.kv.write(layer, k, v, self.write_start)
    kc, vc = kv.layer_as(layer, q.dtype)
    # A verify or draft step has a few tree tokens: with impl="auto" the dispatcher serves them
    # with the short-query path, which reads the cache in place (the blockwise GQA layout copied
    # the cache per layer: a SmolLM2 step at batch 8 took 54 ms against the decoding core's 32).

    def one(qq, kk, vv, vs, pl, ts):  # one TreeMask per sequence
      mask = TreeMask(vs, pl, ts)
      return attention(qq[None], kk[None], vv[None], mask=mask, impl=self.impl)[0]

    o = jax.vmap(one)(q, kc, vc, self.vis, self.prefix_len, self.tree_start)  # [b, T, heads, d]
    return o, dataclasses.replace(self, kv=kv)

  def advance(self, seq: int) -> "TreeCache":
    return self


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Prefill:
  """An empty :class:`KVCache` being filled by a (right-padded) prompt batch.

  The prompt's keys/values go to rows ``0 .. seq-1`` and each layer attends over the prompt
  alone with its own mask at the static offset 0, so the attention layout skips every block the
  mask never sees (above the causal diagonal, outside a sliding window). Padding past a row's
  length is written but never seen by that row's valid tokens (causal); set the true lengths
  afterwards (``advance`` returns the filled :class:`KVCache` with ``lengths = seq``).
  """
  kv: KVCache

  lengths = None  # positions arange(seq)

  def check_layers(self, num_layers: int) -> None:
    self.kv.check_layers(num_layers)

  def attend(self, layer: int, attn, q, k, v):
    s = q.shape[1]
    if s > self.kv.max_len:
      raise ShapeError(f"prompt of {s} tokens does not fit the cache (max_len={self.kv.max_len})")
    k_cache = jax.lax.dynamic_update_slice_in_dim(self.kv.k[layer], k.astype(self.kv.k[layer].dtype), 0, 1)
    v_cache = jax.lax.dynamic_update_slice_in_dim(self.kv.v[layer], v.astype(self.kv.v[layer].dtype), 0, 1)
    o = attn.attend(q, k_cache[:, :s].astype(q.dtype), v_cache[:, :s].astype(q.dtype))
    kv = self.kv.replace(k=replace_at(self.kv.k, layer, k_cache),
                         v=replace_at(self.kv.v, layer, v_cache))
    return o, dataclasses.replace(self, kv=kv)

  def advance(self, seq: int) -> KVCache:
    return self.kv.replace(lengths=jnp.full_like(self.kv.lengths, seq))
