"""ServingEngine step API: streaming == offline, mixed parameters == alone, chunked == unchunked
prefill, preemption keeps outputs, prefix cache, abort, stop strings and request errors."""

import dataclasses

import numpy as np
import pytest

from jaxsys.core.errors import ConfigError, InputError
from jaxsys.models.llm._decoder_config import DecoderConfig
from jaxsys.models.llm.decoder import random_model
from jaxsys.serving import ServingConfig, ServingEngine, generate
from jaxsys.serving.lserve import LServeConfig
from jaxsys.serving.prefix_cache import PrefixCachingAllocator, page_keys
from jaxsys.serving.requests import RequestParams, TextStream

SMALL = dict(page_size=8, logical_page_size=4, sink=4, window=8)
GREEDY = dict(temperature=0.0)


@pytest.fixture(scope="module")
def model():
  cfg = DecoderConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                      num_heads=4, num_kv_heads=2)
  return random_model(cfg, seed=0)


def _engine(model, tokenizer=None, **kw):
  c = dict(lserve=LServeConfig(dense=True, token_budget=64, **SMALL), max_batch=3, num_pages=32,
           max_seq_len=96, max_num_batched_tokens=64)
  c.update(kw)
  return ServingEngine(model, ServingConfig(**c), tokenizer=tokenizer, stop_tokens=())


def _prompts(lengths=(40, 21, 50, 9), seed=0):
  rng = np.random.default_rng(seed)
  return [rng.integers(0, 64, n).tolist() for n in lengths]


def _run(engine, prompts, params):
  """Streams every request to completion: ``{(request_id, index): (tokens, logprobs, reason)}``."""
  for i, (p, q) in enumerate(zip(prompts, params)):
    engine.add_request(p, q, f"r{i}")
  out = {}
  while engine.has_unfinished():
    for o in engine.step():
      toks, lps, _ = out.setdefault((o.request_id, o.index), ([], [], None))
      toks += o.new_token_ids
      lps += [x.logprob for x in o.logprobs or []]
      if o.finished:
        out[(o.request_id, o.index)] = (toks, lps, o.finish_reason)
  return out


def _mixed():
  return [RequestParams(max_tokens=6, temperature=0.9, top_k=8, seed=3, logprobs=True, top_logprobs=2),
          RequestParams(max_tokens=9, **GREEDY, logprobs=True),
          RequestParams(max_tokens=5, temperature=1.2, top_p=0.8, min_p=0.05, seed=7, n=2,
                        logprobs=True),
          RequestParams(max_tokens=7, temperature=0.7, seed=11, stop_token_ids=(5, 9), logprobs=True)]


def test_streamed_tokens_equal_offline_generate_and_pool_returns(model):
  prompts = _prompts()
  news = [6, 9, 5, 7]
  ref = _engine(model).generate(prompts, news, stop_tokens=())  # the batch (non-streaming) path
  core = generate(model, prompts, max_new_tokens=max(news), stop_tokens=())  # the decoding core
  assert ref.tokens == [t[:m] for t, m in zip(core.tokens, news)]
  e = _engine(model)
  out = _run(e, prompts, [RequestParams(max_tokens=m, **GREEDY) for m in news])
  assert [out[(f"r{i}", 0)][0] for i in range(4)] == ref.tokens
  assert all(out[(f"r{i}", 0)][2] == "length" for i in range(4))
  assert e.num_free_pages == 32 and not e.cache.seqs and not e.has_unfinished()


def test_mixed_parameters_in_one_batch_equal_each_request_alone(model):
  prompts, params = _prompts(seed=1), _mixed()
  together = _run(_engine(model), prompts, params)
  assert len(together) == 5  # request 2 has n=2 choices
  assert together[("r2", 0)][0] != together[("r2", 1)][0]
  for i, (p, q) in enumerate(zip(prompts, params)):
    alone = _run(_engine(model), [p], [q])
    for j in range(q.n):
      a, t = alone[("r0", j)], together[(f"r{i}", j)]
      assert a[0] == t[0] and a[2] == t[2], (i, j)
      np.testing.assert_allclose(a[1], t[1], atol=1e-5)
  toks, lps, reason = together[("r3", 0)]  # a stop token ends a request and is kept
  assert reason == "length" or (reason == "stop" and toks[-1] in (5, 9))
  assert all(lp <= 0 for lp in lps) and len(lps) == len(toks)


def test_chunked_prefill_equals_unchunked_and_interleaves_with_decode(model):
  prompts = _prompts((70, 12, 33), seed=2)
  params = [RequestParams(max_tokens=8, **GREEDY, logprobs=True)] * 3
  whole = _run(_engine(model), prompts, params)
  e = _engine(model, prefill_chunk=8, max_num_batched_tokens=12)
  chunked = _run(e, prompts, params)
  for k in whole:
    assert whole[k][0] == chunked[k][0]
    np.testing.assert_allclose(whole[k][1], chunked[k][1], atol=1e-4)
  # 115 prompt tokens in chunks of <= 8 under a 12-token budget: many more steps than requests,
  # and decode steps happened while the 70-token prompt was still prefilling
  assert e.scheduler.stats["steps"] > 115 // 12


def test_preemption_keeps_every_output(model):
  prompts = _prompts((60, 58, 61, 12), seed=3)  # 8 pages each, growing to 12: 3 live need 36 > 32
  params = [dataclasses.replace(q, max_tokens=30, stop_token_ids=()) for q in _mixed()]
  ref = _run(_engine(model, num_pages=40), prompts, params)
  e = _engine(model)
  out = _run(e, prompts, params)
  assert e.scheduler.stats["preemptions"] > 0
  assert out.keys() == ref.keys()
  for k in ref:
    assert out[k][0] == ref[k][0] and out[k][2] == ref[k][2], k
    np.testing.assert_allclose(out[k][1], ref[k][1], atol=1e-4)
  assert e.num_free_pages == 32 and not e.cache.seqs


def test_prefix_cache_shares_a_system_prompt(model):
  system = _prompts((33,), seed=4)[0]
  prompts = [system + p for p in _prompts((5, 9, 14, 3), seed=5)]
  params = [RequestParams(max_tokens=4, **GREEDY)] * 4
  e = _engine(model)
  out = _run(e, prompts[:1], params[:1])  # the first request fills the 4 system pages
  out.update({(f"r{i + 1}", 0): v for (r, _), v in _run(e, prompts[1:], params[1:]).items()
              for i in [int(r[1:])]})
  assert e.scheduler.stats["cached_tokens"] == 3 * 32 and e.cache.alloc.hit_rate > 0
  off = _engine(model, prefix_caching=False)
  ref = {(f"r{i}", 0): _run(off, [p], params[:1])[("r0", 0)] for i, p in enumerate(prompts)}
  assert {k: v[0] for k, v in out.items()} == {k: v[0] for k, v in ref.items()}
  assert e.num_free_pages == 32 and e.cache.alloc.num_cached > 0


def test_allocator_refcounts_and_eviction():
  a = PrefixCachingAllocator(4)
  keys = page_keys(list(range(20)), 8)
  assert len(keys) == 2 and keys != page_keys([1] + list(range(1, 20)), 8)
  p = a.allocate(2)
  for page, key in zip(p, keys):
    a.register(page, key)
  assert a.lookup(keys) == p and a.refcount(p[0]) == 2
  a.free(p)
  a.free(p)
  assert a.num_free == 4 and a.num_cached == 2
  assert a.lookup(keys[:1]) == p[:1]     # an unreferenced cached page is revived
  a.allocate(3)                          # 2 free + evicts the other cached page
  assert a.lookup(keys[1:]) == [] and a.num_free == 0
  b = PrefixCachingAllocator(2)
  q = b.allocate(1)
  b.free(q)
  with pytest.raises(InputError, match="double free"):
    b.free(q)


def test_abort_frees_pages_and_others_continue(model):
  prompts = _prompts(seed=6)
  e = _engine(model)
  for i, p in enumerate(prompts):
    e.add_request(p, RequestParams(max_tokens=20, **GREEDY), f"r{i}")
  e.step()
  e.step()
  assert e.abort("r0") and e.abort("r3") and not e.abort("nope")
  done = {}
  while e.has_unfinished():
    for o in e.step():
      done.setdefault(o.request_id, []).extend(o.new_token_ids)
  assert set(done) == {"r1", "r2"} and e.num_free_pages == 32


class _CharTokenizer:
  """Token i is the letter chr(97 + i % 26); enough for stop strings and incremental text."""
  eos_token_id = None

  def decode(self, ids, skip_special_tokens=True):
    return "".join(chr(97 + i % 26) for i in ids)


def test_stop_strings_cut_the_text_and_stream_it_whole(model):
  prompts = _prompts((20,), seed=7)
  e = _engine(model, tokenizer=_CharTokenizer())
  full = _run(e, prompts, [RequestParams(max_tokens=12, **GREEDY)])[("r0", 0)][0]
  text = _CharTokenizer().decode(full)
  stop = text[5:7]  # a two-letter stop string that first occurs at index <= 5
  e.add_request(prompts[0], RequestParams(max_tokens=12, stop=(stop,), **GREEDY), "s")
  outs = []
  while e.has_unfinished():
    outs += e.step()
  streamed = "".join(o.new_text for o in outs)
  assert streamed == text[:text.find(stop)] and outs[-1].finish_reason == "stop"
  assert len(outs) <= 7 and sum(len(o.new_token_ids) for o in outs) == len(outs)
  ts = TextStream(_CharTokenizer(), ("xyz",))
  assert ts.add([0, 1]) == ("", False) and ts.add([0, 1, 2]) == ("a", False)


def test_request_errors(model):
  e = _engine(model)
  with pytest.raises(InputError, match="max_seq_len=96"):
    e.add_request(_prompts((90,))[0], RequestParams(max_tokens=10), "long")
  with pytest.raises(InputError, match="tokenizer"):
    e.add_request("hello", RequestParams(), "text")
  with pytest.raises(ConfigError, match="min_p"):
    RequestParams(min_p=1.5)
  with pytest.raises(ConfigError, match="top_logprobs"):
    RequestParams(top_logprobs=21)
  with pytest.raises(ConfigError, match="top_k=99"):
    e.add_request([1, 2], RequestParams(top_k=99), "k")
  e.add_request([1, 2, 3], RequestParams(max_tokens=2), "dup")
  with pytest.raises(InputError, match="already live"):
    e.add_request([1, 2, 3], RequestParams(), "dup")
  assert not e.cache.seqs and e.abort("dup")
