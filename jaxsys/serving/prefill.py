"""Prefill with hybrid attention: one block-sparse attention call per layer with a per-head mask.

Retrieval heads attend densely (``Causal``, optionally intersected with a static block-sparse
layout); streaming heads attend to ``Sink(sink) | Local(window)`` (LServe section 3: unified
block-sparse prefill): one call of ``jaxsys.ops.attention`` with a ``MultiHead`` mask, which the
op splits into one block-sparse call per head group (retrieval heads, streaming heads), so each
group skips every block it never sees. The keys and
values are written to the paged cache as they are produced (retrieval pool with page
statistics; streaming pool keeps only the sink and the last window).

Very long prompts run in chunks of ``chunk`` tokens: chunk ``c`` attends to the prompt prefix
``[0, (c + 1) * chunk)`` with ``q_offset = c * chunk``, bounding activation memory by the chunk.

The step-level engine prefills one chunk per call instead (:func:`prefill_chunk`): the chunk at
a traced offset reads the prefix written by earlier steps (or shared by the prefix cache) back
from the request's pages (``paged_views.PagedChunk``), so a long prompt advances between decode
steps of the other requests.

Usage::

  st, hidden = prefill(model, cache_cfg, st, tokens, length, block_table, stream_table, chunk=4096)
  st, hidden = prefill_chunk(graphdef, params, cache_cfg, st, tokens, offset, n, block_table,
                             stream_table)                           # hidden of the chunk's last token
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxsys.core.errors import ConfigError
from jaxsys.ops import attention, masks
from jaxsys.serving.paged_cache import PagedCacheConfig
from jaxsys.serving.paged_views import PagedChunk, PagedPrefill

__all__ = ["check_model", "dense_tail", "hybrid_attention", "layer_mask", "prefill", "prefill_chunk"]


def layer_mask(c: PagedCacheConfig, layer: int, num_heads: int,
               retrieval_mask: masks.Mask | None = None) -> masks.Mask:
  """Per-head prefill mask of a layer: Causal (retrieval) / Sink | Local (streaming)."""
  flags = c.streaming_flags()[layer]
  dense = masks.Causal() if retrieval_mask is None else masks.Causal() & retrieval_mask
  if not flags.any():
    return dense
  g = num_heads // c.num_kv_heads
  sink, window = c.prefill_span
  stream = masks.Sink(sink) | masks.Local(window)
  return masks.MultiHead([stream if flags[h // g] else dense for h in range(num_heads)])


def hybrid_attention(c: PagedCacheConfig, layer: int, q, k, v, *, q_offset, kv_lengths,
                     retrieval_mask=None, impl: str = "auto"):
  """Prefill attention of a layer: ``q [b, t, heads, d]``, ``k, v [b, s, kv_heads, d]``."""
  mask = layer_mask(c, layer, q.shape[2], retrieval_mask)
  return attention(q, k, v, mask=mask, q_offset=q_offset, kv_lengths=kv_lengths, impl=impl)


def dense_tail(c: PagedCacheConfig, layer: int, o, q, k, v, positions, kv_lengths, *,
               impl: str = "auto"):
  """Recomputes the streaming heads' rows of the last ``c.prefill_dense_tail`` prompt tokens
  with causal (dense) attention over the whole prefix.

  The hybrid prefill gives a streaming head only ``Sink | Local`` at every query; at the end of
  the prompt (the question), whose states decide the first answer token, that loses what the
  head reads from far back. The tail costs ``tail x prompt`` scores per streaming head, against
  the ``prompt x (sink + window)`` of the band. The keys and values written to the cache are
  unchanged: decode reads what the streaming pool keeps.

  Shapes: ``o, q [b, t, heads, d]`` (the chunk's output and queries), ``k, v [b, s, kv_heads,
  d]`` (the prefix up to the chunk's end), ``positions int[b, t]`` (absolute), ``kv_lengths
  int[b]`` (prompt lengths). Returns ``o`` with the tail rows of the streaming heads replaced.
  """
  kv_heads = c.streaming_heads(layer)
  if c.prefill_dense_tail == 0 or len(kv_heads) == 0:
    return o
  b, t, heads, _ = q.shape
  g = heads // c.num_kv_heads
  q_heads = (kv_heads[:, None] * g + np.arange(g)[None]).reshape(-1)       # streaming query heads
  n = min(c.prefill_dense_tail, t)
  # The n chunk rows that hold the tail's part in this chunk (clipped into the chunk); rows
  # outside the tail keep their hybrid output (row_ok).
  start = jnp.clip(kv_lengths - c.prefill_dense_tail - positions[:, 0], 0, t - n)    # [b]
  rows = start[:, None] + jnp.arange(n, dtype=jnp.int32)[None]                       # [b, n]
  pos = jnp.take_along_axis(positions, rows, axis=1)                                 # [b, n]
  row_ok = (pos >= kv_lengths[:, None] - c.prefill_dense_tail) & (pos < kv_lengths[:, None])
  qt = jnp.take_along_axis(q[:, :, q_heads], rows[:, :, None, None], axis=1)         # [b, n, hs, d]
  ot = attention(qt, k[:, :, kv_heads], v[:, :, kv_heads], mask=masks.Causal(), q_offset=pos[:, 0],
                 kv_lengths=kv_lengths, impl=impl)                                   # [b, n, hs, d]
  old = jnp.take_along_axis(o[:, :, q_heads], rows[:, :, None, None], axis=1)
  new = jnp.where(row_ok[:, :, None, None], ot.astype(o.dtype), old)
  bi = jnp.arange(b)[:, None, None]
  return o.at[bi, rows[:, :, None], q_heads[None, None]].set(new)


def check_model(model, c: PagedCacheConfig):
  mc = model.config
  if (mc.num_layers, mc.num_kv_heads, mc.head_dim) != (c.num_layers, c.num_kv_heads, c.head_dim):
    raise ConfigError(f"cache (num_layers={c.num_layers}, num_kv_heads={c.num_kv_heads}, "
                      f"head_dim={c.head_dim}) does not match the model "
                      f"({mc.num_layers}, {mc.num_kv_heads}, {mc.head_dim})")
  for i in range(mc.num_layers):
    if mc.window(i) is not None:
      raise NotImplementedError(f"layer {i} uses a sliding window; LServe serving assumes full attention")


def prefill(model, c: PagedCacheConfig, st, tokens, length, block_table, stream_table, *,
            chunk: int | None = None, retrieval_mask=None,
            impl: str = "auto"):
  """Runs the prompt ``tokens int[1, T]`` (valid ``length``) through the model, filling the cache.

  Returns ``(state, hidden [1, embed])``: the final-norm hidden state of the last prompt token.
  ``T`` must be a multiple of ``chunk`` (default: one chunk).
  """
  t = tokens.shape[1]
  chunk = t if chunk is None else min(chunk, t)
  if chunk < 1 or t % chunk:
    raise ConfigError(f"prompt bucket length {t} must be a multiple of {chunk=}")
  check_model(model, c)
  graphdef, params = nnx.split(model)
  return _prefill(graphdef, params, c, st, tokens, jnp.asarray(length, jnp.int32), block_table,
                  stream_table, chunk, retrieval_mask, impl)


@functools.partial(jax.jit, static_argnums=(0, 2, 8, 9, 10), donate_argnums=(3,))
def _prefill(graphdef, params, c, st, tokens, length, block_table, stream_table, chunk,
             retrieval_mask, impl):
  model = nnx.merge(graphdef, params)
  b, t = tokens.shape
  mc = model.config
  pos_all = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  valid_all = pos_all < length
  kv_len = jnp.broadcast_to(length, (b,))
  kbuf = vbuf = None
  if chunk < t:  # chunk c attends to the prompt prefix [0, (c + 1) chunk): keep its keys
    shape = (b, t, mc.num_kv_heads, mc.head_dim)
    kbuf = tuple(jnp.zeros(shape, mc.jnp_dtype) for _ in range(mc.num_layers))
    vbuf = tuple(jnp.zeros(shape, mc.jnp_dtype) for _ in range(mc.num_layers))
  hidden = []
  for start in range(0, t, chunk):
    end = start + chunk
    pos = pos_all[:, start:end]
    view = PagedPrefill(st, block_table, stream_table, pos, valid_all[:, start:end], kv_len,
                        kbuf, vbuf, config=c, q_offset=start, retrieval_mask=retrieval_mask,
                        impl=impl)
    h, view = model.forward_hidden(tokens[:, start:end], positions=pos, cache=view)
    st, kbuf, vbuf = view.state, view.kbuf, view.vbuf
    hidden.append(h)
  h = jnp.concatenate(hidden, axis=1)  # [b, t, embed] after the final norm
  last = jnp.take_along_axis(h, jnp.broadcast_to(length - 1, (b, 1, 1)), axis=1)[:, 0]
  return st, last


@functools.partial(jax.jit, static_argnums=(0, 2, 9), donate_argnums=(3,))
def prefill_chunk(graphdef, params, c: PagedCacheConfig, st, tokens, offset, n, block_table,
                  stream_table, impl: str = "auto"):
  """``tokens int32[1, chunk]`` (the first ``n`` real) at positions ``offset + arange(chunk)`` into
  the pages of ``block_table int32[1, P]`` (which must cover ``offset + n`` tokens); earlier
  positions must already be in those pages. Returns ``(state, hidden [1, embed])`` of token
  ``offset + n - 1`` (final norm applied). Donates ``st``."""
  model = nnx.merge(graphdef, params)
  t = tokens.shape[1]
  offset = jnp.reshape(offset, (1,)).astype(jnp.int32)
  n = jnp.asarray(n, jnp.int32)
  ar = jnp.arange(t, dtype=jnp.int32)[None, :]
  pos = offset[:, None] + ar
  view = PagedChunk(st, block_table, stream_table, pos, ar < n, offset, offset + n, config=c,
                    impl=impl)
  h, view = model.forward_hidden(tokens, positions=pos, cache=view)
  last = jnp.take_along_axis(h, jnp.broadcast_to(n - 1, (1, 1, 1)), axis=1)[:, 0]
  return view.state, last
