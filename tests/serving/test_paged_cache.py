"""Paged cache: contents equal the contiguous cache, statistics equal recomputed min/max, allocator."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsys.core.errors import ConfigError, InputError
from jaxsys.serving import paged_cache as pc


def _config(**kw):
  base = dict(num_layers=2, num_kv_heads=3, head_dim=8, num_pages=24, page_size=8,
              logical_page_size=4, max_requests=3, sink=4, window=10,
              streaming=((False, True, False), (True, False, False)))
  base.update(kw)
  return pc.PagedCacheConfig(**base)


@functools.partial(jax.jit, static_argnums=(0, 2))
def _write(c, st, layer, k, v, bt, stt, pos, valid):
  return pc.write_tokens(c, st, layer, k, v, bt, stt, pos, valid)


def _fill(c, cache, rid, keys, vals, chunks):
  """Writes a request's tokens in prefill chunks, then single decode tokens."""
  t = keys.shape[0]
  cache.admit(rid, chunks[0])
  start = 0
  for n in chunks + [1] * (t - sum(chunks)):
    cache.extend(rid, n) if start else None
    bt, st_, _ = cache.block_tables([rid], 8)
    pos = jnp.arange(start, start + n)[None]
    for layer in range(c.num_layers):
      cache.state = _write(c, cache.state, layer, jnp.asarray(keys[None, start:start + n, layer]),
                           jnp.asarray(vals[None, start:start + n, layer]), jnp.asarray(bt),
                           jnp.asarray(st_), pos, jnp.ones_like(pos, bool))
    start += n
    cache.seqs[rid].length = start


@pytest.mark.parametrize("kv_int8", [False, True])
def test_contents_and_statistics_match_contiguous(kv_int8):
  c = _config(kv_int8=kv_int8)
  cache = pc.PagedKVCache(c)
  rng = np.random.default_rng(0)
  t = 43
  keys = rng.standard_normal((t, c.num_layers, c.num_kv_heads, c.head_dim)).astype(np.float32)
  vals = rng.standard_normal(keys.shape).astype(np.float32)
  cache.admit("other", 5)  # interleaved owner: pages of "r" are not contiguous ids
  _fill(c, cache, "r", keys, vals, [13, 10])
  seq = cache.seqs["r"]
  assert seq.length == t and len(seq.pages) == -(-t // c.page_size)
  tol = 2e-2 if kv_int8 else 0
  state = jax.tree.map(np.asarray, cache.state)
  for layer in range(c.num_layers):
    rh = c.retrieval_heads(layer)
    k, v = pc.gather_contiguous(c, cache.state, layer, jnp.asarray(seq.pages), t)
    np.testing.assert_allclose(k, keys[:, layer, rh], atol=tol)
    np.testing.assert_allclose(v, vals[:, layer, rh], atol=tol)
    # statistics == min/max recomputed from the stored (dequantised) keys
    lps = c.logical_page_size
    for lp in range(-(-t // lps)):
      blk = np.asarray(k[lp * lps:(lp + 1) * lps])
      page, sub = seq.pages[lp * lps // c.page_size], (lp * lps % c.page_size) // lps
      np.testing.assert_allclose(state.kmin[layer][page, :, sub], blk.min(0), atol=1e-6)
      np.testing.assert_allclose(state.kmax[layer][page, :, sub], blk.max(0), atol=1e-6)
    # streaming heads keep exactly the sink tokens and the ring of recent pages
    sh = c.streaming_heads(layer)
    nums = np.asarray(pc.stream_page_numbers(c, jnp.asarray([t])))[0]
    for slot, num in enumerate(nums):
      if num < 0:
        continue
      page = seq.stream_pages[slot]
      hi = min((num + 1) * c.page_size, t)
      got = state.sk[layer][page]
      if kv_int8:
        got = got * state.sk_scale[layer][page][..., None]
      got = got[:, :hi - num * c.page_size].transpose(1, 0, 2)
      np.testing.assert_allclose(got, keys[num * c.page_size:hi, layer][:, sh], atol=tol)
  assert c.stream_pages_per_request == 1 + 3
  # memory of streaming heads is constant in the context length
  assert len(seq.stream_pages) == c.stream_pages_per_request


def test_allocator_never_leaks_over_random_join_leave():
  c = _config(num_pages=40, max_requests=6)
  cache = pc.PagedKVCache(c)
  rng = np.random.default_rng(1)
  live, rejected = [], 0
  for i in range(1000):
    if live and (rng.random() < 0.45 or len(live) == c.max_requests):
      cache.release(live.pop(rng.integers(len(live))))
    else:
      try:
        cache.admit(i, int(rng.integers(1, 120)))
        live.append(i)
      except pc.PoolExhaustedError:
        rejected += 1
    for rid in live:
      if rng.random() < 0.3:
        try:
          cache.extend(rid, int(rng.integers(1, 20)))
          cache.seqs[rid].length = len(cache.seqs[rid].pages) * c.page_size
        except pc.PoolExhaustedError:
          rejected += 1
    used = sum(len(cache.seqs[r].pages) for r in live)
    assert used + cache.alloc.num_free == c.num_pages
    assert len({p for r in live for p in cache.seqs[r].pages}) == used  # no page shared
  for rid in live:
    cache.release(rid)
  assert cache.alloc.num_free == c.num_pages and cache.stream_alloc.num_free == c.num_stream_pages
  assert rejected > 0  # the pool really ran full at times


def test_bad_configs_and_requests():
  with pytest.raises(ConfigError, match="logical_page_size"):
    _config(page_size=12, logical_page_size=8)
  with pytest.raises(ConfigError, match="streaming flags"):
    _config(streaming=((False,),))
  cache = pc.PagedKVCache(_config(num_pages=4))
  with pytest.raises(pc.PoolExhaustedError, match="num_pages=4"):
    cache.admit("big", 40)
  assert cache.alloc.num_free == 4 and not cache.seqs
  cache.admit("a", 8)
  with pytest.raises(InputError, match="already live"):
    cache.admit("a", 8)
  with pytest.raises(InputError, match="double free"):
    cache.alloc.free([3])


@pytest.mark.parametrize("kv_int8", [False, True])
def test_state_is_a_typed_pytree(kv_int8):
  c = _config(kv_int8=kv_int8)
  st = pc.init_state(c)
  assert isinstance(st, pc.PagedState) and st.num_layers == c.num_layers
  assert st.quantized == kv_int8 and (st.sk_scale is None) != kv_int8
  assert st.k[0].dtype == (jnp.int8 if kv_int8 else jnp.float32)
  assert st.k[0].shape == (c.num_pages, 2, c.page_size, c.head_dim)      # layer 0: 2 retrieval heads
  assert st.sk[0].shape == (c.num_stream_pages, 1, c.page_size, c.head_dim)
  assert st.kmin[1].shape == (c.num_pages, 2, c.logical_per_page, c.head_dim)
  assert len(jax.tree.leaves(st)) == (10 if kv_int8 else 6) * c.num_layers
  back = jax.jit(lambda s: s)(st)  # through jit as one argument, structure kept
  assert jax.tree.structure(back) == jax.tree.structure(st)
  with pytest.raises(InputError, match="pool"):
    st.pool("kmin", 0)
  if kv_int8:
    with pytest.raises(ConfigError, match="all given or all None"):
      dataclasses.replace(st, v_scale=None)
