"""The OpenAI-compatible server, driven by the official ``openai`` client over HTTP on 127.0.0.1.

A small random-weight model with SmolLM2's tokenizer (its chat template and 49152-token vocab)
keeps the tests fast; the tokenizer comes from the SmolLM2 GGUF (skipped with the fetch command
when it is not installed)."""

import collections
import concurrent.futures
import contextlib
import dataclasses
import re
import time

import httpx
import numpy as np
import pytest

from jaxsys.models.llm.interop import pretrained
from jaxsys.models.llm._decoder_config import DecoderConfig
from jaxsys.models.llm.decoder import random_model
from jaxsys.serving import ServingConfig, ServingEngine, generate
from jaxsys.serving.lserve import LServeConfig

openai = pytest.importorskip("openai")
NAME = "tiny-chat"
PAGES = 96
SYSTEM = {"role": "system", "content": "You are a terse assistant. Answer every question about the "
          "sea, the weather and the harbour in one short sentence, and never use lists."}


@pytest.fixture(scope="module")
def setup():
  path = pretrained.find("smollm2-135m-instruct")
  if path is None:
    pytest.skip(f"SmolLM2 tokenizer not installed: run `{pretrained.fetch_command('smollm2-135m-instruct')}`")
  from jaxsys.models.llm.interop.gguf import load_tokenizer
  from jaxsys.serving.openai_server import start_server
  tok = load_tokenizer(path)
  cfg = DecoderConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_layers=2,
                      num_heads=4, num_kv_heads=2, max_position_embeddings=512)
  model = random_model(cfg, seed=0)
  engine = ServingEngine(model, ServingConfig(
      lserve=LServeConfig(dense=True, page_size=16, logical_page_size=4), max_batch=8,
      num_pages=PAGES, max_seq_len=256, max_num_batched_tokens=192), tokenizer=tok)
  server = start_server(engine, NAME)
  client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
  yield model, tok, engine, server, client
  server.stop()


def _idle(engine, timeout=20.0):
  """Waits until the engine thread has nothing live; True if the pool is full again."""
  end = time.time() + timeout
  while time.time() < end:
    if not engine.has_unfinished() and engine.num_free_pages == PAGES:
      return True
    time.sleep(0.05)
  return False


@contextlib.contextmanager
def _limits(server, **kw):
  """The shared server's ServerLimits changed for one test."""
  old = server.loop.limits
  server.loop.limits = dataclasses.replace(old, **kw)
  try:
    yield
  finally:
    server.loop.limits = old


def _chat(text):
  return [SYSTEM, {"role": "user", "content": text}]


def test_chat_streaming_equals_non_streaming_and_models(setup):
  _, _, engine, server, client = setup
  assert [m.id for m in client.models.list().data] == [NAME]
  assert httpx.get(server.url + "/health").json()["status"] == "ok"
  kw = dict(model=NAME, messages=_chat("Is the tide in?"), max_tokens=6, temperature=0)
  full = client.chat.completions.create(**kw)
  chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
  text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
  assert text == full.choices[0].message.content and len(text) > 0
  assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens == 6
  assert full.choices[0].finish_reason == "length"
  assert _idle(engine)


def test_n_stop_and_logprobs(setup):
  _, _, engine, _, client = setup
  r = client.chat.completions.create(model=NAME, messages=_chat("Weather?"), max_tokens=5, n=3,
                                     temperature=1.0, seed=5)
  assert [c.index for c in r.choices] == [0, 1, 2] and len({c.message.content for c in r.choices}) > 1
  base = client.chat.completions.create(model=NAME, messages=_chat("Boats?"), max_tokens=8,
                                        temperature=0).choices[0].message.content
  stop = base[len(base) // 2:len(base) // 2 + 3]
  cut = client.chat.completions.create(model=NAME, messages=_chat("Boats?"), max_tokens=8,
                                       temperature=0, stop=[stop])
  assert cut.choices[0].message.content == base[:base.find(stop)]
  assert cut.choices[0].finish_reason == "stop"
  lp = client.chat.completions.create(model=NAME, messages=_chat("Boats?"), max_tokens=4,
                                      temperature=0, logprobs=True, top_logprobs=3).choices[0]
  content = lp.logprobs.content
  assert len(content) == 4
  for t in content:
    tops = [x.logprob for x in t.top_logprobs]
    assert len(tops) == 3 and tops == sorted(tops, reverse=True) and t.logprob == pytest.approx(tops[0])
  assert _idle(engine)


def test_errors_have_openai_shape(setup):
  _, _, engine, server, client = setup
  for bad, param in ((dict(temperature=-1.0), "temperature"), (dict(top_p=0.0), "top_p"),
                     (dict(max_tokens=10**6), None)):
    with pytest.raises(openai.BadRequestError) as e:
      client.chat.completions.create(model=NAME, messages=_chat("hi"), **bad)
    err = e.value.body
    assert e.value.status_code == 400 and err["type"] == "invalid_request_error" and err["message"]
    if param:
      assert err["param"] == param
  assert "max_seq_len=256" in e.value.body["message"]  # context overflow
  with pytest.raises(openai.NotFoundError) as e:
    client.chat.completions.create(model="gpt-4", messages=_chat("hi"))
  assert e.value.body["code"] == "model_not_found"
  # a bounded queue: with room for one request, a second one while the first streams gets 503
  with _limits(server, max_pending=1):
    with httpx.stream("POST", server.url + "/v1/completions", json={
        "model": NAME, "prompt": "The harbour", "max_tokens": 60, "ignore_eos": True, "stream": True}) as s:
      next(s.iter_lines())
      r = httpx.post(server.url + "/v1/completions", json={"model": NAME, "prompt": "x", "max_tokens": 2})
      assert r.status_code == 503 and r.json()["error"]["code"] == "overloaded"
  assert _idle(engine)


def test_disconnect_mid_stream_frees_pages(setup):
  _, _, engine, server, _ = setup
  body = {"model": NAME, "messages": _chat("Tell me a long story."), "max_tokens": 200,
          "ignore_eos": True, "stream": True}
  with httpx.stream("POST", server.url + "/v1/chat/completions", json=body) as s:
    lines = s.iter_lines()
    got = [next(lines) for _ in range(6)]
    assert all(x.startswith("data: ") or not x for x in got)
    assert engine.has_unfinished()
  assert _idle(engine)  # aborted long before 200 tokens; every page back in the pool


def test_32_concurrent_streaming_clients(setup):
  model, tok, engine, _, client = setup
  questions = [f"Question {i}: what colour is the lighthouse number {i}?" for i in range(32)]
  params = [dict(temperature=0) if i % 2 == 0 else
            dict(temperature=0.8, top_p=0.9, seed=i, extra_body={"top_k": 20, "min_p": 0.01})
            for i in range(32)]
  hits0 = engine.cache.alloc.hits

  def one(i):
    s = client.chat.completions.create(model=NAME, messages=_chat(questions[i]), max_tokens=6,
                                       stream=True, **params[i])
    text, reason = "", None
    for c in s:
      if c.choices:
        text += c.choices[0].delta.content or ""
        reason = c.choices[0].finish_reason or reason
    return text, reason

  with concurrent.futures.ThreadPoolExecutor(32) as pool:
    results = list(pool.map(one, range(32)))
  assert all(reason in ("stop", "length") for _, reason in results)
  greedy = [i for i in range(32) if i % 2 == 0]
  ref = generate(model, [_chat(questions[i]) for i in greedy], tokenizer=tok, max_new_tokens=6)
  assert [results[i][0] for i in greedy] == ref.text
  assert _idle(engine) and engine.cache.alloc.hits > hits0 and engine.cache.alloc.hit_rate > 0
  assert np.mean([len(t) > 0 for t, _ in results]) > 0.5


def test_one_clients_bad_data_fails_that_request_alone(setup):
  """A lone surrogate in a chat message (valid JSON; the tokenizer raises on it) gets a 400 and
  the engine thread keeps serving; a seed beyond uint32 gets a 400 naming ``seed`` before it is
  queued, instead of failing every in-flight request mid-step. Both failed on main before."""
  _, _, engine, server, client = setup
  body = '{"model": "%s", "max_tokens": 4, "messages": [{"role": "user", "content": "a\\ud800b"}]}' % NAME
  r = httpx.post(server.url + "/v1/chat/completions", content=body,
                 headers={"content-type": "application/json"}, timeout=30)
  assert r.status_code == 400 and "tokenized" in r.json()["error"]["message"], r.text
  with concurrent.futures.ThreadPoolExecutor(4) as pool:  # a bad seed among well-formed clients
    good = [pool.submit(client.completions.create, model=NAME, prompt="The sea", max_tokens=12,
                        temperature=0.7, seed=i) for i in range(3)]
    with pytest.raises(openai.BadRequestError) as e:
      client.completions.create(model=NAME, prompt="The sea", max_tokens=4, seed=2**40)
    assert e.value.body["param"] == "seed"
    assert all(len(f.result(timeout=60).choices[0].text) >= 0 for f in good)
  # the largest uint32 seed is accepted and samples
  out = client.completions.create(model=NAME, prompt="The sea", max_tokens=3, seed=2**32 - 1, temperature=1.0)
  assert out.usage.completion_tokens == 3
  assert client.completions.create(model=NAME, prompt="still serving", max_tokens=2).choices
  assert _idle(engine)


def test_malformed_fields_are_400s_that_leave_nothing_queued(setup):
  """``stop=5``, ``stream_options`` as a string and a content part with a non-string text each
  get a 400 naming the field (they were a Python message, and bare 500s whose request kept
  running and filled the queue); afterwards nothing is pending and every page is free."""
  _, _, engine, server, _ = setup
  url = server.url + "/v1/chat/completions"
  msgs = _chat("hi")
  cases = [({"stop": 5}, "stop"), ({"stream": True, "stream_options": "yes"}, "stream_options"),
           ({"messages": [{"role": "user", "content": [{"type": "text", "text": 7}]}]}, "messages")]
  for extra, param in cases:
    body = {"model": NAME, "messages": msgs, "max_tokens": 40, "ignore_eos": True, **extra}
    r = httpx.post(url, json=body, timeout=30)
    assert r.status_code == 400, (extra, r.status_code, r.text)
    assert r.json()["error"]["param"] == param, r.text
  assert server.loop.num_pending == 0
  assert _idle(engine)


def test_a_non_streaming_client_that_gives_up_frees_its_work(setup):
  """Four non-streaming clients time out after 0.5 s: their requests are aborted within a poll
  (they used to run to max_tokens holding their pages and max_pending slots); ``n`` above
  ``--max-n`` is a 400, and admission counts sequences."""
  _, _, engine, server, client = setup
  body = {"model": NAME, "prompt": "The harbour", "max_tokens": 200, "ignore_eos": True}
  for _ in range(4):
    with pytest.raises(httpx.TimeoutException):
      httpx.post(server.url + "/v1/completions", json=body, timeout=0.5)
  end = time.time() + 30  # within a poll (0.25 s) once the engine thread takes the abort
  while server.loop.num_pending and time.time() < end:
    time.sleep(0.05)
  assert server.loop.num_pending == 0, (server.loop.num_pending, engine.has_unfinished())
  assert _idle(engine)
  with pytest.raises(openai.BadRequestError) as e:
    client.completions.create(model=NAME, prompt="x", max_tokens=2, n=server.loop.limits.max_n + 1)
  assert e.value.body["param"] == "n"
  with _limits(server, max_pending=3):
    r = httpx.post(server.url + "/v1/completions", json={**body, "max_tokens": 2, "n": 4}, timeout=30)
    assert r.status_code == 503  # 4 sequences > 3, though it is one request


def test_unsupported_fields_are_refused_not_ignored(setup):
  """A field the server does not implement is a 400 naming it (it used to be dropped silently);
  fields at a neutral value pass."""
  _, _, engine, server, _ = setup
  url = server.url + "/v1/chat/completions"
  base = {"model": NAME, "messages": _chat("hi"), "max_tokens": 2}
  refused = [({"tools": [{"type": "function"}]}, "tools"),
             ({"logit_bias": {"x": 10}}, "logit_bias"), ({"response_format": {"type": "xml"}},
                                                          "response_format"),
             ({"frobnicate": 1}, "frobnicate"), ({"user": 7}, "user"), ({"suffix": "x"}, "suffix")]
  for extra, param in refused:
    r = httpx.post(url, json={**base, **extra}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, (extra, r.text)
    assert param in r.json()["error"]["message"]
  r = httpx.post(server.url + "/v1/completions", json={"model": NAME, "prompt": "x", "suffix": "y"}, timeout=30)
  assert r.status_code == 400 and r.json()["error"]["param"] == "suffix"
  neutral = {"user": "u-1", "tool_choice": "none", "response_format": {"type": "text"}, "logit_bias": {},
             "store": False, "service_tier": "auto", "tools": None}
  r = httpx.post(url, json={**base, **neutral}, timeout=30)
  assert r.status_code == 200, r.text
  assert _idle(engine)


# Every field of the official client's request schemas that the server honours, and the test that
# checks it; every other field must be refused with a 400 naming it.
HONOURED = {
    "model": "test_errors_have_openai_shape", "messages": "test_chat_streaming_equals_non_streaming_and_models",
    "prompt": "test_a_non_streaming_client_that_gives_up_frees_its_work",
    "stream": "test_chat_streaming_equals_non_streaming_and_models",
    "stream_options": "test_chat_streaming_equals_non_streaming_and_models",
    "max_tokens": "test_errors_have_openai_shape", "max_completion_tokens": "test_malformed_fields_are_400s_that_leave_nothing_queued",
    "temperature": "test_n_stop_and_logprobs", "top_p": "test_errors_have_openai_shape", "n": "test_n_stop_and_logprobs",
    "stop": "test_n_stop_and_logprobs", "seed": "test_n_stop_and_logprobs", "logprobs": "test_n_stop_and_logprobs",
    "top_logprobs": "test_n_stop_and_logprobs",
    "frequency_penalty": "test_logit_bias_and_penalties_through_the_batched_engine",
    "presence_penalty": "test_logit_bias_and_penalties_through_the_batched_engine",
    "logit_bias": "test_logit_bias_and_penalties_through_the_batched_engine",
    "response_format": "test_structured_outputs_follow_their_grammar", "tools": "test_tool_call_round_trip",
    "tool_choice": "test_tool_call_round_trip", "parallel_tool_calls": "test_tool_call_round_trip",
    "user": "test_unsupported_fields_are_refused_not_ignored",
    "safety_identifier": "test_request_schema_fields_are_honoured_or_refused",
    "prompt_cache_key": "test_request_schema_fields_are_honoured_or_refused",
}


def test_request_schema_fields_are_honoured_or_refused(setup):
  """Walks the official client's chat and completions request schemas field by field: a field is
  either honoured (and HONOURED names the test that checks it) or refused with a 400 naming it."""
  from openai.types import completion_create_params as text_params
  from openai.types.chat import completion_create_params as chat_params

  from jaxsys.serving.openai_protocol import CHAT_FIELDS, TEXT_FIELDS
  _, _, engine, server, _ = setup
  for route, params, fields, base in (
      ("/v1/chat/completions", chat_params, CHAT_FIELDS, {"messages": _chat("hi")}),
      ("/v1/completions", text_params, TEXT_FIELDS, {"prompt": "hi"})):
    schema = set(params.CompletionCreateParamsBase.__annotations__) | {"stream"}
    for name in sorted(schema):
      if name in fields:
        assert callable(globals().get(HONOURED[name])), name
        continue
      r = httpx.post(server.url + route, json={"model": NAME, "max_tokens": 2, **base, name: "__unsupported__"},
                     timeout=30)
      assert r.status_code == 400 and r.json()["error"]["param"] == name, (route, name, r.text)
  ok = httpx.post(server.url + "/v1/chat/completions", timeout=30, json={
      "model": NAME, "messages": _chat("hi"), "max_tokens": 2, "safety_identifier": "u-1", "prompt_cache_key": "k"})
  assert ok.status_code == 200, ok.text
  assert _idle(engine)


def test_api_key_server_defaults_and_system(setup):
  """--api-key: every /v1 route answers 401 without the Bearer key (health, version, metrics and
  tokenize stay open); server-side defaults fill the fields a request omits, and --system leads a
  chat without one. A second front end over the same (idle) engine."""
  from jaxsys.serving.openai_server import start_server
  _, _, engine, _, client = setup
  keyed = start_server(engine, NAME, api_key="s3cret", defaults={"temperature": 0}, system=SYSTEM["content"])
  try:
    anon = openai.OpenAI(base_url=keyed.url + "/v1", api_key="wrong", max_retries=0)
    for call in (lambda: anon.models.list(),
                 lambda: anon.chat.completions.create(model=NAME, messages=_chat("hi"), max_tokens=2),
                 lambda: anon.embeddings.create(model=NAME, input="hi")):
      with pytest.raises(openai.AuthenticationError) as e:
        call()
      assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
    assert httpx.post(keyed.url + "/v1/completions", json={"model": NAME, "prompt": "x"}).status_code == 401
    for path in ("/health", "/version", "/metrics"):
      assert httpx.get(keyed.url + path).status_code == 200, path
    ok = openai.OpenAI(base_url=keyed.url + "/v1", api_key="s3cret", max_retries=0)
    # no temperature, no system message: the server's defaults make it the greedy reply to _chat(...)
    got = ok.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Is the tide in?"}],
                                     max_tokens=6).choices[0].message.content
  finally:
    keyed.stop()
  want = client.chat.completions.create(model=NAME, messages=_chat("Is the tide in?"), max_tokens=6,
                                        temperature=0).choices[0].message.content
  assert got == want
  assert _idle(engine)


def test_tokenize_detokenize_version_embeddings_and_metrics(setup):
  from prometheus_client.parser import text_string_to_metric_families

  import jaxsys
  from jaxsys.serving.generation import embed
  model, tok, engine, server, client = setup
  u = server.url
  assert httpx.get(u + "/version").json() == {"version": jaxsys.__version__}
  r = httpx.post(u + "/tokenize", json={"model": NAME, "prompt": "Café 😀  x"}).json()
  assert r["tokens"] == tok.encode("Café 😀  x") and r["count"] == len(r["tokens"]) and r["max_model_len"] == 256
  chat = httpx.post(u + "/tokenize", json={"model": NAME, "messages": _chat("hi")}).json()["tokens"]
  assert chat == tok.apply_chat_template(_chat("hi"), add_generation_prompt=True)
  assert httpx.post(u + "/detokenize", json={"model": NAME, "tokens": r["tokens"]}).json() == {"prompt": "Café 😀  x"}
  for path, body, param in (("/tokenize", {"prompt": 5}, "prompt"), ("/detokenize", {"tokens": [-1]}, "tokens"),
                            ("/tokenize", {"prompt": "x", "frob": 1}, "frob")):
    bad = httpx.post(u + path, json={"model": NAME, **body})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == param, bad.text
  # /v1/embeddings: mean-pooled final hidden states, base64 (the client's default) or float
  texts = ["The harbour at dawn.", "Boats"]
  got = client.embeddings.create(model=NAME, input=texts)
  want, counts = embed(model, texts, tokenizer=tok)
  assert [d.index for d in got.data] == [0, 1] and got.usage.prompt_tokens == sum(counts)
  np.testing.assert_allclose(np.array([d.embedding for d in got.data]), want, rtol=1e-5, atol=1e-6)
  ids = client.embeddings.create(model=NAME, input=[tok.encode("Boats")], encoding_format="float")
  np.testing.assert_allclose(ids.data[0].embedding, want[1], rtol=1e-5, atol=1e-6)
  with pytest.raises(openai.BadRequestError) as e:
    client.embeddings.create(model=NAME, input="x", dimensions=8)
  assert e.value.body["param"] == "dimensions"
  # /metrics: parsed by prometheus_client; tokens and latencies counted, the pool's pages add up
  client.completions.create(model=NAME, prompt="The harbour", max_tokens=3, temperature=0)
  assert _idle(engine)
  fams = {f.name: f for f in text_string_to_metric_families(httpx.get(u + "/metrics").text)}
  value = lambda name, suffix="": sum(s.value for s in fams[name].samples if s.name == name + suffix)  # noqa: E731
  assert value("jaxsys_kv_pages_used") + value("jaxsys_kv_pages_free") == PAGES
  assert value("jaxsys_requests_waiting") == value("jaxsys_requests_running") == 0
  assert value("jaxsys_generation_tokens", "_total") >= 3 and value("jaxsys_prompt_tokens", "_total") >= 2
  assert value("jaxsys_time_to_first_token_seconds", "_count") >= 1
  assert value("jaxsys_inter_token_latency_seconds", "_count") >= 2
  assert value("jaxsys_preemptions", "_total") >= 0 and "jaxsys_preemptions" in fams
  assert any(s.labels == {"endpoint": "/v1/completions", "status": "200"} and s.value >= 1
             for s in fams["jaxsys_requests"].samples)


def test_logit_bias_and_penalties_through_the_batched_engine(setup):
  """logit_bias +100 forces a token; with a +10 bias greedy repeats the token, and frequency +
  presence penalties stop it after a few; a seeded sampled reply with penalties is the same twice;
  a plain request sharing the batch with penalized ones gets its solo reply (rows are independent)."""
  _, tok, engine, _, client = setup
  x = tok.encode(" harbour")[0]
  base = dict(model=NAME, messages=_chat("Weather?"), max_tokens=12, temperature=0)
  forced = client.completions.create(model=NAME, prompt="The", max_tokens=4, temperature=0, logit_bias={str(x): 100})
  assert forced.choices[0].text == tok.decode([x] * 4)

  biased = client.chat.completions.create(**base, logit_bias={str(x): 10}).choices[0].message.content
  assert biased == tok.decode([x] * 12)
  plain = client.chat.completions.create(**base).choices[0].message.content
  pen = dict(logit_bias={str(x): 10}, frequency_penalty=2.0, presence_penalty=2.0)
  with concurrent.futures.ThreadPoolExecutor(2) as ex:  # penalized and plain rows in the same steps
    both = [ex.submit(lambda: client.chat.completions.create(**base, **pen).choices[0].message.content),
            ex.submit(lambda: client.chat.completions.create(**base).choices[0].message.content)]
    penalized, plain_again = (f.result() for f in both)
  assert plain_again == plain
  assert penalized.count(" harbour") <= 4 and penalized != biased
  seeded = dict(base, temperature=1.0, seed=11, frequency_penalty=1.0, extra_body={"repetition_penalty": 1.3})
  first = client.chat.completions.create(**seeded).choices[0].message.content
  assert client.chat.completions.create(**seeded).choices[0].message.content == first
  assert _idle(engine)


PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "ok"],
          "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "minimum": 0,
                                                                            "maximum": 150},
                         "ok": {"type": "boolean"}}}


def test_structured_outputs_follow_their_grammar(setup):
  """response_format json_schema: 20 sampled replies (8 at a time, beside plain rows) all parse and
  validate; json_object gives an object; vLLM's guided_choice / guided_regex hold; bad specs are 400s."""
  import json
  _, _, engine, _, client = setup
  fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}

  def person(i):
    r = client.chat.completions.create(model=NAME, messages=_chat(f"Describe sailor number {i}."), max_tokens=64,
                                       temperature=1.0, seed=i, response_format=fmt).choices[0]
    return r.finish_reason, json.loads(r.message.content)

  with concurrent.futures.ThreadPoolExecutor(8) as ex:
    plain = ex.submit(lambda: client.chat.completions.create(model=NAME, messages=_chat("Boats?"), max_tokens=8,
                                                             temperature=0).choices[0].message.content)
    people = list(ex.map(person, range(20)))
  for reason, obj in people:
    assert reason == "stop" and set(obj) == {"name", "age", "ok"}, obj
    assert isinstance(obj["name"], str) and len(obj["name"]) <= 8 and isinstance(obj["ok"], bool)
    assert isinstance(obj["age"], int) and 0 <= obj["age"] <= 150
  assert plain.result() == client.chat.completions.create(model=NAME, messages=_chat("Boats?"), max_tokens=8,
                                                          temperature=0).choices[0].message.content
  obj = client.chat.completions.create(model=NAME, messages=_chat("JSON please"), max_tokens=48, temperature=0,
                                       response_format={"type": "json_object"}).choices[0]
  assert obj.finish_reason == "length" or isinstance(json.loads(obj.message.content), dict)
  choice = client.completions.create(model=NAME, prompt="The tide is", max_tokens=8, temperature=1.0, seed=3,
                                     extra_body={"guided_choice": ["in", "out", "turning"]}).choices[0].text
  assert choice in ("in", "out", "turning")
  code = client.completions.create(model=NAME, prompt="Code:", max_tokens=8, temperature=1.0, seed=4,
                                   extra_body={"guided_regex": "[A-Z]{2}-[0-9]{3}"}).choices[0].text
  assert re.fullmatch("[A-Z]{2}-[0-9]{3}", code), code
  for extra, param in (({"response_format": {"type": "xml"}}, "response_format"),
                       ({"response_format": {"type": "json_schema"}}, "response_format"),
                       ({"extra_body": {"guided_regex": "("}}, "guided_regex"),
                       ({"response_format": {"type": "json_object"}, "extra_body": {"guided_choice": ["a"]}},
                        "response_format")):
    with pytest.raises(openai.BadRequestError) as e:
      client.chat.completions.create(model=NAME, messages=_chat("hi"), max_tokens=2, **extra)
    assert e.value.body["param"] == param, (extra, e.value.body)
  assert _idle(engine)


def test_packed_grammar_mask_is_the_mask(setup):
  """What a step copies to the device (llguidance's packed words) unpacks to the boolean mask, at
  the start of a schema and after a few tokens (the vocab is not a multiple of 32 here: 49152 is,
  so the last word is checked with a cut vocabulary too)."""
  from jaxsys.decoding.sampling import unpack_allowed
  from jaxsys.serving.structured import Constraint, grammar_for, ll_tokenizer
  _, _, engine, _, _ = setup
  tok, vocab = engine.tokenizer, engine.model.config.vocab_size
  c = Constraint(ll_tokenizer(tok, vocab, [tok.eos_token_id]), grammar_for(json_schema=PERSON))
  for t in [None] + tok.encode('{"name":"Ann"', add_special_tokens=False):
    if t is not None:
      c.advance(t)
    want = c.allowed(vocab)
    for v in (vocab, vocab - 7):
      got = np.asarray(unpack_allowed(c.allowed_bits(-(-v // 32))[None], v))[0]
      np.testing.assert_array_equal(got, want[:v])
    assert 0 < want.sum() < vocab


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                   "properties": {"city": {"type": "string", "maxLength": 10}}}}}


def test_tool_call_round_trip(setup):
  """tools + tool_choice: a named function (and 'required') is called with arguments that follow its
  schema; the call and the tool's result go back in the chat and the final answer is text; 'none'
  and 'auto' give text for this model; bad tool specs are 400s naming the field."""
  import json
  _, _, engine, _, client = setup
  messages = _chat("What is the weather in Oslo?")
  first = client.chat.completions.create(model=NAME, messages=messages, tools=[WEATHER], max_tokens=48,
                                         temperature=0, tool_choice={"type": "function",
                                                                     "function": {"name": "get_weather"}})
  choice = first.choices[0]
  assert choice.finish_reason == "tool_calls" and choice.message.content is None
  (call,) = choice.message.tool_calls
  args = json.loads(call.function.arguments)
  assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
  assert set(args) == {"city"} and isinstance(args["city"], str) and len(args["city"]) <= 10
  # streamed: the same call, as a tool_calls delta, then finish_reason tool_calls
  chunks = list(client.chat.completions.create(
      model=NAME, messages=messages, tools=[WEATHER], max_tokens=48, temperature=0, stream=True,
      stream_options={"include_usage": True}, tool_choice={"type": "function", "function": {"name": "get_weather"}}))
  deltas = [c.choices[0] for c in chunks if c.choices]
  assert [d.finish_reason for d in deltas] == [None, "tool_calls"] and chunks[-1].usage.completion_tokens > 0
  (streamed,) = deltas[0].delta.tool_calls
  assert (streamed.function.name, streamed.function.arguments) == (call.function.name, call.function.arguments)
  required = client.chat.completions.create(model=NAME, messages=messages, tools=[WEATHER], max_tokens=48,
                                            temperature=1.0, seed=2, tool_choice="required").choices[0]
  assert required.finish_reason == "tool_calls" and required.message.tool_calls[0].function.name == "get_weather"
  history = messages + [choice.message.model_dump(exclude_none=True),
                        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temp_c": 11})}]
  final = client.chat.completions.create(model=NAME, messages=history, tools=[WEATHER], max_tokens=6,
                                         temperature=0, tool_choice="none").choices[0]
  assert final.message.tool_calls is None and isinstance(final.message.content, str)
  assert final.finish_reason in ("stop", "length")
  auto = client.chat.completions.create(model=NAME, messages=history, tools=[WEATHER], max_tokens=6,
                                        temperature=0).choices[0]
  assert auto.message.content == final.message.content  # a random model's text is not a call
  for kw, param in ((dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}),
                     "tool_choice"),
                    (dict(tool_choice="required"), "tool_choice"),
                    (dict(tools=[{"type": "function", "function": {"name": "bad name!"}}]), "tools"),
                    (dict(tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"}),
                     "tool_choice")):
    with pytest.raises(openai.BadRequestError) as e:
      client.chat.completions.create(model=NAME, messages=messages, max_tokens=4, **kw)
    assert e.value.body["param"] == param, (kw, e.value.body)
  assert _idle(engine)


def test_request_timeout_aborts_and_frees_pages(setup):
  """--request-timeout: a request still running at its deadline is aborted (pages freed); a
  non-streamed one gets a 408, a stream an error event; requests within it are untouched."""
  _, _, engine, server, client = setup
  long = {"model": NAME, "prompt": "The harbour", "max_tokens": 240, "ignore_eos": True}
  with _limits(server, request_timeout=0.3):
    t0 = time.perf_counter()
    r = httpx.post(server.url + "/v1/completions", json=long, timeout=60)
    assert r.status_code == 408 and r.json()["error"]["code"] == "request_timeout", r.text
    assert time.perf_counter() - t0 < 10
    assert _idle(engine)
    with httpx.stream("POST", server.url + "/v1/completions", json={**long, "stream": True}, timeout=60) as s:
      lines = [x for x in s.iter_lines() if x.startswith("data: ")]
    assert any("request_timeout" in x for x in lines) and lines[-1] == "data: [DONE]"
    assert _idle(engine)
  with _limits(server, request_timeout=60.0):
    out = client.completions.create(model=NAME, prompt="x", max_tokens=3, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 3
  with pytest.raises(Exception, match="request_timeout"):
    dataclasses.replace(server.loop.limits, request_timeout=0)


def test_soak_with_abusive_clients_completes_every_well_formed_request(setup):
  """jaxsys.serving.soak: 16 concurrent clients, 30% of 40 requests abusive (every kind, the
  disconnecting stream included): every well-formed request completes, no abusive one gets a
  5xx, and the engine ends idle with every page free."""
  from jaxsys.serving.soak import ABUSE, SoakConfig, soak
  _, _, engine, server, _ = setup
  prompts = [f"Tell me about the harbour, number {i}." for i in range(40)]
  res = soak(server.url, NAME, prompts, SoakConfig(clients=16, requests=40, abusive=0.3, max_tokens=2))
  assert res["well_formed"] == 28 and res["completed"] == 28 and res["abuse_5xx"] == 0, res
  assert set(res["abuse"]) == set(ABUSE)
  assert all(code.startswith("4") for kind, codes in res["abuse"].items() if kind != "disconnect"
             for code in codes), res["abuse"]
  assert server.loop.alive and _idle(engine)


class _DeadEngine:
  """An engine whose thread dies at once (as on a lost device)."""
  tokenizer = None

  def has_unfinished(self):
    raise RuntimeError("device lost")


def test_a_stopped_engine_thread_is_reported_not_hidden():
  """If the engine thread ever stops, /health answers 503 with the reason and new requests get a
  503, instead of a healthy status over a server where every request hangs."""
  from fastapi.testclient import TestClient

  from jaxsys.serving.openai_server import EngineLoop, build_app

  loop = EngineLoop(_DeadEngine())
  loop.thread.join(timeout=10)
  assert not loop.alive and "device lost" in loop.failure
  with TestClient(build_app(loop, "m")) as http:
    r = http.get("/health")
    assert r.status_code == 503 and "device lost" in r.json()["error"]
    r = http.post("/v1/completions", json={"model": "m", "prompt": [1, 2], "max_tokens": 2})
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_stopped"


def test_serve_shuts_down_with_exit_code_1_when_the_engine_thread_dies():
  """``jaxsys serve``'s server stops itself (exit code 1 for a supervisor) once its engine thread
  has died, instead of answering 503 forever."""
  import threading

  from jaxsys.serving.openai_server import serve
  codes = []
  t = threading.Thread(target=lambda: codes.append(serve(_DeadEngine(), "m", port=0)), daemon=True)
  t.start()
  t.join(timeout=60)
  assert not t.is_alive() and codes == [1]


def _fuzz_bodies():
  """Request bodies a careless or hostile client sends: wrong types, huge and negative numbers,
  NaN, lone surrogates, nested garbage, unknown fields; about half are well-formed enough to run."""
  from hypothesis import strategies as st
  junk = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats()
                      | st.text(max_size=8), lambda c: st.lists(c, max_size=3)
                      | st.dictionaries(st.text(max_size=4), c, max_size=3), max_leaves=6)
  text = st.text(st.characters(codec=None, categories=("L", "N", "P", "Zs", "Cs", "Co", "So")), max_size=24)
  number = st.one_of(st.integers(-3, 6), st.integers(-2**64, 2**64), st.floats(), text, junk)
  part = st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url", "x"]), "text": text | junk})
  content = text | st.lists(part, max_size=3) | junk
  message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", 3]),
                                   "content": content}) | junk
  fields = {"max_tokens": st.integers(-2, 4) | number, "temperature": st.floats(0, 2) | number,
            "top_p": st.floats(0, 1) | number, "n": st.integers(-1, 20) | number,
            "seed": st.integers(-5, 2**40) | number, "stop": text | st.lists(text, max_size=3) | junk,
            "stream": st.booleans() | junk, "stream_options": junk, "logprobs": st.booleans() | number,
            "top_logprobs": number, "top_k": number, "min_p": number, "ignore_eos": st.booleans() | junk,
            "stop_token_ids": junk, "echo": junk, "user": junk, "unknown_field": junk}
  chat = st.fixed_dictionaries({"model": st.just(NAME) | text, "messages": st.lists(message, max_size=3) | junk},
                               optional=fields)
  completion = st.fixed_dictionaries({"model": st.just(NAME) | text,
                                      "prompt": text | st.lists(st.integers(-5, 70000), max_size=6) | junk},
                                     optional=fields)
  return st.tuples(st.just("chat/completions"), chat) | st.tuples(st.just("completions"), completion)


FUZZ_EXAMPLES = 2000


def test_fuzzed_bodies_never_hurt_the_server(setup):
  """``FUZZ_EXAMPLES`` generated bodies (fixed seed): every reply is a 2xx or a 4xx (no 5xx from a body), the
  engine thread stays up, and after them a normal request answers and every page is free."""
  import json

  from hypothesis import HealthCheck, given, settings
  _, _, engine, server, client = setup
  http = httpx.Client(base_url=server.url + "/v1", timeout=60)
  statuses = collections.Counter()

  @settings(max_examples=FUZZ_EXAMPLES, derandomize=True, deadline=None, database=None,
            suppress_health_check=list(HealthCheck))
  @given(_fuzz_bodies())
  def case(req):
    path, body = req
    # bound the work of the well-formed ones: an omitted max_tokens means up to 256 per choice
    if "max_tokens" not in body or (isinstance(body["max_tokens"], int) and 4 < body["max_tokens"] < 2**31):
      body["max_tokens"] = 4
    r = http.post(path, content=json.dumps(body, allow_nan=True),
                  headers={"content-type": "application/json"})
    statuses[r.status_code // 100] += 1
    assert r.status_code < 500, (r.status_code, r.text[:300], body)

  try:
    case()
  finally:
    http.close()
  assert server.loop.alive and sum(statuses.values()) >= FUZZ_EXAMPLES and statuses[2] > 20, statuses
  assert client.completions.create(model=NAME, prompt="The sea", max_tokens=3).choices[0].text is not None
  assert _idle(engine)
