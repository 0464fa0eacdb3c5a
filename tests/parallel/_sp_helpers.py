"""Shared helpers for the parallel tests: mesh kinds, inputs, the single-device reference."""

import contextlib
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType

from jaxsys.core.mesh import make_mesh
from jaxsys.ops import attention
from jaxsys.parallel import sequence_parallel_attention

IMPL = "reference"  # per-block attention backend under test (the reference is always "reference")

# Every program must run on all three: jax.make_mesh's default (Explicit axes: shardings are
# types, gathers must name their output sharding), jax.make_mesh with Auto axes, and ours.
MESH_KINDS = ("explicit", "auto", "jaxsys")


def build_mesh(kind, axes, devices=None):
  """A mesh of ``kind`` (one of ``MESH_KINDS``) with ``axes = {name: size}``."""
  devices = list(jax.devices()[:math.prod(axes.values())] if devices is None else devices)
  if kind == "jaxsys":
    return make_mesh(axes, devices)
  types = {} if kind == "explicit" else {"axis_types": (AxisType.Auto,) * len(axes)}
  mesh = jax.make_mesh(tuple(axes.values()), tuple(axes), devices=devices, **types)
  want = AxisType.Explicit if kind == "explicit" else AxisType.Auto
  assert all(t == want for t in mesh.axis_types), mesh.axis_types
  return mesh


def mesh_context(mesh, inside: bool):
  """``jax.set_mesh(mesh)`` (``jax.sharding.use_mesh`` where that exists) or no context."""
  use = getattr(jax.sharding, "use_mesh", jax.set_mesh)
  return use(mesh) if inside else contextlib.nullcontext()


def inputs(b=1, s=32, h=8, hk=2, d=8, dtype=jnp.float32, seed=0):
  ks = jax.random.split(jax.random.PRNGKey(seed), 4)
  q = jax.random.normal(ks[0], (b, s, h, d), jnp.float32).astype(dtype)
  k = jax.random.normal(ks[1], (b, s, hk, d), jnp.float32).astype(dtype)
  v = jax.random.normal(ks[2], (b, s, hk, d), jnp.float32).astype(dtype)
  do = jax.random.normal(ks[3], (b, s, h, d), jnp.float32).astype(dtype)
  return q, k, v, do


def packed_segments(b, s, seed=0):
  """Packed sequences with boundaries that straddle shard and chunk boundaries."""
  rng = np.random.default_rng(seed)
  cuts = np.sort(rng.choice(np.arange(1, s), size=3, replace=False))
  row = np.searchsorted(cuts, np.arange(s), side="right")
  return jnp.asarray(np.tile(row, (b, 1)), jnp.int32)


def out_and_grads(fn, q, k, v, do):
  """Output and (dq, dk, dv) for cotangent ``do``, in one jitted program."""
  def both(q, k, v):
    out, vjp = jax.vjp(fn, q, k, v)
    return out, vjp(do)
  return jax.jit(both)(q, k, v)


def sp_vs_reference(strategy, mesh_shape, *, mask, segment_ids=None, dtype=jnp.float32, hk=2,
                    s=32, h=8, **kw):
  q, k, v, do = inputs(s=s, h=h, hk=hk, dtype=dtype)
  mesh = make_mesh({"ring": mesh_shape[0], "ulysses": mesh_shape[1]})
  sp = lambda q, k, v: sequence_parallel_attention(  # noqa: E731
      q, k, v, mesh=mesh, strategy=strategy, mask=mask, segment_ids=segment_ids, impl=IMPL, **kw)
  # The reference runs in f32 at HIGHEST precision whatever the input dtype.
  ref = lambda q, k, v: attention(q, k, v, mask=mask, segment_ids=segment_ids,  # noqa: E731
                                  impl="reference")
  f32 = lambda t: t.astype(jnp.float32)  # noqa: E731
  got = out_and_grads(sp, q, k, v, do)
  want = out_and_grads(ref, f32(q), f32(k), f32(v), f32(do))
  return got, want


def max_err(got, want):
  flat_g, flat_w = jax.tree.leaves(got), jax.tree.leaves(want)
  return [float(jnp.max(jnp.abs(g.astype(jnp.float32) - w))) for g, w in zip(flat_g, flat_w)]
