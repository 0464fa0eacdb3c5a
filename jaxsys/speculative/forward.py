"""Tree-masked forward passes over a contiguous KV cache, and cache commit/rollback.

``layer_tree_forward`` runs one pre-norm decoder block (``jaxsys.models.DecoderLayer``) on ``T``
new tokens per sequence that are written to cache rows ``write_start + arange(T)`` and attend to
the cache prefix ``< prefix_len`` plus the tree rows their ``vis`` allows (``TreeMask``, one mask
per sequence through ``jax.vmap``). With ``vis`` lower-triangular this is ordinary causal
decoding of ``T`` tokens; with an ancestor matrix it is SpecInfer tree attention.

``commit`` keeps the accepted path: cache rows ``L + path[i]`` move to ``L + i`` and the length
becomes ``L + n_accepted + 1``; rows beyond are stale and invisible (rolled back).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxsys.core.errors import ConfigError
from jaxsys.ops import attention
from jaxsys.speculative.tree import TreeMask


def _tree_attention(q, k, v, vis, prefix_len, tree_start, impl):
  """Per-sequence masks: q [b, T, h, d]; k/v [b, S, kv, d]; vis [b, T, K]; prefix/start int[b]."""
  def one(qq, kk, vv, vs, pl, ts):
    mask = TreeMask(vs, pl, ts)
    return attention(qq[None], kk[None], vv[None], mask=mask, impl=impl)[0]
  return jax.vmap(one)(q, k, v, vis, prefix_len, tree_start)  # [b, T, heads, dim]


def write_rows(cache, new, start):
  """Writes ``new [b, T, ...]`` into ``cache [b, S, ...]`` at rows ``start[b] + arange(T)``."""
  b, t = new.shape[:2]
  rows = start[:, None] + jnp.arange(t, dtype=jnp.int32)  # [b, T]
  return cache.at[jnp.arange(b)[:, None], rows].set(new.astype(cache.dtype), mode="drop")


def layer_tree_forward(layer, x, positions, k_cache, v_cache, *, vis, prefix_len, write_start,
                       tree_start=None, impl="auto"):
  """One decoder block over tree tokens.

  Args:
    layer: a ``DecoderLayer`` (attn_norm, attn, mlp_norm, mlp).
    x: ``[b, T, embed]`` inputs; positions ``int[b, T]`` (RoPE).
    k_cache, v_cache: ``[b, S, kv_heads, head_dim]``.
    vis: ``bool[b, T, K]`` visibility among the rows ``write_start .. write_start+K-1``.
    prefix_len: ``int[b]`` cache rows every token sees.
    write_start: ``int[b]`` first cache row of the new tokens.
    tree_start: ``int[b]`` cache row of ``vis`` column 0 (default ``write_start``).
  Returns ``(out [b, T, embed], k_cache, v_cache)``.
  """
  if getattr(layer.attn, "sliding_window", None) is not None:
    raise NotImplementedError("tree attention over sliding-window layers is not supported")
  q, k, v = layer.attn.project_qkv(layer.attn_norm(x), positions)
  k_cache = write_rows(k_cache, k, write_start)
  v_cache = write_rows(v_cache, v, write_start)
  tree_start = write_start if tree_start is None else tree_start
  o = _tree_attention(q, k_cache.astype(q.dtype), v_cache.astype(q.dtype), vis, prefix_len,
                      tree_start, impl)
  h = x + layer.attn.project_out(o)
  return h + layer.mlp(layer.mlp_norm(h)), k_cache, v_cache


UNROLL_MAX_LAYERS = 8


def stack_layers(model):
  """``(layer_graphdef, stacked_state)``: the blocks' states stacked on a leading axis so that
  the target runs as one ``lax.scan`` (one compiled block instead of ``num_layers`` copies)."""
  gdefs, states = zip(*(nnx.split(layer) for layer in model.layers))
  if any(g != gdefs[0] for g in gdefs[1:]):
    return None, None
  return gdefs[0], jax.tree.map(lambda *xs: jnp.stack(xs), *states)


def target_tree_forward(model, cache, tokens, positions, vis, start=None):
  """The target over tree tokens placed at rows ``start + arange(T)`` (default ``cache.lengths``),
  seeing rows ``< start`` and the tree rows ``vis`` allows.

  Returns ``(logits float32 [b, T, vocab], hidden [b, T, embed], cache)``; the returned cache
  holds the tree's keys/values but keeps ``lengths`` (``commit`` decides what stays).
  """
  if model.config.sliding_window is not None:
    raise ConfigError("speculative verification needs full-attention layers (sliding_window=None)")
  x = model.embed(tokens)
  start = cache.lengths if start is None else start
  impl = model.config.attention_impl
  kw = dict(vis=vis, prefix_len=start, write_start=start, impl=impl)
  # A scan over stacked blocks compiles one block, but stacking the per-layer caches copies the
  # whole KV cache in and out on every call, which dominates a decode step of a small model;
  # shallow targets are unrolled instead.
  gdef, stacked = (None, None) if len(model.layers) <= UNROLL_MAX_LAYERS else stack_layers(model)
  if gdef is None:  # shallow, or heterogeneous blocks: unrolled
    ks, vs = [], []
    for i, layer in enumerate(model.layers):
      x, kc, vc = layer_tree_forward(layer, x, positions, cache.k[i], cache.v[i], **kw)
      ks.append(kc)
      vs.append(vc)
  else:
    def body(h, inp):
      st, kc, vc = inp
      h, kc, vc = layer_tree_forward(nnx.merge(gdef, st), h, positions, kc, vc, **kw)
      return h, (kc, vc)
    x, (k_all, v_all) = jax.lax.scan(body, x, (stacked, jnp.stack(cache.k), jnp.stack(cache.v)))
    ks, vs = list(k_all), list(v_all)
  h = model.final_norm(x)
  return model.logits(h), h, cache.replace(k=tuple(ks), v=tuple(vs))


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
