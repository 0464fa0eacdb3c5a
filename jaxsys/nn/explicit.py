"""Modules on meshes with Explicit axes (``jax.make_mesh``'s default), through ``jax.sharding.auto_axes``.

On Explicit axes every op must know its output sharding: a TP projection contracting a
model-sharded dimension, or an FSDP weight (embed over "data") meeting a data-sharded
activation, is a ``ShardingTypeError`` unless each call names an ``out_sharding``. jaxsys layers
instead annotate activations by their logical axes (``constrain``), which are compiler hints on
Auto axes. :func:`call_on_auto_axes` therefore runs a module's call with the mesh's axes switched
to Auto (``jax.sharding.auto_axes``; the compiler places the intermediates, gathering FSDP
weights per layer as it does in ``jaxsys.train``) and returns outputs sharded like the batch:
every output's leading axis over the inputs' batch axes, the rest replicated.

It works with and without ``jax.set_mesh`` (without one, the mesh comes from the arrays), eagerly
and under ``jax.jit`` / ``nnx.grad`` (JAX asks for ``jax.set_mesh`` around a jit of Explicit
arrays). ``models.Decoder`` calls it for its forward passes, so a model whose parameters were
placed with ``shard_params(model, jax.make_mesh(...), rules)`` runs forward, backward and decode.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable

import jax
import numpy as np
from flax import nnx

from jaxsys.core.mesh import explicit_axes

__all__ = ["call_on_auto_axes", "explicit_mesh", "explicit_ok"]


def _sharding(x):
  """A concrete array's sharding (its mesh holds devices), or a traced value's (an abstract mesh)."""
  if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer):
    return x.sharding
  try:
    return getattr(jax.typeof(x), "sharding", None)
  except TypeError:  # not an array (None, a Python scalar)
    return None


def explicit_mesh(*trees):
  """The mesh with Explicit axes these arrays (or the ``jax.set_mesh`` context) live on, else None."""
  ctx = jax.sharding.get_abstract_mesh()
  if not ctx.empty and explicit_axes(ctx):
    return ctx
  for leaf in jax.tree.leaves(trees):
    s = _sharding(leaf)
    mesh = getattr(s, "mesh", None)
    if mesh is not None and not mesh.empty and explicit_axes(mesh):
      return mesh
  return None


def _batch_spec(x) -> jax.sharding.PartitionSpec:
  s = _sharding(x)
  spec = getattr(s, "spec", None)
  return jax.P(spec[0] if spec else None)


def call_on_auto_axes(module: nnx.Module, fn: Callable, mesh, batch_like, *args):
  """``fn(module, *args)`` on ``mesh`` with its axes Auto; outputs sharded like ``batch_like``'s
  leading axis (module docstring). ``args`` are pytrees of arrays (or None); static settings go
  in ``fn``'s closure. ``module`` is read, not updated."""
  gdef, state = nnx.split(module)

  def inner(state, args):
    return fn(nnx.merge(gdef, state), *args)

  with _mesh_scope(mesh):
    return jax.sharding.auto_axes(inner, out_sharding=_batch_spec(batch_like))(state, args)


def _mesh_scope(mesh):
  """The context ``auto_axes`` needs: none inside ``jax.set_mesh``; for concrete (eager) arrays
  their mesh set; under a trace without a context, the arrays' abstract mesh."""
  if not jax.sharding.get_abstract_mesh().empty:
    return contextlib.nullcontext()
  if isinstance(mesh, jax.sharding.Mesh):
    return jax.sharding.set_mesh(mesh)
  return jax.sharding.use_abstract_mesh(mesh)


def _is_array(x) -> bool:
  return isinstance(x, jax.Array | np.ndarray)


def explicit_ok(method):
  """Decorates a layer's ``__call__`` (or another read-only method): on Explicit mesh axes it runs
  through :func:`call_on_auto_axes` (array arguments pass through ``auto_axes``; everything else,
  e.g. ``layer=i`` or ``mode="sparse"``, stays a Python value); elsewhere it is the method itself.
  Outputs are sharded like the first array argument's leading axis."""
  @functools.wraps(method)
  def wrapper(self, *args, **kwargs):
    # the arguments (and the context) first: the parameter walk only when they say nothing
    mesh = explicit_mesh(args, kwargs)
    if mesh is None:
      mesh = explicit_mesh(nnx.state(self, nnx.Param))
    if mesh is None:
      return method(self, *args, **kwargs)
    leaves, treedef = jax.tree.flatten((args, kwargs))
    arrays = [x for x in leaves if _is_array(x)]

    def call(module, *arrs):
      it = iter(arrs)
      a, k = jax.tree.unflatten(treedef, [next(it) if _is_array(x) else x for x in leaves])
      return method(module, *a, **k)

    return call_on_auto_axes(self, call, mesh, arrays[0] if arrays else None, *arrays)
  return wrapper
