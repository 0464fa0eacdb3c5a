"""Generation: greedy parity with transformers' generate, sampling, stops, buckets, hidden states."""

import importlib
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "models"))
import _hf_utils as U  # noqa: E402

import jaxsys.models as M  # noqa: E402
from jaxsys.core.errors import ConfigError, InputError  # noqa: E402
G = importlib.import_module("jaxsys.serving.generation")  # the module (the package exports the function)
from jaxsys.nn.rope import RopeConfig  # noqa: E402
from jaxsys.decoding.cache import KVCache  # noqa: E402
from jaxsys.decoding.sampling import SamplingParams, sample_logits  # noqa: E402

PROMPTS = [[5, 17, 33], [8, 9, 10, 11, 12, 13, 14, 15, 16, 40, 41], [60, 2, 7, 7, 90, 3, 21]]


@pytest.mark.parametrize("name", ["llama_gqa_llama3", "qwen2_bias_yarn_swa"])
def test_greedy_matches_transformers_generate(name):
  torch = pytest.importorskip("torch")
  hf = U.hf_model(name, seed=1)
  hf.generation_config.eos_token_id = None
  model = M.from_hf_model(hf)
  res = G.generate(model, PROMPTS, max_new_tokens=32, stop_tokens=())
  for p, got in zip(PROMPTS, res.tokens):
    ref = hf.generate(torch.tensor([p]), max_new_tokens=32, do_sample=False, pad_token_id=0)
    assert got == ref[0, len(p):].tolist()


@pytest.fixture(scope="module")
def model():
  cfg = M.DecoderConfig(vocab_size=97, hidden_size=32, intermediate_size=48, num_layers=2,
                        num_heads=4, num_kv_heads=2, eos_token_id=3)
  return M.random_model(cfg, seed=7)


def test_logprobs_and_hidden_match_full_forward(model):
  res = G.generate(model, PROMPTS[:2], max_new_tokens=6, stop_tokens=(), return_hidden=True,
                   sampling=SamplingParams(temperature=1.5, seed=3))
  for p, toks, lp, hid in zip(PROMPTS[:2], res.tokens, res.logprobs, res.hidden):
    seq = jnp.asarray([p + toks])
    out = model(seq, return_hidden=True)
    logp = jax.nn.log_softmax(out.logits[0], -1)
    rows = np.arange(len(p) - 1, len(p) - 1 + len(toks))
    np.testing.assert_allclose(lp, np.asarray(logp[rows, np.asarray(toks)]), atol=1e-5)
    np.testing.assert_allclose(hid, np.asarray(out.hidden[0, rows]), atol=1e-5)


def test_sampling_seeded_topk_and_stops(model):
  s = SamplingParams(temperature=2.0, top_k=5, top_p=0.9, seed=11)
  a = G.generate(model, PROMPTS, max_new_tokens=12, sampling=s, stop_tokens=())
  b = G.generate(model, PROMPTS, max_new_tokens=12, sampling=s, stop_tokens=())
  c = G.generate(model, PROMPTS, max_new_tokens=12, sampling=SamplingParams(2.0, seed=12), stop_tokens=())
  assert a.tokens == b.tokens and a.tokens != c.tokens
  greedy = G.generate(model, PROMPTS, max_new_tokens=12, stop_tokens=())
  top1 = G.generate(model, PROMPTS, max_new_tokens=12, sampling=SamplingParams(top_k=1), stop_tokens=())
  assert greedy.tokens == top1.tokens
  stop = greedy.tokens[1][4]
  res = G.generate(model, PROMPTS, max_new_tokens=12, stop_tokens=(stop,))
  assert res.tokens[1] == greedy.tokens[1][:greedy.tokens[1].index(stop) + 1] and res.finished[1]
  assert all(len(t) <= 12 for t in res.tokens)


def test_topk_topp_filtering():
  logits = jnp.log(jnp.asarray([[0.5, 0.3, 0.15, 0.05]]))
  keys = jax.random.split(jax.random.key(0), 400)
  draw = jax.vmap(lambda k: sample_logits(k, logits, greedy=False, top_p=0.7))(keys)
  assert set(np.unique(np.asarray(draw)).tolist()) == {0, 1}
  draw = jax.vmap(lambda k: sample_logits(k, logits, greedy=False, top_k=3))(keys)
  assert set(np.unique(np.asarray(draw)).tolist()) == {0, 1, 2}


def test_bucketed_shapes_do_not_recompile(model):
  G.generate(model, [[1, 2, 3]], max_new_tokens=5)
  before = dict(G.TRACE_COUNTS)
  G.generate(model, [[4, 5, 6, 7, 8, 9, 10]], max_new_tokens=9)  # same buckets (16, 16)
  assert G.TRACE_COUNTS == before
  G.generate(model, [list(range(4, 24))], max_new_tokens=5)     # prompt bucket 32
  assert G.TRACE_COUNTS["decoding.prefill"] == before["decoding.prefill"] + 1


def test_decode_step_donates_and_matches(model):
  cache = KVCache.init(model.config, 1, 16)
  logits, _, cache = G.decode_step(model, cache, [[5, 17, 33]])
  full = model(jnp.asarray([[5, 17, 33, 8]]))
  logits2, _, cache2 = G.decode_step(model, cache, [[8]])
  assert cache.k[0].is_deleted()  # donated: updated in place
  np.testing.assert_allclose(np.asarray(logits2[0, 0]), np.asarray(full[0, 3]), atol=1e-5)
  assert int(cache2.lengths[0]) == 4


def test_bad_input(model):
  with pytest.raises(InputError, match="prompts"):
    G.generate(model, [], max_new_tokens=2)
  with pytest.raises(InputError, match=r"prompts\[1\]"):
    G.generate(model, [[1], [97]], max_new_tokens=2)
  with pytest.raises(ConfigError, match="max_new_tokens"):
    G.generate(model, [[1]], max_new_tokens=0)
  with pytest.raises(ConfigError, match="temperature"):
    SamplingParams(temperature=-1.0)


def test_prompt_plus_new_tokens_bounded_by_model_context(model):
  """Checked before anything is allocated (max_new_tokens=10**9 once tried to allocate the cache)."""
  with pytest.raises(InputError, match=r"prompts\[1\] has 2040 tokens: \+ max_new_tokens=9 = 2049 "
                                       r"exceeds the model's max_position_embeddings=2048"):
    G.generate(model, [[1], [1] * 2040], max_new_tokens=9)
  with pytest.raises(InputError, match="max_new_tokens=1000000000 .* max_position_embeddings=2048"):
    G.generate(model, [[1, 2, 3]], max_new_tokens=10**9)
  scaled = M.replace_config(model, rope=RopeConfig(kind="linear", factor=4.0))
  assert G.context_length(scaled.config) == 8192
  with pytest.raises(InputError, match=r"context length 8192 \(max_position_embeddings=2048, rope linear x4\)"):
    G.generate(scaled, [[1, 2, 3]], max_new_tokens=8190)
