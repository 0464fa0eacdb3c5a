"""Per-row sampling (``sample_rows``) draws from the same filtered distribution as ``sample`` with
each row's ``SamplingParams``; ``min_p``; ``token_logprobs``."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsys.core.errors import ConfigError
from jaxsys.decoding.sampling import SamplingParams, filtered_logits, sample_rows, token_logprobs

ROWS = [SamplingParams(1.0, top_k=5), SamplingParams(0.7, top_p=0.8), SamplingParams(1.3, 10, 0.9, min_p=0.1),
        SamplingParams(0.0), SamplingParams(1.0, min_p=0.3)]


def test_rows_draw_from_their_own_filtered_distribution():
  logits = jax.random.normal(jax.random.PRNGKey(0), (len(ROWS), 40)) * 3
  arr = lambda f, dt: jnp.asarray([f(p) for p in ROWS], dt)  # noqa: E731
  params = (arr(lambda p: p.temperature, jnp.float32), arr(lambda p: p.top_k, jnp.int32),
            arr(lambda p: p.top_p, jnp.float32), arr(lambda p: p.min_p, jnp.float32))
  draw = jax.jit(jax.vmap(lambda k: sample_rows(jax.random.split(k, len(ROWS)), logits, *params)))
  d = np.asarray(draw(jax.random.split(jax.random.PRNGKey(1), 3000)))
  for i, p in enumerate(ROWS):
    seen = set(np.unique(d[:, i]).tolist())
    if p.greedy:
      assert seen == {int(jnp.argmax(logits[i]))}
      continue
    support = set(np.flatnonzero(np.isfinite(np.asarray(filtered_logits(logits[i], p)))).tolist())
    assert seen == support, (i, p)  # every allowed token drawn, no other
  # frequencies follow the filtered softmax (row 0: top-5 at temperature 1)
  probs = np.asarray(jax.nn.softmax(filtered_logits(logits[0], ROWS[0])))
  freq = np.bincount(d[:, 0], minlength=40) / len(d)
  np.testing.assert_allclose(freq, probs, atol=0.03)


def test_min_p_and_logprobs():
  with pytest.raises(ConfigError, match="min_p"):
    SamplingParams(min_p=-0.1)
  x = jnp.log(jnp.asarray([[0.5, 0.3, 0.15, 0.05]]))
  kept = np.isfinite(np.asarray(filtered_logits(x, SamplingParams(min_p=0.5))))
  assert kept.tolist() == [[True, True, False, False]]  # p >= 0.5 * 0.5
  chosen, ids, top = token_logprobs(x, jnp.asarray([2]), 2)
  np.testing.assert_allclose(chosen, np.log([0.15]), rtol=1e-5)
  assert ids.tolist() == [[0, 1]] and np.allclose(top, np.log([[0.5, 0.3]]), rtol=1e-5)


def test_rows_and_scalars_share_one_filter():
  """sample_rows' per-row parameters and SamplingParams' scalars give the same filtered logits
  (one filter, _filter), for every combination of top-k, top-p and min-p."""
  import itertools

  import jax
  import jax.numpy as jnp
  import numpy as np

  from jaxsys.decoding import sampling as S
  logits = jax.random.normal(jax.random.key(0), (4, 50)) * 3
  for t, k, p, m in itertools.product((0.7, 1.3), (0, 5), (1.0, 0.8), (0.0, 0.1)):
    ref = S.filtered_logits(logits, S.SamplingParams(t, top_k=k, top_p=p, min_p=m))
    n = logits.shape[0]
    rows = S._filter(logits, jnp.full((n, 1), t), jnp.full((n, 1), k), jnp.full((n, 1), p), jnp.full((n, 1), m))
    np.testing.assert_array_equal(np.isfinite(rows), np.isfinite(ref), err_msg=str((t, k, p, m)))
    np.testing.assert_allclose(np.where(np.isfinite(rows), rows, 0), np.where(np.isfinite(ref), ref, 0), rtol=1e-6)
