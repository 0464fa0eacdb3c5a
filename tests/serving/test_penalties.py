"""Frequency / presence / repetition penalties and logit bias: the one sampler's ``penalize`` against a
plain numpy formula, their validation, and a clear refusal where no token history exists. The
server-level tests (official client, seeded, batched with plain requests) are in test_openai_server.py."""

import numpy as np
import pytest

from jaxsys.core.errors import ConfigError
from jaxsys.decoding.sampling import Penalties, SamplingParams, loop_params, penalize, sample
from jaxsys.serving.requests import RequestParams


def test_penalize_matches_the_formula():
  rng = np.random.default_rng(0)
  vocab = 12
  logits = rng.normal(size=(3, vocab)).astype(np.float32) * 3
  params = [SamplingParams(frequency_penalty=0.5, presence_penalty=1.5, repetition_penalty=1.3,
                           logit_bias={"4": 100, "7": -100.0}),
            SamplingParams(),                                   # a plain row in the same batch
            SamplingParams(repetition_penalty=0.8)]
  outs = [[1, 1, 2, 5], [1, 1], [3, 3, 9]]
  prompts = [[0, 6], [2], [6]]
  pen = Penalties.rows(params, outs, prompts, vocab, batch=4)
  assert pen.counts.shape == pen.bias.shape == (4, vocab) and pen.repetition.tolist() == pytest.approx([1.3, 1.0, 0.8, 1.0])
  got = np.asarray(penalize(np.concatenate([logits, logits[:1]]), pen))
  want = logits.copy()
  for i, (p, out, prompt) in enumerate(zip(params, outs, prompts)):
    counts = np.bincount(out, minlength=vocab)
    if p.repetition_penalty != 1.0:
      seen = (counts > 0) | np.isin(np.arange(vocab), prompt)
      r = p.repetition_penalty
      want[i] = np.where(seen, np.where(want[i] > 0, want[i] / r, want[i] * r), want[i])
    if p.penalized:
      want[i] -= counts * p.frequency_penalty + (counts > 0) * p.presence_penalty
    for t, b in p.logit_bias:
      want[i, t] += b
  np.testing.assert_allclose(got[:3], want, rtol=1e-6, atol=1e-6)
  np.testing.assert_array_equal(got[3], logits[0])        # the padding row is untouched
  assert got[0].argmax() == 4 and got[0, 7] < -90


def test_validation_names_the_field_and_history_free_paths_refuse():
  for kw, field in ((dict(frequency_penalty=2.5), "frequency_penalty"), (dict(presence_penalty=-3), "presence_penalty"),
                    (dict(repetition_penalty=0.0), "repetition_penalty"), (dict(logit_bias={"x": 1}), "logit_bias"),
                    (dict(logit_bias={5: 101}), "logit_bias"), (dict(logit_bias={-1: 1}), "logit_bias")):
    with pytest.raises(ConfigError, match=field):
      SamplingParams(**kw)
  p = SamplingParams(logit_bias={"3": 1.5, 1: -2})
  assert p.logit_bias == ((1, -2.0), (3, 1.5)) and p.penalized and hash(p)
  with pytest.raises(ConfigError, match="token ids >= vocab size 3"):
    p.check_vocab(3)
  assert RequestParams(logit_bias={"3": 1}).logit_bias == ((3, 1.0),)
  # the scalar samplers have no token history: refused, not ignored; the on-device loop needs the
  # prompts to build one
  with pytest.raises(ConfigError, match="penalties or logit_bias"):
    sample(None, np.zeros((1, 4), np.float32), SamplingParams(logit_bias={1: 5}))
  with pytest.raises(ConfigError, match="need the prompts"):
    loop_params(SamplingParams(presence_penalty=1.0), max_new=4, stops=())
  mode, traced = loop_params(SamplingParams(presence_penalty=1.0), max_new=4, stops=(), prompts=[[1, 2]],
                             vocab=5, batch=2)
  assert len(mode) == 4 and traced["pen"].counts.shape == (2, 5) and float(traced["pen"].presence[1]) == 0.0
