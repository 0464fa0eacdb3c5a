"""Dropout whose mask is a counter hash, not a threefry draw: the same layer, cheaper on CPU.

:class:`HashDropout` is ``nnx.Dropout`` (same ``rate``, ``broadcast_dims``, ``deterministic``
switch through ``model.train()`` / ``model.eval()``, and the same ``rngs`` stream: one key per call)
through :func:`jaxsys.quant.random.hash_dropout`: the call's key becomes one uint32 seed
and element ``(row, j)`` is kept when ``fmix32(index * golden + mix(seed)) >= rate * 2^32``.

Why: XLA:CPU generates threefry bits at ~13-20 ns per element once a mask outgrows the cache
(jax's default ``jax_threefry_partitionable`` layout): a Bernoulli mask over Cora's
``[2708, 1433]`` input features took 60-80 ms on 2 cores, more than the rest of a GCN step. The
hash is a few integer ops per element on every backend. The masks are different draws from the
same distribution (keep probability ``1 - rate``, independent across elements and calls), so a
model trained with either has the same expected behaviour but not the same numbers.

Usage::

  self.drop = HashDropout(0.5, rngs=rngs)   # in place of nnx.Dropout(0.5, rngs=rngs)
  y = self.drop(x)                          # identity after model.eval()
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxsys.quant.random import hash_dropout

__all__ = ["HashDropout"]


class HashDropout(nnx.Dropout):
  """``nnx.Dropout`` with a counter-hash keep mask (module docstring); same constructor."""

  def __call__(self, inputs, *, deterministic: bool | None = None, rngs=None):
    deterministic = self.deterministic if deterministic is None else deterministic
    if deterministic is None:
      raise ValueError("HashDropout: deterministic is None; pass it to the constructor or the call, "
                       "or use model.train() / model.eval()")
    if self.rate == 0.0 or deterministic:
      return inputs
    if self.rate == 1.0:
      return jnp.zeros_like(inputs)
    seed = jax.random.bits(self._key(rngs), (), jnp.uint32)
    dims = {d % inputs.ndim for d in self.broadcast_dims}
    shape = tuple(1 if d in dims else n for d, n in enumerate(inputs.shape))
    return hash_dropout(inputs, seed, self.rate, mask_shape=shape)

  def _key(self, rngs):
    rngs = self.rngs if rngs is None else rngs
    if rngs is None:
      raise ValueError("HashDropout: deterministic is False but no rngs were given (constructor or call)")
    if isinstance(rngs, nnx.Rngs):
      return rngs[self.rng_collection]()
    if isinstance(rngs, nnx.RngStream):
      return rngs()
    return rngs  # a key
