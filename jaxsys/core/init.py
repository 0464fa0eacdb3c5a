"""Parameter initializers whose random draws share compiled programs across shapes.

``jax.nn.initializers`` draw with ``jax.random`` at the parameter's own shape. Run eagerly, as a
model's constructor runs them, every new shape is a new XLA program (threefry and the normal /
truncated-normal / uniform transform, then the scaling multiply): 0.2-1.3 s of XLA:CPU compile each,
and a model with 30 parameter shapes compiles ~60 programs before its first step.

``jax.random``'s threefry draws are counter based (``jax_threefry_partitionable``, JAX's default):
element ``i`` of a draw depends on the key and ``i`` alone, so ``normal(key, (m,))[:n]`` equals
``normal(key, (n,))`` bit for bit for ``n <= m``, and a draw of shape ``s`` is the flat draw of
``prod(s)`` values reshaped. Here a draw of ``n`` values is cut from one of :func:`bucket` ``(n)``
values (65536 for every parameter up to that size, then the next of 2^k and 1.5 x 2^k: at most 1.5x
the values above it), and the scaling and zero /
one fills run in numpy: a model's parameters share a handful of programs, which the persistent
compilation cache also shares between processes. The values are the ones ``jax.nn.initializers``
gives, bit for bit (tests/core/test_init.py compares every initializer here over many shapes).

The shared path runs where that holds and is cheap: an eager call (not under ``jit`` /
``eval_shape``), the CPU backend (the cut and the scaling go through host memory), a float32
parameter and threefry keys. Anything else calls ``jax.nn.initializers`` itself.

The project's layers pass them for flax's defaults: ``nnx.Linear(din, dout, rngs=rngs,
**init.dense_defaults())`` (and :func:`norm_defaults`, :func:`embed_defaults`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["bucket", "constant", "dense_defaults", "embed_defaults", "glorot_uniform", "he_normal",
           "lecun_normal", "norm_defaults", "normal", "ones", "uniform", "variance_scaling", "zeros"]

# Every draw up to 2^16 values shares one program per kind (normal / truncated normal / uniform):
# a small model's biases, norms and matrices then compile one or two programs, not one per octave
# (~0.25 s of XLA:CPU each, ~7 octaves from 256). A 2^16 draw costs 1-1.5 ms on the host.
_MIN_BUCKET = 1 << 16
_TRUNCATED_STD = 0.87962566103423978  # stddev of a standard normal truncated to (-2, 2), as in jax


def bucket(n: int) -> int:
  """The draw length that serves ``n`` values: the smallest of 2^k and 1.5 x 2^k (>= 2^16) that is
  >= ``n``. Two programs per octave above 2^16; there a draw wastes at most a third of its values."""
  size = _MIN_BUCKET
  while size < n:
    size = size * 3 // 2 if size & (size - 1) == 0 else size // 3 * 4
  return size


def _shared(key, dtype) -> bool:
  """Whether a draw may be cut from a shared-length one (see the module docstring)."""
  if isinstance(key, jax.core.Tracer) or np.dtype(dtype) != np.float32:
    return False
  if not jax.config.jax_threefry_partitionable or jax.default_backend() != "cpu":
    return False
  impl = jax.random.key_impl(key) if jnp.issubdtype(key.dtype, jax.dtypes.prng_key) else None
  name = str(impl) if impl is not None else jax.config.jax_default_prng_impl
  return "threefry" in name


def _draw(kind: str, key, shape, dtype, lo=None, hi=None):
  """``jax.random.<kind>(key, shape)`` (with bounds ``lo``/``hi``), as numpy when shared."""
  shape = tuple(int(s) for s in shape)
  n = math.prod(shape)
  shared = _shared(key, dtype)
  draw_shape = (bucket(n),) if shared else shape
  if kind == "normal":
    x = jax.random.normal(key, draw_shape, dtype)
  elif kind == "truncated_normal":
    x = jax.random.truncated_normal(key, lo, hi, draw_shape, dtype)
  else:
    x = jax.random.uniform(key, draw_shape, dtype, lo, hi)
  return np.asarray(x)[:n].reshape(shape) if shared else x


def _finish(x, scale, dtype):
  """``x * scale`` in ``dtype``, rounded as ``jnp`` rounds it; a device array."""
  if isinstance(x, np.ndarray):  # float32 on the host: IEEE multiply, the same bits as XLA's
    return jax.device_put(x * np.asarray(scale, x.dtype))  # jnp.asarray would compile a copy per shape
  return x * jnp.asarray(scale, dtype)


def _dtype(dtype):
  return jax.dtypes.canonicalize_dtype(jnp.float32 if dtype is None else dtype)


def normal(stddev: float = 1e-2, dtype=None):
  """``jax.nn.initializers.normal(stddev)``: ``N(0, stddev^2)``."""
  def init(key, shape, dtype=dtype, out_sharding=None):
    if out_sharding is not None:
      return jax.nn.initializers.normal(stddev)(key, shape, dtype, out_sharding=out_sharding)
    dtype = _dtype(dtype)
    return _finish(_draw("normal", key, shape, dtype), stddev, dtype)
  return init


def uniform(scale: float = 1e-2, dtype=None):
  """``jax.nn.initializers.uniform(scale)``: ``U[0, scale)``."""
  def init(key, shape, dtype=dtype, out_sharding=None):
    if out_sharding is not None:
      return jax.nn.initializers.uniform(scale)(key, shape, dtype, out_sharding=out_sharding)
    dtype = _dtype(dtype)
    return _finish(_draw("uniform", key, shape, dtype, 0.0, 1.0), scale, dtype)
  return init


def _fans(shape, in_axis, out_axis, batch_axis) -> tuple[float, float]:
  """Fan in and fan out as ``jax.nn.initializers`` counts them (spatial axes multiply both)."""
  def size(axes):
    return shape[axes] if isinstance(axes, int) else math.prod(shape[a] for a in axes)
  if isinstance(in_axis, int) and in_axis == -2 and len(shape) <= 1:
    raise ValueError(f"a {len(shape)}-dimensional weight has no input axis at in_axis=-2; "
                     "name in_axis explicitly")
  receptive = math.prod(shape) / size(in_axis) / size(out_axis) / size(batch_axis)
  return size(in_axis) * receptive, size(out_axis) * receptive


def variance_scaling(scale: float, mode: str, distribution: str, in_axis: int | Sequence[int] = -2,
                     out_axis: int | Sequence[int] = -1, batch_axis: int | Sequence[int] = (), dtype=None):
  """``jax.nn.initializers.variance_scaling`` with the same arguments and values: a (truncated)
  normal or uniform draw of variance ``scale / n``, ``n`` the fan picked by ``mode``."""
  modes = ("fan_in", "fan_out", "fan_avg", "fan_geo_avg")
  if mode not in modes or distribution not in ("truncated_normal", "normal", "uniform"):
    raise ValueError(f"variance_scaling: mode={mode!r} must be one of {modes} and distribution="
                     f"{distribution!r} one of 'truncated_normal', 'normal', 'uniform'")
  reference = jax.nn.initializers.variance_scaling(scale, mode, distribution, in_axis, out_axis,
                                                   batch_axis, dtype)

  def init(key, shape, dtype=dtype, out_sharding=None):
    dtype = _dtype(dtype)
    if out_sharding is not None or not jnp.issubdtype(dtype, jnp.floating):
      return reference(key, shape, dtype, out_sharding=out_sharding)
    shape = tuple(int(s) for s in shape)
    fan_in, fan_out = _fans(shape, in_axis, out_axis, batch_axis)
    denominator = {"fan_in": fan_in, "fan_out": fan_out, "fan_avg": (fan_in + fan_out) / 2,
                   "fan_geo_avg": (fan_in * fan_out) ** 0.5}[mode]
    # float32 scalars as jax rounds them: the variance, then IEEE sqrt and division (exact rounding)
    variance = np.asarray(scale / denominator, dtype)
    if distribution == "truncated_normal":
      x, factor = _draw("truncated_normal", key, shape, dtype, -2, 2), np.sqrt(variance) / np.asarray(
          _TRUNCATED_STD, dtype)
    elif distribution == "normal":
      x, factor = _draw("normal", key, shape, dtype), np.sqrt(variance)
    else:
      x, factor = _draw("uniform", key, shape, dtype, -1, 1.0), np.sqrt(np.asarray(3, dtype) * variance)
    return _finish(x, factor, dtype)
  return init


def lecun_normal(in_axis=-2, out_axis=-1, batch_axis=(), dtype=None):
  """``jax.nn.initializers.lecun_normal``: truncated normal, variance ``1 / fan_in`` (flax's
  default kernel initializer)."""
  return variance_scaling(1.0, "fan_in", "truncated_normal", in_axis, out_axis, batch_axis, dtype)


def he_normal(in_axis=-2, out_axis=-1, batch_axis=(), dtype=None):
  """``jax.nn.initializers.he_normal``: truncated normal, variance ``2 / fan_in``."""
  return variance_scaling(2.0, "fan_in", "truncated_normal", in_axis, out_axis, batch_axis, dtype)


def glorot_uniform(in_axis=-2, out_axis=-1, batch_axis=(), dtype=None):
  """``jax.nn.initializers.glorot_uniform``: uniform, variance ``2 / (fan_in + fan_out)``."""
  return variance_scaling(1.0, "fan_avg", "uniform", in_axis, out_axis, batch_axis, dtype)


def constant(value, dtype=None):
  """``jax.nn.initializers.constant(value)``, filled on the host (no program per shape)."""
  def init(key, shape, dtype=dtype, out_sharding=None):
    dtype = _dtype(dtype)
    if out_sharding is not None or isinstance(key, jax.core.Tracer):
      return jax.nn.initializers.constant(value)(key, shape, dtype, out_sharding=out_sharding)
    return jax.device_put(np.full(tuple(int(s) for s in shape), value, dtype))
  return init


zeros = constant(0.0)
ones = constant(1.0)


def dense_defaults() -> dict:
  """Keyword arguments giving a flax ``nnx.Linear`` / ``nnx.Conv`` / ``nnx.Einsum`` flax's own
  default initializers (lecun-normal kernel, zero bias) through the shared path."""
  return {"kernel_init": lecun_normal(), "bias_init": zeros}


def norm_defaults() -> dict:
  """The same for ``nnx.LayerNorm`` / ``nnx.GroupNorm`` / ``nnx.RMSNorm``: ones and zeros."""
  return {"scale_init": ones, "bias_init": zeros}


def embed_defaults() -> dict:
  """The same for ``nnx.Embed``: flax's ``variance_scaling(1, "fan_in", "normal", out_axis=0)``."""
  return {"embedding_init": variance_scaling(1.0, "fan_in", "normal", out_axis=0)}
