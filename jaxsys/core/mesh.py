"""Device meshes and the logical-axis rules table (DESIGN principle 4).

Layers name their array axes logically ("batch", "seq", "heads", ...); one rules table maps
each logical name to zero or more mesh axes ("data", "ring", "ulysses", "model"). Changing the
parallelism of a model means changing the mesh or the table, never the layer code.

Axis types. ``make_mesh`` here builds Auto axes (the compiler places intermediates);
``jax.make_mesh`` builds Explicit axes by default, where shardings are part of array types, a
``with_sharding_constraint`` may only name Auto axes, and gathers, uneven slices and mixed
unsharded/sharded operands need a mesh context (``jax.set_mesh``). Every jaxsys program takes
either kind:

* :func:`place` puts an array on a spec whatever the axis types (reshard on Explicit axes,
  constraint on Auto axes, Manual axes left to ``shard_map``); :func:`hint` is the layers'
  layout hint: it constrains Auto axes only, since on Explicit axes the array's type already
  says where it lives (a forced reshard there would, e.g., leave logits vocab-sharded for a
  loss whose label gather cannot name its output sharding);
* :func:`program_mesh` is the mesh a ``shard_map`` program runs on: the given mesh inside an
  Explicit mesh context, else its Auto twin (:func:`auto_mesh`), so that without a context the
  outputs mix with unsharded arrays exactly as on an Auto mesh;
* :func:`on_auto_axes` runs a whole entry point (``jaxsys.train.train``) on the Auto twin, for
  model code whose sharding annotations are compiler hints.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Mapping, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from jaxsys.core.errors import ConfigError

__all__ = [
    "auto_mesh", "axes_of_type", "DEFAULT_RULES", "entry_axes", "entry_ways", "explicit_axes", "hint", "logical_sharding",
    "logical_to_spec", "make_mesh", "MESH_AXES", "on_auto_axes", "parse_axes", "place", "program_mesh",
    "put", "RULE_SETS", "rules_for", "shard_logically",
]

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

#: Named rule sets for parameters (activations always follow :data:`DEFAULT_RULES`):
#:
#: * ``"tp"``: tensor parallelism only: heads, kv heads, mlp and vocab over "model"; everything
#:   else (and the optimizer state beside it) replicated over "data".
#: * ``"fsdp"``: the same, plus every parameter's "embed" axis over "data" (ZeRO-3 / FSDP as
#:   levanter and maxtext map it): parameters and optimizer state shrink as 1 / (data x model)
#:   per device, and the compiler gathers each layer's weights where they are used (Auto axes).
#:   On a mesh without "model" it is pure FSDP.
RULE_SETS: dict[str, dict] = {
    "tp": DEFAULT_RULES,
    "fsdp": {**DEFAULT_RULES, "embed": "data"},
}


def rules_for(rules) -> Mapping:
  """A rules table from a :data:`RULE_SETS` name, a mapping (returned as is) or None (``"tp"``)."""
  if rules is None:
    return DEFAULT_RULES
  if isinstance(rules, str):
    if rules not in RULE_SETS:
      raise ConfigError(f"rules={rules!r} must be one of {sorted(RULE_SETS)} or a mapping "
                        "logical axis -> mesh axes")
    return RULE_SETS[rules]
  if not isinstance(rules, Mapping):
    raise ConfigError(f"rules must be a name ({sorted(RULE_SETS)}) or a mapping, got {type(rules).__name__}")
  return rules


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


def parse_axes(text: str) -> dict[str, int]:
  """``"data=4,model=2"`` -> ``{"data": 4, "model": 2}`` (the ``--mesh`` flags' syntax; sizes are
  positive integers, each axis once); ``ConfigError`` naming the text otherwise."""
  axes: dict[str, int] = {}
  for part in text.split(","):
    m = re.fullmatch(r"\s*([A-Za-z_]\w*)\s*=\s*(\d+)\s*", part)
    if not m or int(m.group(2)) < 1:
      raise ConfigError(f"--mesh {text!r}: expected axis=size[,axis=size...] with sizes >= 1, "
                        f"e.g. ring=2,ulysses=4")
    if m.group(1) in axes:
      raise ConfigError(f"--mesh {text!r}: axis {m.group(1)!r} given twice")
    axes[m.group(1)] = int(m.group(2))
  return axes


def logical_to_spec(logical: Sequence[str | None], mesh: Mesh | None = None,
                    rules: Mapping[str, tuple[str, ...] | str | None] | None = None) -> PartitionSpec:
  """Maps logical axis names to a ``PartitionSpec`` over the axes ``mesh`` actually has.

  A mesh axis is used at most once; a later logical axis that maps to an already used mesh
  axis is replicated instead (so ("heads", "kv_heads") both wanting "model" stays valid).
  """
  rules = rules_for(rules)
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
  """Places ``x`` by logical names (:func:`place`, any axis types); identity without a mesh."""
  if mesh is None:
    return x
  if len(logical) != x.ndim:
    raise ConfigError(f"logical axes {tuple(logical)} do not match array rank {x.ndim}")
  return place(x, logical_to_spec(logical, mesh, rules), program_mesh(mesh))


# ----------------------------------------------------------------------------- axis types

def axes_of_type(mesh, kind: AxisType) -> tuple[str, ...]:
  """Names of ``mesh``'s axes of type ``kind`` (``Mesh`` or ``AbstractMesh``; () when empty)."""
  if mesh is None or getattr(mesh, "empty", False):
    return ()
  types = getattr(mesh, "axis_types", None) or (AxisType.Auto,) * len(mesh.axis_names)
  return tuple(n for n, t in zip(mesh.axis_names, types) if t == kind)


def explicit_axes(mesh) -> tuple[str, ...]:
  return axes_of_type(mesh, AxisType.Explicit)


def auto_mesh(mesh: Mesh) -> Mesh:
  """``mesh`` with every axis Auto (same devices, same names); ``mesh`` itself if it is already."""
  if not explicit_axes(mesh):
    return mesh
  return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))


def program_mesh(mesh: Mesh) -> Mesh:
  """The mesh a ``shard_map`` program over ``mesh`` runs on.

  Explicit axes only work where the caller holds an Explicit mesh context (``jax.set_mesh``):
  there the program runs on ``mesh`` itself, resharding its inputs (:func:`place`) and
  returning explicitly typed outputs. Without one (or under an Auto context) it runs on the
  Auto twin: same devices, same collectives, outputs typed like those of an Auto mesh, so
  callers' unsharded parameters and losses (and ``jax.grad`` of them) keep working.
  """
  if not explicit_axes(mesh):
    return mesh
  if explicit_axes(jax.sharding.get_abstract_mesh()):
    return mesh
  return auto_mesh(mesh)


def on_auto_axes(fn):
  """Decorates an entry point whose ``mesh=`` keyword places arrays and scopes a compiled step.

  An Explicit ``mesh`` is replaced by its Auto twin and the call runs under
  ``jax.set_mesh(twin)`` (so it also works inside a caller's Explicit mesh context): the model
  layers annotate activations as hints, and on Explicit axes a vocab-sharded embedding gather
  or a loss's label gather would have to name output shardings instead.
  """
  @functools.wraps(fn)
  def wrapper(*args, mesh=None, **kwargs):
    if mesh is None or not explicit_axes(mesh):
      return fn(*args, mesh=mesh, **kwargs)
    twin = auto_mesh(mesh)
    with jax.set_mesh(twin):
      return fn(*args, mesh=twin, **kwargs)
  return wrapper


def entry_axes(entry) -> tuple[str, ...]:
  """The mesh axes of one ``PartitionSpec`` entry (None, an axis name or a tuple of names)."""
  return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def entry_ways(entry, mesh_shape: Mapping[str, int]) -> int:
  """How many shards one ``PartitionSpec`` entry cuts its dimension into on ``mesh_shape``."""
  return math.prod(mesh_shape[a] for a in entry_axes(entry))


def _keep_axes(spec: PartitionSpec, keep) -> PartitionSpec:
  """``spec`` with every mesh axis not in ``keep`` dropped (entries become None or shrink)."""
  out = []
  for entry in spec:
    names = tuple(a for a in entry_axes(entry) if a in keep)
    out.append(None if not names else names[0] if len(names) == 1 else names)
  return PartitionSpec(*out)


def put(tree, shardings):
  """``jax.device_put(tree, shardings)`` (a sharding or a matching tree of them), outside ``jit``.

  On XLA:CPU, splitting an array that lives on one device over a mesh compiles a slicing program
  per shape and layout (0.05-0.2 s each: ~5 s to place a model's parameters on 8 simulated
  devices); those arrays are sent from host memory instead, where the shards are cut without a
  program. The placement is the same. Other backends, and arrays already spread over devices,
  go to ``jax.device_put`` as they are."""
  if jax.default_backend() == "cpu":
    def host(x):
      single = isinstance(x, jax.Array) and x.is_fully_addressable and len(x.devices()) == 1
      return np.asarray(x) if single and not jax.numpy.issubdtype(x.dtype, jax.dtypes.prng_key) else x
    tree = jax.tree.map(host, tree)
  return jax.device_put(tree, shardings)


def hint(x, spec: PartitionSpec, mesh=None):
  """A layout hint: ``with_sharding_constraint`` over the Auto axes of ``mesh`` (default: the
  ambient mesh); Explicit and Manual axes are left as the array's type has them."""
  return place(x, spec, mesh, only=AxisType.Auto)


def place(x, spec: PartitionSpec, mesh=None, *, only: AxisType | None = None):
  """Shards ``x`` as ``spec`` on ``mesh`` (default: the ambient mesh) inside or outside ``jit``.

  Explicit axes are resharded (``jax.reshard``: a no-op when the type already matches), Auto
  axes are constrained (``with_sharding_constraint``), Manual axes (inside ``shard_map``) are
  dropped from ``spec``. Identity without a mesh. ``only``: act on axes of that type only.
  """
  mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
  if mesh is None or getattr(mesh, "empty", False):
    return x
  concrete = isinstance(mesh, Mesh)
  as_sharding = lambda s: NamedSharding(mesh, s) if concrete else s  # noqa: E731
  kinds = (AxisType.Explicit, AxisType.Auto) if only is None else (only,)
  explicit = explicit_axes(mesh) if AxisType.Explicit in kinds else ()
  auto = axes_of_type(mesh, AxisType.Auto) if AxisType.Auto in kinds else ()
  if explicit:
    x = jax.reshard(x, as_sharding(_keep_axes(spec, explicit)))
  if auto:
    x = jax.lax.with_sharding_constraint(x, as_sharding(_keep_axes(spec, auto)))
  return x
