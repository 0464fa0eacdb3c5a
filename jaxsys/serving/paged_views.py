"""The paged KV cache (LServe's retrieval and streaming pools) as caches of the decoding core.

Both views follow the protocol of ``jaxsys.decoding.cache``: ``Decoder.forward_hidden`` runs the
blocks and each attention layer calls ``view.attend(layer, attn, q, k, v)``, which writes the new
keys/values into the pools (``paged_cache.write_tokens``) and computes that layer's attention.

* :class:`PagedPrefill`: a chunk of a prompt (``q_offset`` = the chunk's first position). Its
  attention is the hybrid block-sparse prefill (``prefill.hybrid_attention``: ``Causal`` for
  retrieval heads, ``Sink | Local`` for streaming heads, one ``MultiHead`` call per layer) over
  the prompt prefix so far, which is kept in per-layer contiguous buffers ``kbuf``/``vbuf`` when
  the prompt runs in several chunks (``None`` for a single chunk).
* :class:`PagedChunk`: a chunk of one request's sequence at a traced offset, after earlier chunks
  (or prefix-cache pages) already filled the pages before it; attention reads the prefix back
  from the request's pages. Only for caches without streaming heads (every head keeps every
  token), which is what step-level chunked prefill and prefix caching need.
* :class:`PagedDecode`: one decode token per slot. Retrieval heads read the pages of the
  hierarchical selector (re-selected or reused, ``numbers``), streaming heads sink + local pages
  (``lserve.decode_attention``).

Neither view advances lengths: the engine keeps them on the host (``PagedKVCache.seqs``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from jaxsys.decoding.cache import replace_at
from jaxsys.serving import lserve as lserve_lib
from jaxsys.serving.paged_cache import PagedCacheConfig, read_pages, write_tokens

__all__ = ["PagedChunk", "PagedDecode", "PagedPrefill"]

_static = dict(metadata=dict(static=True))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedPrefill:
  """One prefill chunk of ``[b, chunk]`` tokens at prompt positions ``q_offset + arange(chunk)``."""
  state: Any                # the paged pools (``paged_cache.init_state``)
  block_table: Any          # int32[b, max_pages] retrieval pages per row
  stream_table: Any         # int32[b, stream_pages] streaming pages per row
  positions: Any            # int32[b, chunk] absolute positions of the chunk's tokens
  valid: Any                # bool[b, chunk] token < prompt length (padding is not written)
  kv_lengths: Any           # int32[b] prompt lengths
  kbuf: tuple | None        # per layer [b, T, kv_heads, d] prompt keys so far (None: one chunk)
  vbuf: tuple | None
  config: PagedCacheConfig = dataclasses.field(**_static)
  q_offset: int = dataclasses.field(default=0, **_static)
  retrieval_mask: Any = dataclasses.field(default=None, **_static)
  impl: str = dataclasses.field(default="auto", **_static)

  lengths = None  # positions are always given

  def attend(self, layer: int, attn, q, k, v):
    from jaxsys.serving.prefill import dense_tail, hybrid_attention
    st = write_tokens(self.config, self.state, layer, k, v, self.block_table, self.stream_table,
                      self.positions, self.valid)
    new = dataclasses.replace(self, state=st)
    if self.kbuf is not None:  # keys of the whole prefix so far
      end = self.q_offset + q.shape[1]
      kb = jax.lax.dynamic_update_slice_in_dim(self.kbuf[layer], k.astype(self.kbuf[layer].dtype),
                                               self.q_offset, axis=1)
      vb = jax.lax.dynamic_update_slice_in_dim(self.vbuf[layer], v.astype(self.vbuf[layer].dtype),
                                               self.q_offset, axis=1)
      new = dataclasses.replace(new, kbuf=replace_at(self.kbuf, layer, kb),
                                vbuf=replace_at(self.vbuf, layer, vb))
      k, v = kb[:, :end], vb[:, :end]
    o = hybrid_attention(self.config, layer, q, k, v, q_offset=self.q_offset,
                         kv_lengths=self.kv_lengths, retrieval_mask=self.retrieval_mask,
                         impl=self.impl)
    o = dense_tail(self.config, layer, o, q, k, v, self.positions, self.kv_lengths, impl=self.impl)
    return o, new

  def advance(self, seq: int) -> "PagedPrefill":
    return self


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedChunk:
  """``[1, chunk]`` tokens at positions ``offset + arange(chunk)`` (``valid`` marks real ones)."""
  state: Any
  block_table: Any          # int32[1, P] the request's pages covering [0, offset + chunk)
  stream_table: Any         # int32[1, stream_pages] (unused: no streaming heads)
  positions: Any            # int32[1, chunk]
  valid: Any                # bool[1, chunk]
  offset: Any               # int32[1] position of the chunk's first token
  kv_lengths: Any           # int32[1] offset + valid tokens
  config: PagedCacheConfig = dataclasses.field(**_static)
  impl: str = dataclasses.field(default="auto", **_static)

  lengths = None

  def attend(self, layer: int, attn, q, k, v):
    from jaxsys.ops import attention, masks
    c = self.config
    st = write_tokens(c, self.state, layer, k, v, self.block_table, self.stream_table,
                      self.positions, self.valid)
    n = self.block_table.shape[1]
    # [P, kv_heads, page, d] -> [1, P * page, kv_heads, d]: the request's keys so far, this chunk included
    kp = read_pages(st, "k", layer, self.block_table[0])
    vp = read_pages(st, "v", layer, self.block_table[0])
    kk = jnp.swapaxes(kp, 1, 2).reshape(1, n * c.page_size, kp.shape[1], -1).astype(q.dtype)
    vv = jnp.swapaxes(vp, 1, 2).reshape(1, n * c.page_size, vp.shape[1], -1).astype(q.dtype)
    o = attention(q, kk, vv, mask=masks.Causal(), q_offset=self.offset, kv_lengths=self.kv_lengths,
                  impl=self.impl)
    return o, dataclasses.replace(self, state=st)

  def advance(self, seq: int) -> "PagedChunk":
    return self


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedDecode:
  """One decode token per slot at ``positions int32[slots]``; ``active bool[slots]``."""
  state: Any
  block_table: Any          # int32[slots, max_pages]
  stream_table: Any         # int32[slots, stream_pages]
  positions: Any            # int32[slots] position of the token (= tokens already cached)
  active: Any               # bool[slots]
  numbers: tuple            # per layer: retrieval page selection [slots, r_l, K] or None
  config: PagedCacheConfig = dataclasses.field(**_static)
  selection: Any = dataclasses.field(default=None, **_static)  # page_select.SelectionConfig
  reselect: Any = True      # bool, or traced bool[]: re-select the retrieval pages this step
  impl: str = dataclasses.field(default="auto", **_static)

  lengths = None

  def attend(self, layer: int, attn, q, k, v):
    c = self.config
    st = write_tokens(c, self.state, layer, k, v, self.block_table, self.stream_table,
                      self.positions[:, None], self.active[:, None])
    lengths = jnp.where(self.active, self.positions + 1, 0)
    o, nums = lserve_lib.decode_attention(c, self.selection, st, layer, q[:, 0], self.block_table,
                                          self.stream_table, lengths, self.numbers[layer],
                                          reselect=self.reselect, impl=self.impl)
    return o[:, None], dataclasses.replace(self, state=st,
                                           numbers=replace_at(self.numbers, layer, nums))

  def advance(self, seq: int) -> "PagedDecode":
    return self
