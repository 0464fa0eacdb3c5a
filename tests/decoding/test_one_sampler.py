"""One sampling distribution on every path: ``generate`` (the on-device decode loop), the serving
engine (per-row ``sample_rows``) and the reference ``target_probs`` agree for the same
``SamplingParams``, min-p included (``generate`` once dropped it)."""

import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from jaxsys.decoding.sampling import SamplingParams, target_probs
from jaxsys.models import DecoderConfig
from jaxsys.models.llm.decoder import random_model
from jaxsys.serving import ServingConfig, ServingEngine
from jaxsys.serving.generation import generate

CFG = DecoderConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                    num_kv_heads=1, max_position_embeddings=128)
PROMPT = [3, 9, 4, 17, 5]


@pytest.fixture(scope="module")
def model():
  m = random_model(CFG, seed=1)
  # sharper logits than a 0.02-init model gives, so top-p / min-p cut real tokens
  m.lm_head[...] = m.lm_head[...] * 5.0
  return m


def _first_tokens_generate(model, params, n):
  return np.asarray([t[0] for t in generate(model, [PROMPT] * n, max_new_tokens=1, sampling=params,
                                            stop_tokens=()).tokens])


def _first_tokens_engine(model, params, n):
  eng = ServingEngine(model, ServingConfig(max_batch=64, num_pages=140, max_seq_len=32))
  out = []
  for i in range(0, n, 64):
    res = eng.generate([PROMPT] * 64, 1, sampling=SamplingParams(params.temperature, params.top_k, params.top_p,
                                                                 min_p=params.min_p, seed=params.seed + i),
                       stop_tokens=())
    out += [t[0] for t in res.tokens]
  return np.asarray(out[:n])


@pytest.mark.parametrize("params", [SamplingParams(1.0, min_p=0.2, seed=5),
                                    SamplingParams(0.8, top_k=8, top_p=0.9, min_p=0.05, seed=6)])
def test_generate_and_engine_draw_from_target_probs(model, params):
  logits = model(jnp.asarray([PROMPT]))[0, -1]
  p = np.asarray(target_probs(logits, params), np.float64)
  n = 512
  for name, draws in (("generate", _first_tokens_generate(model, params, n)),
                      ("engine", _first_tokens_engine(model, params, n))):
    counts = np.bincount(draws, minlength=CFG.vocab_size)
    assert set(np.flatnonzero(counts)) <= set(np.flatnonzero(p > 0)), name  # nothing filtered is drawn
    keep = p > 0
    pval = stats.chisquare(counts[keep], n * p[keep] / p[keep].sum()).pvalue
    assert pval > 1e-3, (name, pval)


def test_min_p_one_is_greedy_on_every_path(model):
  prompts = [PROMPT, [1, 2, 3]]
  greedy = generate(model, prompts, max_new_tokens=6, stop_tokens=()).tokens
  minp = SamplingParams(1.0, min_p=1.0, seed=11)
  assert generate(model, prompts, max_new_tokens=6, sampling=minp, stop_tokens=()).tokens == greedy
  eng = ServingEngine(model, ServingConfig(max_batch=2, num_pages=16, max_seq_len=32))
  assert eng.generate(prompts, 6, sampling=minp, stop_tokens=()).tokens == greedy


@pytest.mark.parametrize("params", [
    SamplingParams(0.0, frequency_penalty=1.5, presence_penalty=0.5),
    SamplingParams(0.0, repetition_penalty=3.0),
    SamplingParams(0.0, logit_bias={7: 4.0, 2: -100.0}, frequency_penalty=0.3)])
def test_generate_applies_penalties_like_the_engine(model, params):
  """``generate``'s on-device loop carries the penalties' token history itself; greedy, its tokens
  are the serving engine's (which rebuilds the history on the host every step), and they differ
  from plain greedy (the penalties change the output)."""
  prompts = [PROMPT, [1, 2, 3, 1, 2, 3]]
  plain = generate(model, prompts, max_new_tokens=12, stop_tokens=()).tokens
  ours = generate(model, prompts, max_new_tokens=12, sampling=params, stop_tokens=())
  eng = ServingEngine(model, ServingConfig(max_batch=2, num_pages=16, max_seq_len=32))
  assert ours.tokens == eng.generate(prompts, 12, sampling=params, stop_tokens=()).tokens
  assert ours.tokens != plain
  # reported log-probabilities stay the model's own (before penalties), as the server's
  logits = np.asarray(model(jnp.asarray([prompts[0]]))[0, -1], np.float64)
  logp = logits - np.log(np.exp(logits - logits.max()).sum()) - logits.max()
  np.testing.assert_allclose(ours.logprobs[0][0], logp[ours.tokens[0][0]], atol=1e-4)


def test_sampled_generate_with_bias(model):
  """Sampled: a +100 bias forces its token on every row and step; -100 on the greedy token bans it."""
  forced = generate(model, [PROMPT] * 3, max_new_tokens=5, stop_tokens=(),
                    sampling=SamplingParams(1.0, logit_bias={11: 100.0}, seed=3)).tokens
  assert forced == [[11] * 5] * 3
  top = generate(model, [PROMPT], max_new_tokens=1, stop_tokens=()).tokens[0][0]
  banned = generate(model, [PROMPT] * 64, max_new_tokens=1, stop_tokens=(),
                    sampling=SamplingParams(1.0, logit_bias={top: -100.0}, seed=5)).tokens
  assert top not in {t[0] for t in banned}
