"""Basic Flax NNX layers of decoder language models: RMSNorm, token embedding, SwiGLU MLP.

Every parameter carries ``logical_axes`` metadata ("embed", "mlp", "vocab", "heads", ...) and
activations are constrained by logical name through :func:`constrain`, so one rules table
(``jaxsys.core.mesh.DEFAULT_RULES``) decides how a model is sharded on any mesh.

* RMSNorm (Zhang & Sennrich, 2019): ``y = w * x / sqrt(mean(x^2) + eps)``, computed in float32.
* SwiGLU MLP (Shazeer, 2020): ``down(silu(x W_gate) * (x W_up))``.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from jaxsys.core.mesh import hint, logical_to_spec


def constrain(x, logical: Sequence[str | None], rules=None):
  """``with_sharding_constraint`` by logical axis names under the ambient mesh; else identity.

  The ambient mesh is the one set with ``jax.sharding.use_mesh`` / ``jax.set_mesh``; without
  one (or on a one-device mesh) this returns ``x`` unchanged. Only Auto axes are constrained
  (``jaxsys.core.mesh.hint``): on Explicit axes the array's type decides.
  """
  mesh = jax.sharding.get_abstract_mesh()
  if mesh is None or mesh.empty or mesh.size == 1:
    return x
  return hint(x, logical_to_spec(logical, mesh, rules), mesh)


def param(rngs: nnx.Rngs, shape, logical, *, init="normal", std=0.02, dtype=jnp.float32):
  """A ``nnx.Param`` with ``logical_axes`` metadata; ``init`` is "normal", "zeros" or "ones"."""
  if init == "normal":
    value = std * jax.random.normal(rngs.params(), shape, jnp.float32)
  elif init == "zeros":
    value = jnp.zeros(shape, jnp.float32)
  elif init == "ones":
    value = jnp.ones(shape, jnp.float32)
  else:
    raise ValueError(f"{init=} must be 'normal', 'zeros' or 'ones'")
  return nnx.Param(value.astype(dtype), logical_axes=tuple(logical))


def param_specs(module: nnx.Module, mesh, rules=None):
  """``PartitionSpec`` tree (same structure as ``nnx.state(module, nnx.Param)``) from metadata."""
  state = nnx.state(module, nnx.Param)

  def spec(var):
    names = var.get_metadata().get("logical_axes")
    return logical_to_spec(names, mesh, rules) if names else jax.sharding.PartitionSpec()

  return jax.tree.map(spec, state, is_leaf=lambda v: isinstance(v, nnx.Variable))


def shard_params(module: nnx.Module, mesh, rules=None):
  """Places every parameter of ``module`` on ``mesh`` by its logical axes (in place)."""
  state = nnx.state(module, nnx.Param)
  specs = param_specs(module, mesh, rules)
  shardings = jax.tree.map(lambda s: jax.sharding.NamedSharding(mesh, s), specs)
  nnx.update(module, jax.device_put(state, shardings))
  return module


class RMSNorm(nnx.Module):
  """Root-mean-square norm over the last axis; statistics in float32, output in x's dtype."""

  def __init__(self, dim: int, *, eps: float = 1e-6, param_dtype=jnp.float32,
               rngs: nnx.Rngs | None = None):
    del rngs
    self.eps = float(eps)
    self.weight = nnx.Param(jnp.ones((dim,), param_dtype), logical_axes=("embed",))

  def __call__(self, x):
    xf = x.astype(jnp.float32)
    normed = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
    return self.weight[...].astype(x.dtype) * normed.astype(x.dtype)


class Embed(nnx.Module):
  """Token embedding table ``[vocab, embed]``; ``attend`` multiplies by its transpose (tied head)."""

  def __init__(self, vocab: int, dim: int, *, dtype=jnp.float32, param_dtype=jnp.float32,
               rngs: nnx.Rngs):
    self.vocab, self.dim, self.dtype = vocab, dim, dtype
    self.weight = param(rngs, (vocab, dim), ("vocab", "embed"), dtype=param_dtype)

  def __call__(self, tokens):
    out = jnp.take(self.weight[...], tokens, axis=0).astype(self.dtype)  # [batch, seq, embed]
    return constrain(out, ("batch", "seq", "embed"))

  def attend(self, h):
    return jnp.einsum("bsd,vd->bsv", h, self.weight[...].astype(h.dtype))  # [batch, seq, vocab]


class SwiGLU(nnx.Module):
  """``down(silu(x @ gate) * (x @ up))`` with gate/up ``[embed, mlp]`` and down ``[mlp, embed]``."""

  def __init__(self, dim: int, hidden: int, *, dtype=jnp.float32, param_dtype=jnp.float32,
               rngs: nnx.Rngs):
    self.dtype = dtype
    self.gate = param(rngs, (dim, hidden), ("embed", "mlp"), dtype=param_dtype)
    self.up = param(rngs, (dim, hidden), ("embed", "mlp"), dtype=param_dtype)
    self.down = param(rngs, (hidden, dim), ("mlp", "embed"), dtype=param_dtype)

  def __call__(self, x):
    x = x.astype(self.dtype)
    g = jnp.einsum("bsd,dm->bsm", x, self.gate[...].astype(self.dtype))  # [batch, seq, mlp]
    u = jnp.einsum("bsd,dm->bsm", x, self.up[...].astype(self.dtype))
    h = constrain(jax.nn.silu(g) * u, ("batch", "seq", "mlp"))
    out = jnp.einsum("bsm,md->bsd", h, self.down[...].astype(self.dtype))  # [batch, seq, embed]
    return constrain(out, ("batch", "seq", "embed"))
