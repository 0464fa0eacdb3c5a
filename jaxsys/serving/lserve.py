"""LServe decode attention of one layer: selected pages for retrieval heads, sink + local pages
for streaming heads, both through the paged-decode op.

Per layer with retrieval kv heads R and streaming kv heads S (query heads follow their kv head):

* retrieval heads: every ``reuse_steps`` steps, score the pages with the hierarchical bound
  (``page_select.page_scores``) and keep the top ``budget / page_size`` pages (newest forced);
  in between, reuse the selection plus the page started since. Dense serving = every page.
* streaming heads: read the request's sink pages and ring of local pages, masked to
  ``Sink(sink) | Local(window)`` by token position.

Attention cost per step is then ``O(|R| * budget + |S| * (sink + window))`` plus the statistics
read (``|R| * context / logical_page_size`` vectors) once per ``reuse_steps`` steps.

Usage (inside a jitted step; ``tables`` from ``PagedKVCache.block_tables``)::

  out, numbers = decode_attention(cache_cfg, select_cfg, state, layer, q, block_table,
                                  stream_table, lengths, numbers, reselect=True)
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxsys.core.errors import ConfigError, check_min, check_range
from jaxsys.ops.paged_attention import paged_decode_attention
from jaxsys.serving import page_select as ps
from jaxsys.serving.paged_cache import PagedCacheConfig, PagedState, stream_page_numbers

__all__ = [
    "check_selection", "decode_attention", "LServeConfig", "retrieval_attention", "streaming_attention",
]


@dataclasses.dataclass(frozen=True)
class LServeConfig:
  """Sparse-attention settings of the serving engine (``dense=True`` turns all of it off).

  ``token_budget`` must be a multiple of ``page_size``, ``page_size`` of ``logical_page_size``.
  ``streaming_fraction`` is the share of kv heads turned into streaming heads when gates are
  learned; ``sink``/``window`` are in tokens. ``prefill_sink`` / ``prefill_window`` (None: the
  same as decode) give streaming heads a different sink + local span during prefill, as
  omniserve configures prefill and decode separately; the streaming pool keeps what decode reads.
  ``prefill_dense_tail``: the queries of the last that many prompt tokens attend densely in the
  streaming heads too (``prefill.dense_tail``): the prompt's end (the question) decides the first
  answer token, and there the streaming heads' view of the whole context matters.
  ``sink_pages``: leading pages every retrieval-head selection keeps (``SelectionConfig``).
  """
  dense: bool = False
  page_size: int = 64
  logical_page_size: int = 16
  token_budget: int = 4096
  reuse_steps: int = 4
  sink: int = 64
  window: int = 256
  streaming_fraction: float = 0.5
  kv_int8: bool = False
  impl: str = "auto"
  prefill_sink: int | None = None
  prefill_window: int | None = None
  sink_pages: int = 1
  prefill_dense_tail: int = 0

  def __post_init__(self):
    # SelectionConfig validates page/budget divisibility with errors naming the fields.
    self._selection()
    check_range("streaming_fraction", self.streaming_fraction, 0.0, 1.0)
    check_min(self, 1, "window")
    check_min(self, 0, "sink", "prefill_dense_tail")
    if self.prefill_sink is not None:
      check_min(self, 0, "prefill_sink")
    if self.prefill_window is not None:
      check_min(self, 1, "prefill_window")

  @property
  def selection(self) -> ps.SelectionConfig | None:
    """The page selection these settings describe (None when ``dense``)."""
    if self.dense:
      return None
    return self._selection()

  def _selection(self) -> ps.SelectionConfig:
    return ps.SelectionConfig(self.token_budget, self.page_size, self.logical_page_size,
                              self.reuse_steps, self.sink_pages)

  def cache_config(self, *, num_layers: int, num_kv_heads: int, head_dim: int, num_pages: int,
                   max_requests: int, streaming=None, dtype: str = "float32") -> PagedCacheConfig:
    """The paged cache these settings need: page sizes, ``sink``/``window`` and ``kv_int8`` come
    from here, the model and pool sizes from the arguments (``streaming`` is ignored when dense)."""
    return PagedCacheConfig(
        num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim, num_pages=num_pages,
        page_size=self.page_size, logical_page_size=self.logical_page_size,
        max_requests=max_requests, sink=self.sink, window=self.window,
        streaming=None if self.dense else streaming, dtype=dtype, kv_int8=self.kv_int8,
        prefill_sink=self.prefill_sink, prefill_window=self.prefill_window,
        prefill_dense_tail=self.prefill_dense_tail)


def check_selection(c: PagedCacheConfig, sel: ps.SelectionConfig | None):
  """Raises unless ``sel`` counts pages of the size ``c`` stores (build both from one
  ``LServeConfig`` -- ``.cache_config(...)`` and ``.selection`` -- and they agree)."""
  if sel is not None and (sel.page_size, sel.logical_page_size) != (c.page_size,
                                                                    c.logical_page_size):
    raise ConfigError(f"selection page_size={sel.page_size}, logical_page_size="
                      f"{sel.logical_page_size} differ from the cache's page_size={c.page_size}, "
                      f"logical_page_size={c.logical_page_size}")


def selects_pages(sel: ps.SelectionConfig | None, max_pages: int) -> bool:
  """Whether decode selects retrieval pages over block tables of ``max_pages`` columns (static):
  not in dense mode, nor when every page fits the budget (selection would keep them all)."""
  return sel is not None and max_pages > sel.num_select


def retrieval_attention(c: PagedCacheConfig, sel: ps.SelectionConfig | None, st: PagedState,
                        layer, q, block_table, lengths, numbers=None, *, reselect=True,
                        impl="auto"):
  """Retrieval-head attention ``q [b, r*g, d] -> ([b, r*g, d], numbers [b, r, K] or None)``.

  ``reselect``: a Python bool, or a traced ``bool[]`` (the engine's: the re-selecting and the
  reusing decode steps then share one executable, a ``lax.cond`` skipping the page scores when it
  reuses ``numbers``)."""
  check_selection(c, sel)
  r = len(c.retrieval_heads(layer))
  if not selects_pages(sel, block_table.shape[1]):
    idx, num = ps.all_pages(block_table, lengths, r, page_size=c.page_size)
  else:
    def select():
      scores = ps.page_scores(q, st.kmin[layer], st.kmax[layer], block_table, lengths,
                              page_size=c.page_size, logical_page_size=c.logical_page_size,
                              impl=impl)
      return ps.select_pages(scores, lengths, num_select=sel.num_select, page_size=c.page_size,
                             sink_pages=sel.sink_pages)

    if numbers is None or reselect is True:
      numbers = select()
    elif reselect is not False:  # traced: one executable re-selects or reuses at run time
      numbers = jax.lax.cond(reselect, select, lambda: numbers)
    num = ps.with_newest_page(numbers, lengths, page_size=c.page_size)
    idx = ps.physical_pages(block_table, num)
  (k, ks), (v, vs) = st.pool("k", layer), st.pool("v", layer)
  out = paged_decode_attention(q, k, v, idx, num, lengths, k_scales=ks, v_scales=vs,
                               impl=impl)
  return out, numbers


def streaming_attention(c: PagedCacheConfig, st: PagedState, layer, q, stream_table, lengths,
                        impl="auto"):
  """Streaming-head attention over sink + ring pages: ``q [b, s*g, d] -> [b, s*g, d]``."""
  s = len(c.streaming_heads(layer))
  b = q.shape[0]
  num = jnp.broadcast_to(stream_page_numbers(c, lengths)[:, None], (b, s, stream_table.shape[1]))
  idx = jnp.broadcast_to(stream_table[:, None], num.shape)
  (k, ks), (v, vs) = st.pool("sk", layer), st.pool("sv", layer)
  return paged_decode_attention(q, k, v, idx, num, lengths,
                                sink=c.sink, window=c.window, k_scales=ks, v_scales=vs,
                                impl=impl)


def decode_attention(c: PagedCacheConfig, sel: ps.SelectionConfig | None, st: PagedState,
                     layer, q, block_table, stream_table, lengths, numbers=None, *,
                     reselect=True, impl="auto"):
  """One layer's decode attention ``q [b, heads, d] -> (out [b, heads, d], numbers)``.

  ``lengths`` count the current token (already written to the cache). ``numbers`` is the
  retrieval selection of this layer carried between steps (None in dense mode).
  """
  b, h, d = q.shape
  hk = c.num_kv_heads
  g = h // hk
  rh, sh = c.retrieval_heads(layer), c.streaming_heads(layer)
  qg = q.reshape(b, hk, g, d)  # [batch, kv_heads, group, dim]
  out = jnp.zeros((b, hk, g, d), q.dtype)
  if len(rh):
    o, numbers = retrieval_attention(c, sel, st, layer, qg[:, rh].reshape(b, -1, d), block_table,
                                     lengths, numbers, reselect=reselect, impl=impl)
    out = out.at[:, rh].set(o.reshape(b, len(rh), g, d))
  if len(sh):
    o = streaming_attention(c, st, layer, qg[:, sh].reshape(b, -1, d), stream_table, lengths, impl)
    out = out.at[:, sh].set(o.reshape(b, len(sh), g, d))
  return out.reshape(b, h, d), numbers
