"""PalQuant: cyclic shuffle, grouped conv, LSQ gradients, network and config checks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxsys.core.errors import ConfigError, ShapeError
from jaxsys.quant.palquant import (PalQuantConfig, PalQuantNet, bitops, cyclic_shuffle,
                                   grouped_conv3x3, lsq_quantize)


def test_cyclic_shuffle_moves_chunk_k_of_group_g_to_group_g_plus_k():
  g, c = 3, 6  # 3 groups of 6 channels = 3 chunks of 2
  x = jnp.arange(g * c, dtype=jnp.float32)[None, :]
  y = np.asarray(cyclic_shuffle(x, g))[0].reshape(g, g, c // g)
  xs = np.asarray(x)[0].reshape(g, g, c // g)
  for src in range(g):
    for k in range(g):
      np.testing.assert_array_equal(y[(src + k) % g, k], xs[src, k])
  assert sorted(np.asarray(cyclic_shuffle(x, g))[0].tolist()) == list(range(g * c))
  np.testing.assert_array_equal(cyclic_shuffle(x, 1), x)


def test_grouped_conv_matches_lax_grouped_conv():
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(2, 8, 8, 6)).astype(np.float32))
  w = jnp.asarray(rng.normal(size=(3, 3, 3, 4)).astype(np.float32))
  ref = jax.lax.conv_general_dilated(x, w, (1, 1), "SAME", feature_group_count=2,
                                     dimension_numbers=("NHWC", "HWIO", "NHWC"))
  np.testing.assert_allclose(grouped_conv3x3(x, w, 2), ref, rtol=1e-4, atol=1e-4)


def test_lsq_forward_and_gradients():
  x = jnp.array([-3.0, -0.26, 0.1, 0.74, 5.0])
  s = jnp.array(0.5)
  y = lsq_quantize(x, s, 2, True)  # levels -2..1
  np.testing.assert_allclose(y, [-1.0, -0.5, 0.0, 0.5, 0.5])
  gx, gs = jax.grad(lambda x, s: lsq_quantize(x, s, 2, True).sum(), argnums=(0, 1))(x, s)
  np.testing.assert_allclose(gx, [0, 1, 1, 0, 0])  # 0.74 / 0.5 > Qp = 1: clipped
  u = np.asarray(x) / 0.5
  inside = (u >= -2) & (u <= 1)
  ds = np.where(inside, np.round(u) - u, np.where(u < -2, -2, 1))
  np.testing.assert_allclose(gs, ds.sum() / np.sqrt(5 * 1), rtol=1e-5)


def test_network_forward_backward_and_bitops():
  cfg = PalQuantConfig(groups=2, w_bits=2, a_bits=2, channels=4)
  net = PalQuantNet(cfg, rngs=nnx.Rngs(0))
  x = jnp.asarray(np.random.default_rng(0).uniform(size=(3, 8, 8, 1)).astype(np.float32))
  nnx.jit(lambda m, x: m.calibrate(x))(net, x)
  assert float(net.blocks[0].a_step[...]) != 1.0  # calibrated from data
  logits, grads = nnx.jit(lambda m, x: (m(x), nnx.grad(lambda m: m(x).sum())(m)))(net, x)
  assert logits.shape == (3, 10)
  assert all(np.all(np.isfinite(g)) for g in jax.tree.leaves(grads))
  assert bitops(cfg) == 2 * bitops(PalQuantConfig(groups=1, w_bits=2, a_bits=2, channels=4))
  with pytest.raises(ShapeError):
    net(jnp.zeros((3, 8, 8)))


def test_config_errors():
  with pytest.raises(ConfigError, match="divisible"):
    PalQuantConfig(groups=3, channels=16)
  with pytest.raises(ConfigError, match="w_bits"):
    PalQuantConfig(w_bits=9)
  with pytest.raises(ConfigError, match="a_bits"):
    PalQuantConfig(a_bits=0)
