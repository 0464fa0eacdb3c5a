"""jaxsys.core.init: the same values as jax.nn.initializers, bit for bit, from shared programs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsys.core import init
from jaxsys.core.bench import compile_count

SHAPES = [(7,), (3, 5), (64, 64), (576, 1536), (3, 3, 16, 32), (4, 8, 16), (1000, 3), (2, 1)]


def _pairs():
  ji = jax.nn.initializers
  return {
      "lecun_normal": (init.lecun_normal(), ji.lecun_normal()),
      "he_normal": (init.he_normal(), ji.he_normal()),
      "glorot_uniform": (init.glorot_uniform(), ji.glorot_uniform()),
      "normal": (init.normal(0.02), ji.normal(0.02)),
      "uniform": (init.uniform(0.3), ji.uniform(0.3)),
      "fan_out_normal": (init.variance_scaling(2.0, "fan_out", "normal"), ji.variance_scaling(2.0, "fan_out", "normal")),
      "geo_uniform_axes": (init.variance_scaling(0.5, "fan_geo_avg", "uniform", in_axis=0, out_axis=(1,)),
                           ji.variance_scaling(0.5, "fan_geo_avg", "uniform", in_axis=0, out_axis=(1,))),
      "zeros": (init.zeros, ji.zeros),
      "ones": (init.ones, ji.ones),
      "constant": (init.constant(-0.25), ji.constant(-0.25)),
  }


@pytest.mark.parametrize("name", sorted(_pairs()))
def test_bitwise_equal_to_jax(name):
  ours, ref = _pairs()[name]
  for i, shape in enumerate(SHAPES):
    if name in ("lecun_normal", "he_normal", "glorot_uniform", "fan_out_normal", "geo_uniform_axes") and len(shape) < 2:
      continue
    for key in (jax.random.key(i), jax.random.PRNGKey(i)):  # typed and raw keys
      a, b = ours(key, shape, jnp.float32), ref(key, shape, jnp.float32)
      assert a.shape == b.shape and a.dtype == b.dtype
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=f"{name} {shape}")


def test_other_dtypes_and_traced_keys_take_jax_path():
  key = jax.random.key(3)
  a = init.lecun_normal()(key, (8, 4), jnp.bfloat16)
  np.testing.assert_array_equal(np.asarray(a, np.float32),
                                np.asarray(jax.nn.initializers.lecun_normal()(key, (8, 4), jnp.bfloat16), np.float32))
  out = jax.jit(lambda k: init.normal(1.0)(k, (5, 3)))(key)  # under a trace: jax's own draw
  np.testing.assert_array_equal(np.asarray(out), np.asarray(jax.random.normal(key, (5, 3))))
  shape = jax.eval_shape(lambda k: init.zeros(k, (2, 9)), key)
  assert shape.shape == (2, 9)


def test_shapes_share_programs():
  """New shapes up to 2^16 values draw from one program (jax's initializer: one per shape)."""
  lecun = init.lecun_normal()
  key = jax.random.key(0)
  lecun(key, (30, 30))  # the bucket's program compiled once
  before = compile_count()
  for shape in [(n, 20) for n in range(39, 52)] + [(7, 3), (300, 200), (16, 4096)]:  # 21 .. 65536 values
    lecun(key, shape)
  assert compile_count() == before
  for n in range(31, 33):  # jax's own initializer: a program per shape
    jax.nn.initializers.lecun_normal()(key, (n, 21))
  assert compile_count() > before


def test_bucket():
  k = 1 << 16
  assert [init.bucket(n) for n in (1, 256, k, k + 1, 3 * k // 2, 3 * k // 2 + 1, 2 * k + 1)] == [
      k, k, k, 3 * k // 2, 3 * k // 2, 2 * k, 3 * k]
  for n in range(1, 20 * k, 4099):
    assert n <= init.bucket(n) <= max(k, 1.5 * n)


def test_bad_arguments():
  with pytest.raises(ValueError, match="mode"):
    init.variance_scaling(1.0, "fan_sideways", "normal")
  with pytest.raises(ValueError, match="in_axis"):
    init.lecun_normal()(jax.random.key(0), (5,))
