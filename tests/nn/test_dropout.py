"""HashDropout: nnx.Dropout's contract with a counter-hash mask."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxsys.nn import HashDropout


@pytest.mark.parametrize("rate", [0.1, 0.5, 0.6])
def test_keep_fraction_and_scaling(rate):
  drop = HashDropout(rate, rngs=nnx.Rngs(dropout=0))
  x = jnp.ones((512, 96))
  y = np.asarray(drop(x))
  kept = y != 0
  # 49152 Bernoulli(1 - rate) draws: the fraction is within ~5 standard deviations
  assert abs(kept.mean() - (1 - rate)) < 5 * np.sqrt(rate * (1 - rate) / kept.size)
  np.testing.assert_allclose(y[kept], 1.0 / (1.0 - rate), rtol=1e-6)
  # rows and columns are not masked alike (no structure in the mask)
  assert kept.mean(0).std() > 0 and kept.mean(1).std() > 0


def test_new_mask_per_call_and_stream_like_nnx_dropout():
  ours, ref = HashDropout(0.5, rngs=nnx.Rngs(dropout=3)), nnx.Dropout(0.5, rngs=nnx.Rngs(dropout=3))
  x = jnp.ones((64, 64))
  a, b = ours(x), ours(x)
  assert not np.array_equal(np.asarray(a) != 0, np.asarray(b) != 0)
  ref(x), ref(x)
  # one key per call from the same stream: the two layers' RNG counters move together
  assert int(ours.rngs.count[...]) == int(ref.rngs.count[...]) == 2
  # the same key gives the same mask (reproducible under jit)
  again = HashDropout(0.5, rngs=nnx.Rngs(dropout=3))
  np.testing.assert_array_equal(np.asarray(again(x)), np.asarray(a))
  np.testing.assert_array_equal(np.asarray(jax.jit(lambda m, x: m(x))(HashDropout(0.5, rngs=nnx.Rngs(dropout=3)), x)),
                                np.asarray(a))


def test_eval_rate_zero_one_and_broadcast_dims():
  x = jax.random.normal(jax.random.key(0), (8, 16, 4))
  drop = HashDropout(0.5, broadcast_dims=(-1,), rngs=nnx.Rngs(dropout=1))
  y = np.asarray(drop(x))
  mask = y != 0
  assert (mask == mask[..., :1]).all()  # one decision per (row, column), shared over the last dim
  drop.eval()
  np.testing.assert_array_equal(np.asarray(drop(x)), np.asarray(x))
  assert HashDropout(0.0, rngs=nnx.Rngs(0))(x) is x
  assert not np.asarray(HashDropout(1.0, rngs=nnx.Rngs(0))(x)).any()
  with pytest.raises(ValueError, match="no rngs"):
    HashDropout(0.5)(x)


def test_gradient_is_the_mask_over_keep_probability():
  drop, key = HashDropout(0.25), jax.random.key(5)  # a key given at the call (nnx.Dropout's rngs=)
  x = jnp.ones((32, 8))
  y = drop(x, rngs=key)
  g = jax.grad(lambda x: drop(x, rngs=key).sum())(x)
  np.testing.assert_allclose(np.asarray(g), np.asarray(y), rtol=1e-6)
  assert 0 < (np.asarray(y) == 0).mean() < 0.5
