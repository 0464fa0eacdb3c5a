"""ServingEngine: dense and LServe decode equal a full forward; continuous batching; rejection; CLI."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax._src import dispatch  # the event name only (no public constant)

import jaxsys.models as M
from jaxsys.core.errors import ConfigError
from jaxsys.models.llm._decoder_config import DecoderConfig
from jaxsys.models.llm.decoder import random_model
from jaxsys.serving import ServingEngine, ServingConfig
from jaxsys.serving.lserve import LServeConfig

SMALL = dict(page_size=8, logical_page_size=4, sink=4, window=8)


@pytest.fixture(scope="module")
def model():
  cfg = DecoderConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                      num_heads=4, num_kv_heads=2)
  return random_model(cfg, seed=0)


def _prompts(lengths=(40, 35, 50), seed=0):  # one prompt bucket (64): one prefill compile
  rng = np.random.default_rng(seed)
  return [rng.integers(0, 64, n).tolist() for n in lengths]


def _dense_engine(model):
  return ServingEngine(model, ServingConfig(lserve=LServeConfig(dense=True, token_budget=64, **SMALL),
                                    max_batch=2, num_pages=24, max_seq_len=80))


def test_dense_and_lserve_decode_equal_full_forward(model):
  prompts, news = _prompts(), [4, 7, 5]  # 3 requests, 2 slots: the third joins when one leaves
  dense = _dense_engine(model)
  r1 = dense.generate(prompts, news, return_logits=True, stop_tokens=())
  # LServe with budget >= context and no streaming heads, chunked prefill: exact as well
  ls = ServingEngine(model, ServingConfig(lserve=LServeConfig(token_budget=64, **SMALL), max_batch=2,
                                  num_pages=24, max_seq_len=80, prefill_chunk=32))
  r2 = ls.generate(prompts, news, return_logits=True, stop_tokens=())
  assert [len(t) for t in r1.tokens] == news and r1.tokens == r2.tokens
  seqs = np.zeros((3, 64), np.int32)  # right padding does not change earlier causal logits
  for i, p in enumerate(prompts):
    seqs[i, :len(p) + news[i]] = p + r1.tokens[i]
  graphdef, params = nnx.split(model)
  logits = np.asarray(jax.jit(lambda p, t: nnx.merge(graphdef, p)(t))(params, jnp.asarray(seqs)))
  for i, p in enumerate(prompts):
    full = logits[i, len(p) - 1:len(p) - 1 + news[i]]
    np.testing.assert_allclose(r1.logits[i], full, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(r2.logits[i], r1.logits[i], atol=1e-5, rtol=1e-5)
  for e in (dense, ls):  # every page went back to the pool
    assert e.cache.alloc.num_free == 24 and not e.cache.seqs


def test_selecting_engine_runs_one_decode_executable(model):
  """Page selection active (10 pages a request, a budget of 3): the first step (no selection yet),
  the re-selecting steps and the reusing ones run one decode executable, not one each."""
  ls = ServingEngine(model, ServingConfig(lserve=LServeConfig(token_budget=16, reuse_steps=3, **SMALL),
                                          max_batch=2, num_pages=27, max_seq_len=80))
  assert ls.max_pages > ls.selection.num_select
  compiled = []

  def listener(event, duration, fun_name="", **kw):
    if event == dispatch.BACKEND_COMPILE_EVENT and "_decode_step" in fun_name:
      compiled.append(fun_name)

  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    r = ls.generate(_prompts(), [6, 9, 4], stop_tokens=())
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)
  assert [len(t) for t in r.tokens] == [6, 9, 4]
  assert len(compiled) == 1  # num_pages=27: no other test's executable
  assert ls.cache.alloc.num_free == 27 and not ls.cache.seqs


def test_rejects_request_it_cannot_hold_without_disturbing_others(model):
  prompts = _prompts((40, 90, 45), seed=1)
  res = _dense_engine(model).generate(prompts, 5, stop_tokens=())
  assert res.errors[0] is None and res.errors[2] is None
  assert "max_seq_len=80" in res.errors[1] and res.tokens[1] == []
  alone = _dense_engine(model).generate([prompts[0], prompts[2]], 5, stop_tokens=())
  assert [res.tokens[0], res.tokens[2]] == alone.tokens


def test_streaming_engine_and_config_errors(model, tmp_path):
  flags = [[False, True], [True, False]]
  e = ServingEngine(model, ServingConfig(lserve=LServeConfig(token_budget=24, **SMALL), max_batch=2,
                                 num_pages=24, max_seq_len=80), streaming=flags)
  res = e.generate(_prompts((40, 45)), 6, stop_tokens=())
  assert [len(t) for t in res.tokens] == [6, 6]
  assert e.cache_config.streaming_heads(0).tolist() == [1]
  with pytest.raises(ConfigError, match="max_seq_len=4096"):
    ServingConfig(num_pages=8, max_seq_len=4096)
  with pytest.raises(ConfigError, match="streaming flags"):
    ServingEngine(model, ServingConfig(lserve=LServeConfig(token_budget=24, **SMALL), num_pages=24,
                               max_seq_len=80), streaming=[[True]])


def test_cli_serves_a_prompt_file(model, tmp_path, capsys):
  from jaxsys.serving import cli
  prompts = _prompts((40, 45), seed=1)
  f = tmp_path / "prompts.jsonl"
  f.write_text(json.dumps(prompts[0]) + "\n" + json.dumps({"tokens": prompts[1], "max_new_tokens": 3}) + "\n")
  out = tmp_path / "out.jsonl"
  args = ["--prompts", str(f), "--model", "random", "--dense", "--page-size", "8", "--logical-page", "4",
          "--budget", "64", "--max-batch", "2", "--num-pages", "24", "--max-seq-len", "80",
          "--max-new-tokens", "5", "--out", str(out)]
  assert cli.main(args) == 0
  rows = [json.loads(line) for line in out.read_text().splitlines()]
  ref = _dense_engine(model).generate(prompts, [5, 3])
  assert [r["tokens"] for r in rows] == ref.tokens
  bad = tmp_path / "bad.txt"
  bad.write_text("1 2 x\n")
  assert cli.main(["--prompts", str(bad), "--model", "random"]) == 2
  assert cli.main(args[:-2] + ["--budget", "60"]) == 2  # not a multiple of the page size
  assert "must be a positive multiple of page_size=8" in capsys.readouterr().err


def test_failure_at_any_step_frees_every_page_and_engine_stays_usable(model):
  """An exception or KeyboardInterrupt in any prefill or decode step propagates, every page goes
  back to the pool, and the next call equals a clean engine's output."""
  prompts, news = _prompts(), [4, 7, 5]  # 2 slots: the third request joins mid-run
  engine = _dense_engine(model)
  hooks = {"_decode": engine, "_prefill": engine.scheduler}  # decode steps, prefill chunks
  real = {name: getattr(obj, name) for name, obj in hooks.items()}
  calls = dict.fromkeys(hooks, 0)
  for name, obj in hooks.items():
    def counting(*args, _name=name, **kwargs):
      calls[_name] += 1
      return real[_name](*args, **kwargs)
    setattr(obj, name, counting)
  ref = engine.generate(prompts, news, stop_tokens=())
  for name, obj in hooks.items():
    setattr(obj, name, real[name])
  assert calls["_decode"] > 2 and calls["_prefill"] == len(prompts)
  for name, n in dict(calls).items():
    obj = hooks[name]
    for fail_at in range(n):
      count = [0]

      def failing(*args, _real=real[name], _fail_at=fail_at, **kwargs):
        if count[0] == _fail_at:
          if _fail_at % 2:
            raise KeyboardInterrupt
          if name == "_decode":  # as if interrupted inside the donating call: the pools are gone
            jax.tree.map(lambda x: x.delete(), engine.cache.state)
          raise RuntimeError("injected")
        count[0] += 1
        return _real(*args, **kwargs)

      setattr(obj, name, failing)
      with pytest.raises((RuntimeError, KeyboardInterrupt)):
        engine.generate(prompts, news, stop_tokens=())
      assert engine.cache.alloc.num_free == 24 and not engine.cache.seqs, (name, fail_at)
      assert not engine.has_unfinished(), (name, fail_at)
      setattr(obj, name, real[name])
      again = engine.generate(prompts, news, stop_tokens=())
      assert again.tokens == ref.tokens, (name, fail_at)
  assert engine.cache.alloc.num_free == 24 and engine.cache.stream_alloc.num_free == \
      engine.cache.stream_alloc.num_pages


def test_request_length_bounded_by_max_seq_len_and_model_context(model):
  """prompt + max_new_tokens beyond max_seq_len or the model's max_position_embeddings is
  rejected with a message naming both limits; nothing is allocated for it."""
  short = M.replace_config(model, max_position_embeddings=48)
  e = ServingEngine(short, ServingConfig(lserve=LServeConfig(dense=True, token_budget=64, **SMALL),
                                 max_batch=2, num_pages=24, max_seq_len=80))
  res = e.generate(_prompts((40, 40)), [10, 10**9], stop_tokens=())  # both rejected: no compile
  assert res.tokens == [[], []] and e.cache.alloc.num_free == 24
  for err, total in zip(res.errors, (50, 10**9 + 40)):
    assert f"= {total} tokens" in err and "max_seq_len=80" in err
    assert "max_position_embeddings=48" in err
  assert e.max_seq_len == 48


def test_progress_bar_completes_when_stop_tokens_end_requests_early(model, monkeypatch):
  from jaxsys.serving import engine as engine_mod
  prompts, news = _prompts(), [4, 7, 5]
  ref = _dense_engine(model).generate(prompts, news, stop_tokens=())
  stop = ref.tokens[1][1]  # request 1 stops after at most 2 of its 7 tokens
  bars = []

  def record(enabled, total):
    bars.append(make(enabled, total))
    return bars[-1]

  make = engine_mod._progress
  monkeypatch.setattr(engine_mod, "_progress", record)
  res = _dense_engine(model).generate(prompts, news, stop_tokens=(stop,), progress=True)
  made = sum(len(t) for t in res.tokens)
  assert made < sum(news) and bars[0].n == bars[0].total == made
