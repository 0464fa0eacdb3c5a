"""A2Q quantizer: forward formula, the paper's gradients, finite differences, NNS, penalty."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsys.core.errors import ConfigError, InputError
from jaxsys.quant import a2q


def np_forward(x, s, b, signed):
  br = np.round(np.clip(b, 1, 8))
  qmax = 2.0 ** (br - 1) - 1 if signed else 2.0 ** br - 1
  lo = -qmax if signed else 0.0
  u = np.clip(x / s, lo, qmax)
  return np.sign(u) * np.floor(np.abs(u) + 0.5) * s


@pytest.mark.parametrize("signed", [True, False])
def test_forward_matches_formula_every_bitwidth(signed):
  rng = np.random.default_rng(0)
  x = rng.normal(size=(8, 40)).astype(np.float32) * 3
  s = rng.uniform(0.05, 0.5, size=(8, 1)).astype(np.float32)
  for bits in range(1, 9):
    b = np.full((8, 1), bits + 0.3, np.float32)  # rounds to `bits`
    got = np.asarray(a2q.a2q_quantize(jnp.asarray(x), jnp.asarray(s), jnp.asarray(b), signed))
    np.testing.assert_allclose(got, np_forward(x, s, b, signed), rtol=1e-6, atol=1e-7)
    qmax = 2 ** (bits - 1) - 1 if signed else 2 ** bits - 1
    codes = np.round(got / s)
    assert np.abs(codes).max() <= qmax
    if not signed:
      assert codes.min() >= 0


def paper_grads(x, s, b, g, signed):
  br = np.round(np.clip(b, 1, 8))
  qmax = 2.0 ** (br - 1) - 1 if signed else 2.0 ** br - 1
  lo = -qmax if signed else 0.0
  u = x / s
  inr = (u <= qmax) & (u >= lo)
  ds = np.where(inr, np.sign(x) * np.floor(np.abs(u) + 0.5) - u, np.where(u > qmax, qmax, lo))
  db = np.where(inr, 0.0, np.where(u > qmax, 1.0, -1.0 if signed else 0.0) * s * (qmax + 1) * math.log(2))
  return g * inr, (g * ds).sum(1, keepdims=True), (g * db).sum(1, keepdims=True)


@pytest.mark.parametrize("signed", [True, False])
def test_gradients_match_paper_expressions(signed):
  rng = np.random.default_rng(1)
  x = rng.normal(size=(6, 30)).astype(np.float32) * 2
  s = rng.uniform(0.1, 0.4, size=(6, 1)).astype(np.float32)
  b = rng.uniform(1.6, 4.4, size=(6, 1)).astype(np.float32)
  g = rng.normal(size=x.shape).astype(np.float32)
  f = lambda x, s, b: jnp.sum(jnp.asarray(g) * a2q.a2q_quantize(x, s, b, signed))
  gx, gs, gb = jax.grad(f, argnums=(0, 1, 2))(jnp.asarray(x), jnp.asarray(s), jnp.asarray(b))
  ex, es, eb = paper_grads(x, s, b, g, signed)
  np.testing.assert_allclose(gx, ex, atol=1e-6)
  np.testing.assert_allclose(gs, es, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(gb, eb, rtol=1e-5, atol=1e-5)
  assert np.abs(eb).max() > 0 and np.abs(es).max() > 0  # both regions exercised


def test_finite_differences_where_smooth():
  x = jnp.array([[5.0, -7.0, 0.31, -0.18]])  # two clipped, two inside
  s, b = jnp.array([[0.5]]), jnp.array([[3.0]])  # qmax = 3, clip at 1.5
  # Clipped region: x_q = sign(x) qmax s -> linear in s (the paper's d/ds = sign(x) qmax).
  fs = lambda s: a2q.a2q_quantize(x[:, :2], s, b, True).sum()
  h = 1e-3
  fd = (fs(s + h) - fs(s - h)) / (2 * h)
  np.testing.assert_allclose(jax.grad(fs)(s), fd.reshape(1, 1), rtol=1e-3)
  # d/db: the continuous surrogate sign(x) (2^(b-1) - 1) s differentiated at b = 3.
  surrogate = lambda bb: jnp.sum(jnp.sign(x[:, :2]) * (2.0 ** (bb - 1) - 1) * s)
  fb = lambda b: a2q.a2q_quantize(x[:, :2], s, b, True).sum()
  np.testing.assert_allclose(jax.grad(fb)(b)[0, 0],
                             (surrogate(3.0 + h) - surrogate(3.0 - h)) / (2 * h), rtol=1e-3)
  # Inside the range the straight-through x gradient equals the smooth identity's.
  fx = lambda xx: a2q.a2q_quantize(xx, s, b, True).sum()
  np.testing.assert_allclose(jax.grad(fx)(x), [[0.0, 0.0, 1.0, 1.0]])


def test_local_gradient_uses_quantization_error():
  rng = np.random.default_rng(2)
  x = jnp.asarray(rng.uniform(0, 2, size=(4, 16)).astype(np.float32))
  s, b = jnp.full((4, 1), 0.3), jnp.full((4, 1), 2.0)
  f = lambda s, b, g: jnp.sum(g * a2q.a2q_quantize(x, s, b, False, True))
  gs1, gb1 = jax.grad(f, argnums=(0, 1))(s, b, jnp.ones_like(x))
  gs2, gb2 = jax.grad(f, argnums=(0, 1))(s, b, 5 * jnp.ones_like(x))
  np.testing.assert_allclose(gs1, gs2)  # independent of the task gradient
  # dE/ds with E = 1/d sum (x_q - x)^2 and the same surrogate dx_q/ds.
  _, ds, db = a2q.surrogate_derivatives(x, s, b, False)
  xq = a2q.a2q_quantize(x, s, b, False)
  np.testing.assert_allclose(gs1, (2 / 16 * (xq - x) * ds).sum(1, keepdims=True), rtol=1e-5)
  np.testing.assert_allclose(gb1, (2 / 16 * (xq - x) * db).sum(1, keepdims=True), rtol=1e-5)
  # Gradient descent on s lowers the quantization error.
  err = lambda s: jnp.mean((a2q.a2q_quantize(x, s, b, False) - x) ** 2)
  assert err(s - 0.05 * gs1) < err(s)


def test_memory_penalty_and_budget_errors():
  b1, b2 = jnp.array([[2.0], [4.0]]), jnp.array([[8.0]])
  info = [(b1, 10), (b2, 5)]
  avg = (2 * 10 + 4 * 10 + 8 * 5) / 25
  np.testing.assert_allclose(a2q.memory_penalty(info, 3.0), (avg - 3.0) ** 2, rtol=1e-6)
  g = jax.grad(lambda b: a2q.memory_penalty([(b, 10), (b2, 5)], 3.0))(b1)
  np.testing.assert_allclose(g, 2 * (avg - 3.0) * 10 / 25 * np.ones((2, 1)), rtol=1e-5)
  with pytest.raises(ConfigError, match="target_bits"):
    a2q.memory_penalty(info, 0.5)
  with pytest.raises(ConfigError, match=r"\[1, 8\]"):
    a2q.check_bits("bits", np.array([0, 3]))
  with pytest.raises(ConfigError, match=r"\[1, 8\]"):
    a2q.check_bits("bits", np.array([9]))


def test_nearest_neighbor_strategy_picks_nearest_pair_and_generalises():
  steps = jnp.array([0.01, 0.1, 1.0])
  bits = jnp.array([3.0, 3.0, 3.0])  # unsigned qmax 7 -> reach 0.07, 0.7, 7
  x = jnp.array([[0.05, 0.0], [0.6, 0.1], [9.0, 1.0], [0.45, 0.0]])
  s, b, idx = a2q.nns_select(x, steps, bits, False)
  np.testing.assert_array_equal(idx, [0, 1, 2, 1])
  np.testing.assert_allclose(s[:, 0], steps[idx])
  # Gradients reach only the chosen pairs (gather transpose), for any number of rows.
  def f(st):
    s, b, _ = a2q.nns_select(x, st, bits, False)
    return jnp.sum(a2q.a2q_quantize(x, s, b, False))
  g = jax.grad(f)(steps)
  assert g.shape == (3,) and np.all(np.isfinite(g))
  x_big = jnp.asarray(np.random.default_rng(0).uniform(0, 3, (17, 5)).astype(np.float32))
  assert a2q.nns_select(x_big, steps, bits, False)[0].shape == (17, 1)
  with pytest.raises(InputError):
    a2q.nns_select(x, steps[:, None], bits, False)
