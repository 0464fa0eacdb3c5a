"""The one masked node cross-entropy and masked accuracy (``jaxsys.graphs.node_loss``)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsys.core.errors import ShapeError
from jaxsys.graphs.node_loss import masked_accuracy, masked_node_cross_entropy


def _naive(logits, labels, mask, denominator=None):
  """The formula written out in float64 numpy: -log softmax(logits)[label], averaged over mask."""
  z = logits.astype(np.float64)
  logp = z - z.max(-1, keepdims=True)
  logp = logp - np.log(np.exp(logp).sum(-1, keepdims=True))
  nll = -logp[np.arange(len(labels)), labels]
  return nll[mask].sum() / (mask.sum() if denominator is None else denominator)


def test_equals_the_naive_formula_value_and_gradient():
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(37, 5)).astype(np.float32) * 3
  labels = rng.integers(0, 5, 37).astype(np.int32)
  mask = rng.random(37) < 0.4
  got = masked_node_cross_entropy(jnp.asarray(logits), jnp.asarray(labels), jnp.asarray(mask))
  np.testing.assert_allclose(float(got), _naive(logits, labels, mask), rtol=1e-6)
  got = masked_node_cross_entropy(jnp.asarray(logits), jnp.asarray(labels), jnp.asarray(mask),
                                  denominator=100.0)
  np.testing.assert_allclose(float(got), _naive(logits, labels, mask, 100.0), rtol=1e-6)
  # gradient: (softmax - onehot) / count on masked rows, exactly 0 elsewhere
  g = np.asarray(jax.grad(masked_node_cross_entropy)(jnp.asarray(logits), jnp.asarray(labels),
                                                     jnp.asarray(mask)))
  p = np.exp(logits - logits.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  want = (p - np.eye(5)[labels]) * mask[:, None] / mask.sum()
  np.testing.assert_allclose(g, want, atol=1e-6)
  assert np.all(g[~mask] == 0)


def test_masked_out_nodes_cannot_reach_the_loss():
  logits = jnp.array([[1.0, 2.0], [jnp.nan, jnp.inf]])  # node 1: unlabelled padding
  labels, mask = jnp.array([1, 0]), jnp.array([True, False])
  np.testing.assert_allclose(float(masked_node_cross_entropy(logits, labels, mask)),
                             _naive(np.asarray(logits[:1]), np.asarray(labels[:1]), np.array([True])), rtol=1e-6)
  # an empty mask is 0, not NaN
  assert float(masked_node_cross_entropy(logits[:1], labels[:1], jnp.array([False]))) == 0.0


def test_masked_accuracy():
  logits = jnp.array([[0.0, 1.0], [1.0, 0.0], [0.0, 1.0], [1.0, 0.0]])
  labels = jnp.array([1, 1, 1, 0])
  assert float(masked_accuracy(logits, labels, jnp.array([True, True, False, False]))) == 0.5
  assert float(masked_accuracy(logits, labels, jnp.zeros(4, bool))) == 0.0


@pytest.mark.parametrize("bad", ["rank", "labels", "mask_dtype", "mask_len"])
def test_bad_inputs_name_the_argument(bad):
  logits, labels, mask = jnp.zeros((4, 3)), jnp.zeros(4, jnp.int32), jnp.ones(4, bool)
  if bad == "rank":
    logits, word = logits[None], "logits"
  elif bad == "labels":
    labels, word = labels.astype(jnp.float32), "labels"
  elif bad == "mask_dtype":
    mask, word = mask.astype(jnp.float32), "mask"
  else:
    mask, word = mask[:3], "mask"
  with pytest.raises(ShapeError, match=word):
    masked_node_cross_entropy(logits, labels, mask)
