"""Tree-masked forward passes over a contiguous KV cache, and cache commit/rollback.

``target_tree_forward`` runs the target (``Decoder.forward_hidden``) and ``drafter_forward`` the
drafter's block on ``T`` new tokens per sequence through a ``jaxsys.decoding.cache.TreeCache``: they
are written to cache rows ``write_start + arange(T)`` and attend to the cache prefix
``< prefix_len`` plus the tree rows their ``vis`` allows (``TreeMask``, one mask per sequence
through ``jax.vmap``). With an ancestor matrix this is SpecInfer tree attention.

``commit`` keeps the accepted path: cache rows ``L + path[i]`` move to ``L + i`` and the length
becomes ``L + n_accepted + 1``; rows beyond are stale and invisible (rolled back).
"""

from __future__ import annotations

import jax.numpy as jnp

from jaxsys.core.errors import ConfigError
from jaxsys.decoding.cache import KVCache, TreeCache

__all__ = ["commit", "compact_rows", "drafter_forward", "target_tree_forward"]


def drafter_forward(drafter, x, positions, dk, dv, *, vis, prefix_len, write_start,
                    tree_start=None, impl="auto"):
  """The drafter's block over tree tokens (``jaxsys.decoding.cache.TreeCache`` over its cache).

  Args:
    drafter: an ``EagleDrafter`` (its one ``DecoderLayer`` is ``drafter.layer``).
    x: ``[b, T, embed]`` inputs; positions ``int[b, T]`` (RoPE).
    dk, dv: the drafter cache ``[b, S, kv_heads, head_dim]``.
    vis: ``bool[b, T, K]`` visibility among the rows ``tree_start .. tree_start+K-1``.
    prefix_len: ``int[b]`` cache rows every token sees.
    write_start: ``int[b]`` first cache row of the new tokens.
    tree_start: ``int[b]`` cache row of ``vis`` column 0 (default ``write_start``).
  Returns ``(out [b, T, embed], dk, dv)``.
  """
  kv = KVCache((dk,), (dv,), write_start)
  view = TreeCache.over(kv, vis, write_start, prefix_len=prefix_len, tree_start=tree_start,
                        impl=impl)
  out, view = drafter.layer(x, positions, cache=view, layer=0)
  return out, view.kv.k[0], view.kv.v[0]


def target_tree_forward(model, cache, tokens, positions, vis, start=None):
  """The target over tree tokens placed at rows ``start + arange(T)`` (default ``cache.lengths``),
  seeing rows ``< start`` and the tree rows ``vis`` allows.

  Returns ``(logits float32 [b, T, vocab], hidden [b, T, embed], cache)``; the returned cache
  holds the tree's keys/values but keeps ``lengths`` (``commit`` decides what stays).
  """
  if model.config.sliding_window is not None:
    raise ConfigError("speculative verification needs full-attention layers (sliding_window=None)")
  view = TreeCache.over(cache, vis, start, impl=model.config.attention_impl)
  h, view = model.forward_hidden(tokens, positions=positions, cache=view)
  return model.logits(h), h, view.kv


def compact_rows(cache, start, path, n_keep):
  """Moves rows ``start + path[i]`` to ``start + i`` for ``i < n_keep`` (``path int[b, P]``)."""
  b, p = path.shape
  bidx = jnp.arange(b)[:, None]
  src = start[:, None] + jnp.maximum(path, 0)
  dst = start[:, None] + jnp.arange(p, dtype=jnp.int32)
  dst = jnp.where(jnp.arange(p)[None] < n_keep[:, None], dst, cache.shape[1])  # dropped
  return cache.at[bidx, dst].set(cache[bidx, src], mode="drop")


def commit(cache, path, n_accepted, active=None):
  """Keeps root + accepted path (``n_accepted + 1`` rows); inactive rows keep their length."""
  n_keep = n_accepted + 1
  if active is not None:
    n_keep = jnp.where(active, n_keep, 0)
  start = cache.lengths
  ks = tuple(compact_rows(k, start, path, n_keep) for k in cache.k)
  vs = tuple(compact_rows(v, start, path, n_keep) for v in cache.v)
  return cache.replace(k=ks, v=vs, lengths=start + n_keep)
