"""LServe decode attention and hybrid prefill against dense references."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsys.core.errors import ConfigError
from jaxsys.ops import attention, masks
from jaxsys.serving import lserve, paged_cache as pc
from jaxsys.serving.page_select import SelectionConfig

HEADS, HK, D = 4, 2, 8


def _filled(streaming, t=45, seed=0):
  c = pc.PagedCacheConfig(num_layers=1, num_kv_heads=HK, head_dim=D, num_pages=12, page_size=8,
                          logical_page_size=4, max_requests=1, sink=4, window=10,
                          streaming=(streaming,))
  rng = np.random.default_rng(seed)
  k = jnp.asarray(rng.standard_normal((1, t, HK, D)), jnp.float32)
  v = jnp.asarray(rng.standard_normal((1, t, HK, D)), jnp.float32)
  cache = pc.PagedKVCache(c)
  cache.admit("r", t)
  bt, stt, _ = cache.block_tables(["r"], 8)
  pos = jnp.arange(t)[None]
  st = jax.jit(pc.write_tokens, static_argnums=(0, 2))(c, cache.state, 0, k, v, jnp.asarray(bt),
                                                      jnp.asarray(stt), pos, pos >= 0)
  q = jnp.asarray(rng.standard_normal((1, HEADS, D)), jnp.float32)
  return c, st, q, k, v, jnp.asarray(bt), jnp.asarray(stt), jnp.asarray([t], jnp.int32)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _decode(c, sel, st, q, bt, stt, lengths):
  return lserve.decode_attention(c, sel, st, 0, q, bt, stt, lengths)[0]


def test_hybrid_decode_equals_per_head_mask_reference():
  c, st, q, k, v, bt, stt, lengths = _filled((False, True))
  sel = SelectionConfig(token_budget=64, page_size=8, logical_page_size=4)  # budget >= context
  out = _decode(c, sel, st, q, bt, stt, lengths)
  stream = masks.Sink(4) | masks.Local(10)
  mask = masks.MultiHead([masks.Causal()] * 2 + [stream] * 2)
  ref = attention(q[:, None], k, v, mask=mask, impl="reference")[:, 0]
  np.testing.assert_allclose(out, ref, atol=1e-5, rtol=1e-5)
  dense = _decode(c, None, st, q, bt, stt, lengths)  # dense selection: same
  np.testing.assert_allclose(dense, ref, atol=1e-5, rtol=1e-5)


def test_small_budget_reads_top_pages_only():
  c, st, q, k, v, bt, stt, lengths = _filled((False, False), seed=1)
  sel = SelectionConfig(token_budget=24, page_size=8, logical_page_size=4)  # 3 of 6 pages
  out, numbers = jax.jit(lambda st, q: lserve.decode_attention(c, sel, st, 0, q, bt, stt, lengths))(st, q)
  numbers = np.asarray(numbers)
  assert numbers.shape == (1, 2, 3) and (numbers[:, :, -1] == 5).all()  # newest page kept
  assert (numbers[:, :, 0] == 0).all()  # and the first (the attention sink)
  for h in range(HK):  # output == attention restricted to the chosen pages' tokens
    keep = np.isin(np.arange(45) // 8, numbers[0, h])
    for hq in (2 * h, 2 * h + 1):
      s = np.asarray(k[0, keep, h] @ q[0, hq]) / np.sqrt(D)
      p = np.exp(s - s.max())
      np.testing.assert_allclose(out[0, hq], (p / p.sum()) @ np.asarray(v[0, keep, h]), atol=1e-5)


def test_traced_reselect_matches_static_reselect_and_reuse():
  """One executable with ``reselect`` traced gives what the two static ones give: new page
  numbers when it re-selects, the carried ones (and attention over them) when it reuses."""
  c, st, q, *_, bt, stt, lengths = _filled((False, False), seed=2)
  sel = SelectionConfig(token_budget=24, page_size=8, logical_page_size=4)
  carried = jnp.asarray([[[0, 1, -1], [0, 2, -1]]], jnp.int32)  # not what scoring picks

  def run(reselect):
    return lserve.decode_attention(c, sel, st, 0, q, bt, stt, lengths, carried, reselect=reselect)

  traced = jax.jit(run)
  for flag in (True, False):
    (o_s, n_s), (o_t, n_t) = jax.jit(functools.partial(run, flag))(), traced(jnp.bool_(flag))
    np.testing.assert_array_equal(n_t, n_s)
    np.testing.assert_allclose(o_t, o_s, atol=1e-6, rtol=1e-6)
  assert (np.asarray(traced(jnp.bool_(False))[1]) == np.asarray(carried)).all()
  assert not (np.asarray(traced(jnp.bool_(True))[1]) == np.asarray(carried)).all()
  assert traced._cache_size() == 1


def test_lserve_config_errors():
  with pytest.raises(ConfigError, match="token_budget=1000"):
    lserve.LServeConfig(token_budget=1000, page_size=64)
  with pytest.raises(ConfigError, match="logical_page_size=48"):
    lserve.LServeConfig(page_size=64, logical_page_size=48, token_budget=4096)
  with pytest.raises(ConfigError, match="streaming_fraction"):
    lserve.LServeConfig(streaming_fraction=1.5)


def test_hybrid_prefill_equals_reference_multihead():
  from jaxsys.serving.prefill import hybrid_attention
  c = pc.PagedCacheConfig(num_layers=1, num_kv_heads=HK, head_dim=D, num_pages=8, page_size=8,
                          logical_page_size=4, sink=4, window=10, streaming=((True, False),))
  rng = np.random.default_rng(3)
  q = jnp.asarray(rng.standard_normal((1, 24, HEADS, D)), jnp.float32)
  k = jnp.asarray(rng.standard_normal((1, 40, HK, D)), jnp.float32)
  v = jnp.asarray(rng.standard_normal((1, 40, HK, D)), jnp.float32)
  static = masks.BlockSparse(np.tril(np.ones((3, 5), bool), 2) , 8, 8)  # optional static sparsity
  run = jax.jit(lambda q, k, v, rm: hybrid_attention(c, 0, q, k, v, q_offset=16, kv_lengths=None,
                                                      retrieval_mask=rm), static_argnums=(3,))
  stream = masks.Sink(4) | masks.Local(10)
  for rm in (None, static):
    dense = masks.Causal() if rm is None else masks.Causal() & rm
    ref = attention(q, k, v, mask=masks.MultiHead([stream] * 2 + [dense] * 2), q_offset=16, impl="reference")
    np.testing.assert_allclose(run(q, k, v, rm), ref, atol=1e-5, rtol=1e-5)


def test_cache_and_selection_come_from_one_lserve_config():
  ls = lserve.LServeConfig(page_size=8, logical_page_size=4, token_budget=24, sink=4, window=10,
                           kv_int8=True)
  c = ls.cache_config(num_layers=1, num_kv_heads=HK, head_dim=D, num_pages=12, max_requests=2,
                      streaming=((False, True),))
  assert (c.page_size, c.logical_page_size, c.sink, c.window, c.kv_int8) == (8, 4, 4, 10, True)
  assert c.streaming == ((False, True),)
  lserve.check_selection(c, ls.selection)
  lserve.check_selection(c, None)
  dense = lserve.LServeConfig(dense=True, page_size=8, logical_page_size=4, token_budget=24)
  assert dense.cache_config(num_layers=1, num_kv_heads=HK, head_dim=D, num_pages=12,
                            max_requests=2, streaming=((False, True),)).streaming is None
  with pytest.raises(ConfigError, match="differ from the cache's page_size=8"):
    lserve.check_selection(c, SelectionConfig(token_budget=32, page_size=16, logical_page_size=4))


def test_prefill_sink_and_window_apart_from_decode():
  """Streaming heads may use a different sink / local span in prefill than in decode (omniserve):
  a prefill window covering the prompt makes prefill exactly causal for every head."""
  from jaxsys.serving.prefill import hybrid_attention
  base = dict(num_layers=1, num_kv_heads=HK, head_dim=D, num_pages=12, page_size=8, logical_page_size=4,
              max_requests=1, sink=4, window=10, streaming=((True, False),))
  wide, narrow = pc.PagedCacheConfig(**base, prefill_sink=0, prefill_window=64), pc.PagedCacheConfig(**base)
  assert wide.prefill_span == (0, 64) and narrow.prefill_span == (4, 10)
  rng = np.random.default_rng(3)
  q = jnp.asarray(rng.standard_normal((1, 45, HEADS, D)), jnp.float32)
  k, v = (jnp.asarray(rng.standard_normal((1, 45, HK, D)), jnp.float32) for _ in range(2))
  dense = attention(q, k, v, mask=masks.Causal(), impl="xla")
  run = lambda c: hybrid_attention(c, 0, q, k, v, q_offset=0, kv_lengths=jnp.asarray([45]), impl="xla")  # noqa: E731
  np.testing.assert_allclose(run(wide), dense, atol=1e-5)
  assert not np.allclose(run(narrow)[:, :, :2], dense[:, :, :2], atol=1e-3)  # query heads of kv head 0
  cfg = lserve.LServeConfig(prefill_sink=8, prefill_window=512).cache_config(
      num_layers=1, num_kv_heads=HK, head_dim=D, num_pages=8, max_requests=1)
  assert cfg.prefill_span == (8, 512) and (cfg.sink, cfg.window) == (64, 256)
  with pytest.raises(ConfigError, match="prefill_window"):
    lserve.LServeConfig(prefill_window=0)


@pytest.mark.parametrize("q_offset,t", [(0, 45), (16, 16), (32, 13)])
def test_prefill_dense_tail_rows_equal_causal(q_offset, t):
  """The last ``prefill_dense_tail`` prompt tokens' streaming-head rows are dense (causal to the
  prompt length), every other row keeps the hybrid output; chunks see the tail's part in them."""
  from jaxsys.serving.prefill import dense_tail, hybrid_attention
  length, tail = 37, 8  # rows 37.. of the 45-token bucket are padding
  c = pc.PagedCacheConfig(num_layers=1, num_kv_heads=HK, head_dim=D, num_pages=12, page_size=8,
                          logical_page_size=4, sink=4, window=10, streaming=((True, False),),
                          prefill_dense_tail=tail)
  rng = np.random.default_rng(5)
  q_all = jnp.asarray(rng.standard_normal((1, 45, HEADS, D)), jnp.float32)
  k_all, v_all = (jnp.asarray(rng.standard_normal((1, 45, HK, D)), jnp.float32) for _ in range(2))
  lengths = jnp.asarray([length], jnp.int32)
  q = q_all[:, q_offset:q_offset + t]
  k, v = k_all[:, :q_offset + t], v_all[:, :q_offset + t]
  positions = q_offset + jnp.arange(t, dtype=jnp.int32)[None]
  hybrid = hybrid_attention(c, 0, q, k, v, q_offset=q_offset, kv_lengths=lengths, impl="xla")
  got = jax.jit(lambda o: dense_tail(c, 0, o, q, k, v, positions, lengths, impl="xla"))(hybrid)
  causal = attention(q, k, v, mask=masks.Causal(), q_offset=q_offset, kv_lengths=lengths,
                     impl="reference")
  pos = np.asarray(positions[0])
  in_tail = (pos >= length - tail) & (pos < length)
  want = np.array(hybrid)
  want[:, in_tail, :2] = np.asarray(causal)[:, in_tail, :2]  # query heads 0, 1 read kv head 0
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
  if in_tail.any():  # the tail changes the streaming heads' rows (the test can fail)
    assert not np.allclose(np.asarray(hybrid)[:, in_tail, :2], want[:, in_tail, :2], atol=1e-3)
  c0 = pc.PagedCacheConfig(**{**c.__dict__, "prefill_dense_tail": 0})
  assert dense_tail(c0, 0, hybrid, q, k, v, positions, lengths) is hybrid


def test_prefill_dense_tail_config():
  cfg = lserve.LServeConfig(prefill_dense_tail=32).cache_config(
      num_layers=1, num_kv_heads=HK, head_dim=D, num_pages=8, max_requests=1)
  assert cfg.prefill_dense_tail == 32
  with pytest.raises(ConfigError, match="prefill_dense_tail=-1 must be >= 0"):
    lserve.LServeConfig(prefill_dense_tail=-1)
  with pytest.raises(ConfigError, match="prefill_dense_tail"):
    pc.PagedCacheConfig(num_layers=1, num_kv_heads=HK, head_dim=D, prefill_dense_tail=-2)
