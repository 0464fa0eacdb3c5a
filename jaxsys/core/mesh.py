"""Device meshes and the logical-axis rules table (DESIGN principle 4).

Layers name their array axes logically ("batch", "seq", "heads", ...); one rules table maps
each logical name to zero or more mesh axes ("data", "ring", "ulysses", "model"). Changing the
parallelism of a model means changing the mesh or the table, never the layer code.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxsys.core.errors import ConfigError

# Logical axis -> mesh axes. A tuple shards over several mesh axes (major to minor); None
# replicates. Mesh axes absent from the mesh in use are dropped when a spec is built.
DEFAULT_RULES: dict[str, tuple[str, ...] | str | None] = {
    "batch": "data",
    "seq": ("ring", "ulysses"),
    "heads": "model",
    "kv_heads": "model",
    "head_dim": None,
    "embed": None,
    "mlp": "model",
    "vocab": "model",
    "nodes": "graph",
    "edges": "graph",
    "features": None,
    "frames": ("ring", "ulysses"),
}

MESH_AXES = ("data", "ring", "ulysses", "model", "graph")


def make_mesh(axes: Mapping[str, int] | None = None, devices: Sequence | None = None) -> Mesh:
  """Builds a mesh with named axes, e.g. ``make_mesh({"ring": 2, "ulysses": 4})``.

  One axis may be ``-1`` and absorbs the remaining devices. The product of sizes must equal
  the number of devices used; with ``axes=None`` all devices go on one "data" axis.
  """
  devices = list(jax.devices() if devices is None else devices)
  axes = dict(axes or {"data": -1})
  free = [k for k, v in axes.items() if v == -1]
  if len(free) > 1:
    raise ConfigError(f"axes={axes} may contain at most one -1 size")
  known = math.prod(v for v in axes.values() if v != -1)
  for k, v in axes.items():
    if v != -1 and v <= 0:
      raise ConfigError(f"mesh axis {k!r} has size {v}; sizes must be positive")
  if free:
    if len(devices) % known:
      raise ConfigError(f"{len(devices)} devices cannot fill axes={axes}")
    axes[free[0]] = len(devices) // known
  total = math.prod(axes.values())
  if total > len(devices):
    raise ConfigError(f"axes={axes} need {total} devices but only {len(devices)} are available")
  grid = np.asarray(devices[:total], dtype=object).reshape(tuple(axes.values()))
  return Mesh(grid, tuple(axes))


def logical_to_spec(logical: Sequence[str | None], mesh: Mesh | None = None,
                    rules: Mapping[str, tuple[str, ...] | str | None] | None = None) -> PartitionSpec:
  """Maps logical axis names to a ``PartitionSpec`` over the axes ``mesh`` actually has.

  A mesh axis is used at most once; a later logical axis that maps to an already used mesh
  axis is replicated instead (so ("heads", "kv_heads") both wanting "model" stays valid).
  """
  rules = DEFAULT_RULES if rules is None else rules
  present = set(mesh.axis_names) if mesh is not None else set(MESH_AXES)
  used: set[str] = set()
  spec = []
  for name in logical:
    if name is None:
      spec.append(None)
      continue
    if name not in rules:
      raise ConfigError(f"logical axis {name!r} has no rule; known: {sorted(rules)}")
    target = rules[name]
    target = (target,) if isinstance(target, str) else tuple(target or ())
    target = tuple(a for a in target if a in present and a not in used
                   and (mesh is None or mesh.shape[a] > 1))
    used.update(target)
    spec.append(None if not target else target[0] if len(target) == 1 else target)
  return PartitionSpec(*spec)


def logical_sharding(logical: Sequence[str | None], mesh: Mesh, rules=None) -> NamedSharding:
  return NamedSharding(mesh, logical_to_spec(logical, mesh, rules))


def shard_logically(x, logical: Sequence[str | None], mesh: Mesh | None, rules=None):
  """``with_sharding_constraint`` by logical names; identity without a mesh."""
  if mesh is None:
    return x
  if len(logical) != x.ndim:
    raise ConfigError(f"logical axes {tuple(logical)} do not match array rank {x.ndim}")
  return jax.lax.with_sharding_constraint(x, logical_sharding(logical, mesh, rules))
