"""Degree-aware bits, condensed edge order, 1-bit communication quantizer, hash dropout."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsys.core.errors import ConfigError, InputError
from jaxsys.quant import comm, mega
from jaxsys.quant.random import hash_dropout, hash_uniform


def test_degree_aware_bits_monotone_and_on_budget():
  rng = np.random.default_rng(0)
  deg = rng.zipf(2.0, 500).clip(max=300)
  for target in (1.0, 2.5, 4.0, 8.0):
    b = mega.degree_aware_bits(deg, target)
    assert b.min() >= 1 and b.max() <= 8
    assert abs(b.mean() - target) < 0.5
    order = np.argsort(deg)
    assert np.all(np.diff(b[order]) >= 0)  # more bits for higher in-degree
  inv = mega.degree_aware_bits(deg, 3.0, slope=-1.0)
  assert np.all(np.diff(inv[np.argsort(deg)]) <= 0)
  with pytest.raises(ConfigError, match="target_bits"):
    mega.degree_aware_bits(deg, 0.5)
  with pytest.raises(ConfigError):
    mega.degree_aware_bits(deg, 3.0, min_bits=0)
  reg = mega.degree_regularizer(jnp.ones((3, 1)) * 2, np.array([2, 3, 4]))
  np.testing.assert_allclose(reg, (0 + 1 + 4) / 3)


def test_condensed_edge_order_permutes_and_improves_locality():
  rng = np.random.default_rng(1)
  n, e = 256, 4000
  s = rng.integers(0, 64, e)  # few hot sources -> reuse inside destination blocks
  r = rng.integers(0, n, e)
  order = mega.condensed_edge_order(s, r, n, block_size=64)
  assert sorted(order.tolist()) == list(range(e))
  base = mega.destination_order(s, r)
  assert mega.source_row_loads(s, r, order, 64) < mega.source_row_loads(s, r, base, 64)
  with pytest.raises(InputError):
    mega.condensed_edge_order(s, r, 10)


def test_one_bit_pack_and_bytes():
  rng = np.random.default_rng(2)
  bits = rng.integers(0, 2, (7, 70))
  w = comm.pack_bits(jnp.asarray(bits))
  assert w.shape == (7, 3) and w.dtype == jnp.uint32
  np.testing.assert_array_equal(comm.unpack_bits(w, 70), bits)
  x = jnp.asarray(rng.normal(size=(4, 5, 70)).astype(np.float32))
  p = comm.quantize_1bit(x, seed=3)
  assert p.nbytes == 20 * comm.bytes_per_row(70) == 20 * (3 * 4 + 8)
  xh = comm.dequantize_1bit(p, 70)
  lo, hi = x.min(-1, keepdims=True), x.max(-1, keepdims=True)
  assert bool(jnp.all((jnp.isclose(xh, lo)) | jnp.isclose(xh, hi)))


def test_stochastic_rounding_is_unbiased():
  x = jnp.linspace(-1.0, 3.0, 64)[None, :]
  est = jnp.mean(jax.vmap(lambda k: comm.dequantize_1bit(comm.quantize_1bit(x, seed=k), 64))(
      jnp.arange(400, dtype=jnp.uint32)), 0)
  assert float(jnp.max(jnp.abs(est - x))) < 0.35
  assert float(jnp.abs(jnp.mean(est - x))) < 0.03
  est_key = jnp.mean(jax.vmap(lambda k: comm.dequantize_1bit(
      comm.quantize_1bit(x, jax.random.key(k)), 64))(jnp.arange(400)), 0)
  assert float(jnp.abs(jnp.mean(est_key - x))) < 0.03
  det = comm.dequantize_1bit(comm.quantize_1bit(x), 64)
  np.testing.assert_allclose(det[0, -1], 3.0)


def test_hash_dropout_rate_and_partition_invariance():
  x = jnp.ones((300, 40))
  y = hash_dropout(x, 7, 0.5)
  assert abs(float((y > 0).mean()) - 0.5) < 0.03
  rows = jnp.array([5, 17, 250])
  np.testing.assert_array_equal(hash_dropout(x[rows], 7, 0.5, row_ids=rows), y[rows])
  assert not np.array_equal(hash_dropout(x, 8, 0.5), y)
  u = hash_uniform((1000,), 1)
  assert 0.45 < float(u.mean()) < 0.55 and float(u.min()) >= 0 and float(u.max()) < 1
  with pytest.raises(ConfigError):
    hash_dropout(x, 0, 1.0)
