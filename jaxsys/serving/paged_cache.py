"""Paged KV cache with a page allocator, two pools per layer and per-logical-page key statistics.

LServe (Yang et al. 2025) keeps two kinds of KV heads:

* retrieval heads keep every token in fixed-size physical pages (default 64 tokens) taken from a
  preallocated pool through a free list; each physical page also stores, per logical page
  (default 16 tokens) and per channel, the min and max of its keys. The hierarchical page
  selector (``page_select.py``) bounds ``q . k`` on a logical page by
  ``sum_i max(q_i kmax_i, q_i kmin_i)`` (Quest, Tang et al. 2024).
* streaming heads keep only ``sink`` tokens and a ``window`` of recent tokens: sink pages plus a
  ring of local pages, so their memory per request is constant in the context length.

Layout (``PagedState``, per layer ``l`` with ``r_l`` retrieval and ``s_l`` streaming kv heads)::

  k[l], v[l]        [num_pages, r_l, page_size, head_dim]            (int8 + scales [.., page_size])
  kmin[l], kmax[l]  [num_pages, r_l, page_size // logical_page, head_dim]
  sk[l], sv[l]      [num_stream_pages, s_l, page_size, head_dim]
  k_scale[l], ...   float32 per-token scales of the four pools; None unless kv_int8

Row ``page * heads + head`` of a flattened pool is one contiguous ``[page_size, head_dim]``
block, which is what the decode gather reads. Page ids are shared across layers (one block table
per request, as in vLLM). The host-side ``PagedKVCache`` owns allocators and block tables; the
jittable functions below write tokens and statistics.

Usage::

  cache = PagedKVCache(PagedCacheConfig(num_layers=2, num_kv_heads=4, head_dim=32, num_pages=64))
  cache.admit("r0", prompt_len)          # raises PoolExhaustedError if it cannot hold it
  cache.extend("r0", 1)                  # room for one more token (allocates a page on a boundary)
  cache.release("r0")
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxsys.core.errors import ConfigError, InputError, ShapeError, check_min, check_multiple

__all__ = [
    "gather_contiguous", "init_state", "PageAllocator", "PagedCacheConfig", "PagedKVCache",
    "PagedSequence", "PagedState", "PoolExhaustedError", "POOLS", "POOLS_SCALES", "quantize_int8",
    "read_pages", "stream_page_numbers", "stream_slot", "write_tokens",
]


class PoolExhaustedError(InputError):
  """The page pool cannot hold a request (raised before anything is allocated)."""


@dataclasses.dataclass(frozen=True)
class PagedCacheConfig:
  """Sizes of the paged cache.

  ``streaming`` is a per-layer tuple of per-kv-head flags (True = streaming head); None means
  every head is a retrieval head (dense serving). ``sink`` and ``window`` are in tokens.
  """
  num_layers: int
  num_kv_heads: int
  head_dim: int
  num_pages: int = 1024
  page_size: int = 64
  logical_page_size: int = 16
  max_requests: int = 8
  sink: int = 64
  window: int = 256
  streaming: tuple[tuple[bool, ...], ...] | None = None
  dtype: str = "float32"
  kv_int8: bool = False
  prefill_sink: int | None = None     # streaming heads' sink / local span in prefill (None: sink)
  prefill_window: int | None = None   # (None: window)
  prefill_dense_tail: int = 0         # last prompt tokens whose streaming heads attend densely

  def __post_init__(self):
    check_min(self, 1, "num_layers", "num_kv_heads", "head_dim", "num_pages", "page_size",
              "logical_page_size", "max_requests", "window")
    check_min(self, 0, "sink", "prefill_dense_tail")
    check_multiple("page_size", self.page_size, "logical_page_size", self.logical_page_size)
    if self.streaming is not None:
      s = np.asarray(self.streaming, bool)
      if s.shape != (self.num_layers, self.num_kv_heads):
        raise ConfigError(f"streaming flags have shape {s.shape}; expected "
                          f"(num_layers={self.num_layers}, num_kv_heads={self.num_kv_heads})")
      object.__setattr__(self, "streaming", tuple(tuple(bool(x) for x in row) for row in s))
    if self.kv_int8 and self.dtype not in ("float32", "bfloat16"):
      raise ConfigError(f"kv_int8 dequantises to float32/bfloat16, got dtype={self.dtype!r}")

  @property
  def prefill_span(self) -> tuple[int, int]:
    """``(sink, window)`` of streaming heads during prefill."""
    return (self.sink if self.prefill_sink is None else self.prefill_sink,
            self.window if self.prefill_window is None else self.prefill_window)

  @property
  def sink_pages(self) -> int:
    return -(-self.sink // self.page_size)

  @property
  def ring_pages(self) -> int:
    """Local pages in the ring: a window of w tokens can touch ceil(w / page) + 1 pages."""
    return -(-self.window // self.page_size) + 1

  @property
  def stream_pages_per_request(self) -> int:
    return self.sink_pages + self.ring_pages

  @property
  def num_stream_pages(self) -> int:
    return self.max_requests * self.stream_pages_per_request

  @property
  def logical_per_page(self) -> int:
    return self.page_size // self.logical_page_size

  def streaming_flags(self) -> np.ndarray:
    if self.streaming is None:
      return np.zeros((self.num_layers, self.num_kv_heads), bool)
    return np.asarray(self.streaming, bool)

  def retrieval_heads(self, layer: int) -> np.ndarray:
    return np.flatnonzero(~self.streaming_flags()[layer])

  def streaming_heads(self, layer: int) -> np.ndarray:
    return np.flatnonzero(self.streaming_flags()[layer])

  def token_bytes(self) -> dict[str, float]:
    """KV bytes per token of context (retrieval heads incl. statistics) and per request (streaming)."""
    el = 1 if self.kv_int8 else jnp.dtype(self.dtype).itemsize
    flags = self.streaming_flags()
    r, s = int((~flags).sum()), int(flags.sum())
    per_head_token = 2 * self.head_dim * el + (8 if self.kv_int8 else 0)
    stats = 2 * self.head_dim * jnp.dtype(self.dtype).itemsize / self.logical_page_size
    return {"retrieval_per_token": r * (per_head_token + stats),
            "streaming_per_request": s * per_head_token * self.stream_pages_per_request * self.page_size}


class PageAllocator:
  """Free list over ``num_pages`` page ids. All-or-nothing allocation; double frees are errors."""

  def __init__(self, num_pages: int):
    self.num_pages = int(num_pages)
    self._free = list(range(self.num_pages - 1, -1, -1))  # pop() hands out low ids first
    self._used: set[int] = set()

  @property
  def num_free(self) -> int:
    return len(self._free)

  def allocate(self, n: int) -> list[int]:
    if n > len(self._free):
      raise PoolExhaustedError(f"need {n} pages but only {len(self._free)} of {self.num_pages} are free")
    pages = [self._free.pop() for _ in range(n)]
    self._used.update(pages)
    return pages

  def free(self, pages) -> None:
    for p in pages:
      if p not in self._used:
        raise InputError(f"page {p} is not allocated (double free?)")
      self._used.remove(p)
      self._free.append(p)


@dataclasses.dataclass
class PagedSequence:
  """Host-side bookkeeping of one request: its length and page lists."""
  length: int = 0
  pages: list[int] = dataclasses.field(default_factory=list)
  stream_pages: list[int] = dataclasses.field(default_factory=list)


class PagedKVCache:
  """Device pools + host allocators and block tables for a set of live requests."""

  def __init__(self, config: PagedCacheConfig, mesh=None):
    self.config, self.mesh = config, mesh
    from jaxsys.serving.prefix_cache import PrefixCachingAllocator  # noqa: PLC0415 (imports this module)
    self.alloc = PrefixCachingAllocator(config.num_pages)
    self.stream_alloc = PageAllocator(config.num_stream_pages)
    self.seqs: dict = {}
    self.state = init_state(config, mesh)

  # -- host bookkeeping ---------------------------------------------------------------------
  def pages_for(self, num_tokens: int) -> int:
    return -(-num_tokens // self.config.page_size)

  def check_admissible(self, num_tokens: int) -> None:
    """Raises if a request of ``num_tokens`` cannot be held now (nothing changes)."""
    c = self.config
    need = self.pages_for(num_tokens)
    if need > c.num_pages:
      raise PoolExhaustedError(f"a request of {num_tokens} tokens needs {need} pages of {c.page_size}; "
                               f"the pool has num_pages={c.num_pages}")
    if len(self.seqs) >= c.max_requests:
      raise PoolExhaustedError(f"max_requests={c.max_requests} requests are already live")
    if need > self.alloc.num_free:
      raise PoolExhaustedError(f"a request of {num_tokens} tokens needs {need} pages; "
                               f"{self.alloc.num_free} are free")

  def admit(self, rid, num_tokens: int, shared=()) -> PagedSequence:
    """Reserves pages for ``num_tokens`` tokens of a new request (all or nothing). ``shared``:
    prefix-cache pages it starts with (already referenced for it: ``alloc.lookup``); they count
    toward ``num_tokens``, and are given back if the admission fails."""
    shared = list(shared)
    if rid in self.seqs:
      self.alloc.free(shared)
      raise InputError(f"request {rid!r} is already live")
    try:
      self.check_admissible(max(num_tokens - len(shared) * self.config.page_size, 0))
      own = self.alloc.allocate(max(self.pages_for(num_tokens) - len(shared), 0))
    except PoolExhaustedError:
      self.alloc.free(shared)
      raise
    seq = PagedSequence(length=0, pages=shared + own,
                        stream_pages=self.stream_alloc.allocate(self.config.stream_pages_per_request))
    self.seqs[rid] = seq
    return seq

  def extend(self, rid, n: int = 1) -> None:
    """Makes room for ``n`` more tokens of ``rid`` (a page is allocated at a page boundary)."""
    seq = self.seqs[rid]
    need = self.pages_for(seq.length + n) - len(seq.pages)
    if need > 0:
      seq.pages += self.alloc.allocate(need)

  def release(self, rid) -> None:
    seq = self.seqs.pop(rid)
    self.alloc.free(seq.pages)
    self.stream_alloc.free(seq.stream_pages)

  def release_all(self) -> None:
    """Frees every live request, e.g. after a failed step. A donating call interrupted before its
    result was stored leaves ``state`` deleted: then the pools are re-created (every page is free,
    so their contents do not matter)."""
    for rid in list(self.seqs):
      self.release(rid)
    if any(x.is_deleted() for x in jax.tree.leaves(self.state) if isinstance(x, jax.Array)):
      self.state = init_state(self.config, self.mesh)
      self.alloc.clear()

  def block_tables(self, rids, max_pages: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(pages int32[b, max_pages], stream_pages int32[b, S], lengths int32[b])``; pads with page 0."""
    bt = np.zeros((len(rids), max_pages), np.int32)
    st = np.zeros((len(rids), self.config.stream_pages_per_request), np.int32)
    ln = np.zeros((len(rids),), np.int32)
    for i, rid in enumerate(rids):
      if rid is None:
        continue
      seq = self.seqs[rid]
      if len(seq.pages) > max_pages:
        raise ShapeError(f"request {rid!r} holds {len(seq.pages)} pages > {max_pages=}")
      bt[i, :len(seq.pages)] = seq.pages
      st[i] = seq.stream_pages
      ln[i] = seq.length
    return bt, st, ln


# -- device state -----------------------------------------------------------------------------
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedState:
  """Device pools of a ``PagedKVCache``: one tuple entry per layer ``l``.

  With ``r_l`` retrieval and ``s_l`` streaming kv heads in layer ``l`` and ``dt = config.dtype``
  (``int8`` for the value pools when ``kv_int8``):

  * ``k[l], v[l]``: ``dt[num_pages, r_l, page_size, head_dim]`` retrieval keys / values.
  * ``kmin[l], kmax[l]``: ``config.dtype[num_pages, r_l, logical_per_page, head_dim]`` per-channel
    key bounds of each logical page (of the dequantised keys).
  * ``sk[l], sv[l]``: ``dt[num_stream_pages, s_l, page_size, head_dim]`` streaming sink + ring.
  * ``k_scale[l], v_scale[l]``: ``float32[num_pages, r_l, page_size]`` and ``sk_scale[l],
    sv_scale[l]``: ``float32[num_stream_pages, s_l, page_size]``, the per-token int8 scales;
    ``None`` unless ``kv_int8``.

  A pytree (every field is data), so it passes through ``jit`` (and donation) as one argument.
  """
  k: tuple[jax.Array, ...]
  v: tuple[jax.Array, ...]
  kmin: tuple[jax.Array, ...]
  kmax: tuple[jax.Array, ...]
  sk: tuple[jax.Array, ...]
  sv: tuple[jax.Array, ...]
  k_scale: tuple[jax.Array, ...] | None = None
  v_scale: tuple[jax.Array, ...] | None = None
  sk_scale: tuple[jax.Array, ...] | None = None
  sv_scale: tuple[jax.Array, ...] | None = None

  def __post_init__(self):
    scales = [getattr(self, n) is None for n in POOLS_SCALES]
    if any(scales) and not all(scales):
      raise ConfigError(f"int8 scales must be all given or all None; None: "
                        f"{[n for n, none in zip(POOLS_SCALES, scales) if none]}")

  @property
  def quantized(self) -> bool:
    """True when the value pools are int8 (the ``*_scale`` fields are set)."""
    return self.k_scale is not None

  @property
  def num_layers(self) -> int:
    return len(self.k)

  def pool(self, name: str, layer: int):
    """``(values, scales or None)`` of pool ``name`` (``"k" | "v" | "sk" | "sv"``) in ``layer``."""
    if name not in POOLS:
      raise InputError(f"pool {name=} must be one of {POOLS}")
    scales = getattr(self, name + "_scale")
    return getattr(self, name)[layer], (None if scales is None else scales[layer])

  def with_layer(self, layer: int, **arrays) -> PagedState:
    """A copy with entry ``layer`` of each named field replaced (``k=..., k_scale=...``)."""
    new = {}
    for name, x in arrays.items():
      old = getattr(self, name)
      if old is None:
        raise InputError(f"field {name!r} is None in this state (kv_int8 off)")
      new[name] = old[:layer] + (x,) + old[layer + 1:]
    return dataclasses.replace(self, **new)


POOLS = ("k", "v", "sk", "sv")
POOLS_SCALES = tuple(n + "_scale" for n in POOLS)


def init_state(c: PagedCacheConfig, mesh=None) -> PagedState:
  """Zero pools (see ``PagedState`` for the shapes); scale fields only when ``c.kv_int8``. With a
  ``mesh``, every pool's head axis (axis 1: kv heads) is sharded over its "model" axis (tensor
  parallel serving: each device holds its own heads' pages); a pool whose head count that axis
  does not divide (LServe's per-layer retrieval / streaming split) is replicated."""
  dt = jnp.int8 if c.kv_int8 else jnp.dtype(c.dtype)
  names = ("kmin", "kmax") + POOLS + (POOLS_SCALES if c.kv_int8 else ())
  fields: dict = {name: [] for name in names}
  for layer in range(c.num_layers):
    r, s = len(c.retrieval_heads(layer)), len(c.streaming_heads(layer))
    for name, n, h in (("k", c.num_pages, r), ("v", c.num_pages, r),
                       ("sk", c.num_stream_pages, s), ("sv", c.num_stream_pages, s)):
      fields[name].append(jnp.zeros((n, h, c.page_size, c.head_dim), dt))
      if c.kv_int8:
        fields[name + "_scale"].append(jnp.zeros((n, h, c.page_size), jnp.float32))
    for name in ("kmin", "kmax"):
      shape = (c.num_pages, r, c.logical_per_page, c.head_dim)
      fields[name].append(jnp.zeros(shape, jnp.dtype(c.dtype)))
  state = PagedState(**{name: tuple(xs) for name, xs in fields.items()})
  if mesh is None:
    return state
  tp = mesh.shape.get("model", 1)

  def place(x):
    spec = ("model",) if "model" in mesh.shape and x.shape[1] % tp == 0 else ()
    return jax.device_put(x, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, *spec)))
  return jax.tree.map(place, state)


def quantize_int8(x):
  """Symmetric per-token int8: ``x [..., d] -> (int8 [..., d], scale float32 [...])``."""
  amax = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=-1)
  scale = jnp.where(amax > 0, amax / 127.0, 1.0)
  q = jnp.clip(jnp.round(x.astype(jnp.float32) / scale[..., None]), -127, 127).astype(jnp.int8)
  return q, scale


def _scatter(pool, x, page, slot):
  """``pool[page[i], :, slot[i]] = x[i]``; x ``[n, heads, d]``; out-of-range pages are dropped."""
  return pool.at[page, :, slot].set(x.astype(pool.dtype), mode="drop")


def _write_pool(st: PagedState, name, layer, x, page, slot) -> PagedState:
  values, scales = st.pool(name, layer)
  if scales is None:
    return st.with_layer(layer, **{name: _scatter(values, x, page, slot)})
  xq, sc = quantize_int8(x)
  return st.with_layer(layer, **{name: _scatter(values, xq, page, slot),
                                 name + "_scale": scales.at[page, :, slot].set(sc, mode="drop")})


def read_pages(st: PagedState, key, layer, pages):
  """Dequantised pages ``[n, heads, page, d]`` of pool ``key`` (float32 for int8 pools)."""
  values, scales = st.pool(key, layer)
  x = values[pages]
  if scales is not None:
    x = x.astype(jnp.float32) * scales[pages][..., None]
  return x


def stream_slot(c: PagedCacheConfig, pos, end):
  """Streaming-pool slot (index into the request's stream pages, or -1 = not kept) of ``pos``.

  Sink pages keep positions < sink_pages * page_size; later pages go to ring slot
  ``(page - sink_pages) % ring_pages``; a token is kept only if its page is among the last
  ``ring_pages`` pages of a write ending at ``end`` (exclusive), so ring writes never collide.
  """
  page = pos // c.page_size
  last = (end - 1) // c.page_size
  ring = c.sink_pages + (page - c.sink_pages) % c.ring_pages
  idx = jnp.where(page < c.sink_pages, page, ring)
  keep = (page < c.sink_pages) | (page > last - c.ring_pages)
  return jnp.where(keep, idx, -1)


def write_tokens(c: PagedCacheConfig, st: PagedState, layer: int, k, v, block_table, stream_table,
                 positions, valid) -> PagedState:
  """Writes tokens of one layer into both pools and refreshes the touched page statistics.

  Args:
    k, v: ``[b, t, kv_heads, d]`` new keys/values (all kv heads of the layer).
    block_table: ``int32[b, max_pages]``; stream_table: ``int32[b, stream_pages_per_request]``.
    positions: ``int32[b, t]`` positions of the tokens; valid: ``bool[b, t]`` (False = padding).
  Returns the new state (a pure function of ``st``).
  """
  b, t, hk, d = k.shape
  ps = c.page_size
  drop_r = c.num_pages  # out-of-range page id: the scatter drops the token
  rh, sh = c.retrieval_heads(layer), c.streaming_heads(layer)
  lp_idx = jnp.clip(positions // ps, 0, block_table.shape[1] - 1)
  page = jnp.where(valid, jnp.take_along_axis(block_table, lp_idx, axis=1), drop_r)
  slot = positions % ps
  if len(rh):
    kr, vr = k[:, :, rh].reshape(b * t, len(rh), d), v[:, :, rh].reshape(b * t, len(rh), d)
    st = _write_pool(st, "k", layer, kr, page.reshape(-1), slot.reshape(-1))
    st = _write_pool(st, "v", layer, vr, page.reshape(-1), slot.reshape(-1))
    st = _refresh_stats(c, st, layer, block_table, positions, valid)
  if len(sh):
    end = jnp.max(jnp.where(valid, positions + 1, 0), axis=1, keepdims=True)
    sidx = stream_slot(c, positions, end)
    spage = jnp.take_along_axis(stream_table, jnp.clip(sidx, 0), axis=1)
    spage = jnp.where(valid & (sidx >= 0), spage, c.num_stream_pages)
    ks, vs = k[:, :, sh].reshape(b * t, len(sh), d), v[:, :, sh].reshape(b * t, len(sh), d)
    st = _write_pool(st, "sk", layer, ks, spage.reshape(-1), slot.reshape(-1))
    st = _write_pool(st, "sv", layer, vs, spage.reshape(-1), slot.reshape(-1))
  return st


def _refresh_stats(c, st, layer, block_table, positions, valid):
  """Recomputes kmin/kmax of every logical page the write touched.

  Valid positions of a request must be contiguous (a prefill chunk or one decode token). Each
  touched logical page is refreshed once, from its last written token: the statistics cover
  slots ``[l * lps, last]`` of the page, read back from the (possibly int8) pool so the bound
  holds for the keys attention actually uses.
  """
  lps, ps = c.logical_page_size, c.page_size
  b, t = positions.shape
  start = jnp.min(jnp.where(valid, positions, jnp.iinfo(jnp.int32).max), axis=1, keepdims=True)
  end = jnp.max(jnp.where(valid, positions + 1, 0), axis=1, keepdims=True)  # [b, 1]
  first = (start // lps + jnp.arange(t // lps + 2)[None, :]) * lps  # [b, n] logical page starts
  last = jnp.minimum(first + lps - 1, end - 1)  # last written token of each touched page
  own = first < end
  page = jnp.take_along_axis(block_table, jnp.clip(last // ps, 0, block_table.shape[1] - 1), axis=1)
  pg = jnp.where(own, page, c.num_pages).reshape(-1)  # [n]
  last = last.reshape(-1)
  lpage = (last % ps) // lps
  keys = _read_logical(c, st, layer, jnp.clip(pg, 0, c.num_pages - 1), lpage)  # [n, r, lps, d]
  ok = (jnp.arange(lps)[None, :] <= (last % lps)[:, None])[:, None, :, None]  # slots written so far
  kmin = jnp.min(jnp.where(ok, keys, jnp.inf), axis=2)  # [n, r, d]
  kmax = jnp.max(jnp.where(ok, keys, -jnp.inf), axis=2)
  old_min, old_max = st.kmin[layer], st.kmax[layer]
  return st.with_layer(layer,
                       kmin=old_min.at[pg, :, lpage].set(kmin.astype(old_min.dtype), mode="drop"),
                       kmax=old_max.at[pg, :, lpage].set(kmax.astype(old_max.dtype), mode="drop"))


def _read_logical(c, st, layer, pages, lpage):
  """Dequantised keys of logical page ``lpage[i]`` of page ``pages[i]``: ``[n, r, lps, d]``."""
  lps = c.logical_page_size
  pool, scales = st.pool("k", layer)
  x = pool.reshape(pool.shape[0], pool.shape[1], c.logical_per_page, lps, -1)[pages, :, lpage]
  if scales is not None:
    sc = scales.reshape(pool.shape[0], pool.shape[1], c.logical_per_page, lps)
    x = x.astype(jnp.float32) * sc[pages, :, lpage][..., None]
  return x


def stream_page_numbers(c: PagedCacheConfig, lengths):
  """Logical page number held by each stream slot of each request (-1 if none): ``int32[b, S]``.

  Sink slot i holds page i; ring slot r holds the newest page ``n <= (length-1) // page_size``
  with ``(n - sink_pages) % ring_pages == r`` and ``n >= sink_pages``.
  """
  cur = jnp.maximum(lengths - 1, 0)[:, None] // c.page_size  # [b, 1]
  sink = jnp.broadcast_to(jnp.arange(c.sink_pages), (lengths.shape[0], c.sink_pages))
  r = jnp.arange(c.ring_pages)[None, :]
  n = cur - (cur - c.sink_pages - r) % c.ring_pages
  ring = jnp.where(n >= c.sink_pages, n, -1)
  return jnp.concatenate([sink, ring], axis=1).astype(jnp.int32)


def gather_contiguous(c: PagedCacheConfig, st: PagedState, layer: int, block_table, length: int):
  """Retrieval-head keys/values of one request as contiguous ``[length, r, d]`` (tests, prefill)."""
  n = -(-length // c.page_size)
  k = read_pages(st, "k", layer, block_table[:n])  # [n, r, page, d]
  v = read_pages(st, "v", layer, block_table[:n])
  k = jnp.swapaxes(k, 1, 2).reshape(n * c.page_size, k.shape[1], -1)[:length]
  v = jnp.swapaxes(v, 1, 2).reshape(n * c.page_size, v.shape[1], -1)[:length]
  return k, v

