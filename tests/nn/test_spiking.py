"""LIF / PLIF neuron against a step-by-step numpy reference: forward spikes and the surrogate
gradient (backprop through time by hand)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxsys.core.errors import ConfigError, ShapeError
from jaxsys.nn.spiking import LIF, LIFConfig, SpikingLinear, lif_scan, spike, spike_count


def _sig(x):
  return 1 / (1 + np.exp(-x))


def numpy_lif(x, tau=2.0, th=1.0, alpha=4.0, g=None):
  """Forward spikes, and with ``g`` (dL/dS) the gradient dL/dx of L = sum(S * g)."""
  T = x.shape[0]
  v = np.zeros(x.shape[1:])
  hs, ss = [], []
  for t in range(T):
    h = v + (x[t] - v) / tau
    s = (h - th >= 0).astype(np.float64)
    v = h * (1 - s)
    hs.append(h)
    ss.append(s)
  if g is None:
    return np.stack(ss)
  dx = np.zeros_like(x)
  dv = np.zeros(x.shape[1:])   # dL/dV[t] flowing back from step t+1
  for t in reversed(range(T)):
    sg = alpha * _sig(alpha * (hs[t] - th)) * (1 - _sig(alpha * (hs[t] - th)))
    dh = g[t] * sg + dv * (1 - ss[t])      # reset detached: no path through S in V = H(1-S)
    dx[t] = dh / tau
    dv = dh * (1 - 1 / tau)
  return np.stack(ss), dx


def test_lif_forward_matches_numpy():
  x = np.random.default_rng(0).normal(1.0, 1.0, (12, 5, 7))
  got = lif_scan(jnp.asarray(x, jnp.float32), 0.5, 1.0)
  np.testing.assert_array_equal(np.asarray(got), numpy_lif(x))
  assert 0 < float(got.mean()) < 1


def test_lif_surrogate_gradient_matches_numpy():
  rng = np.random.default_rng(1)
  x = rng.normal(1.0, 1.0, (9, 4, 3))
  g = rng.normal(size=x.shape)
  _, want = numpy_lif(x, g=g)
  got = jax.grad(lambda a: jnp.sum(lif_scan(a, 0.5, 1.0) * g))(jnp.asarray(x, jnp.float32))
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-5)


def test_spike_surrogate_and_tau():
  x = jnp.array([-1.0, 0.0, 0.5])
  np.testing.assert_array_equal(spike(x), [0, 1, 1])
  s = _sig(4 * np.asarray(x))
  np.testing.assert_allclose(jax.grad(lambda a: jnp.sum(spike(a)))(x), 4 * s * (1 - s), rtol=1e-6)
  x = np.random.default_rng(2).normal(1.0, 1.0, (6, 3, 2))
  np.testing.assert_array_equal(np.asarray(lif_scan(jnp.asarray(x), 1 / 3, 1.0)), numpy_lif(x, tau=3.0))


def test_plif_learns_tau():
  plif = LIF(LIFConfig(tau=2.0, learn_tau=True))
  assert float(plif.inv_tau()) == pytest.approx(0.5)
  x = jnp.asarray(np.random.default_rng(3).normal(1.0, 1.0, (8, 4, 3)), jnp.float32)
  np.testing.assert_array_equal(np.asarray(plif(x)), numpy_lif(np.asarray(x)))
  g = nnx.grad(lambda m: jnp.sum(m(x)))(plif)
  assert abs(float(g["w"][...])) > 0


def test_spiking_linear_and_counts():
  layer = SpikingLinear(5, 8, rngs=nnx.Rngs(0))
  x = jnp.ones((4, 3, 5)) * 3
  s = layer(x)
  assert s.shape == (4, 3, 8)
  valid = jnp.array([[1, 0, 1]] * 4, bool)
  assert float(spike_count(s, valid)) == float(jnp.sum(s[:, [0, 2]]))
  with pytest.raises(ShapeError, match="valid must have shape"):
    spike_count(s, valid[:, :2])


def test_bad_config_and_input():
  with pytest.raises(ConfigError, match="tau=1.0 must be > 1"):
    LIFConfig(tau=1.0)
  with pytest.raises(ShapeError, match="time-major"):
    LIF()(jnp.ones((3,)))
