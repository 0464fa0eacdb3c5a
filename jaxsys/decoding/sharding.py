"""Tensor-parallel decoding: the one place engines turn a user's mesh into their own.

Decoding engines (``serving.ServingEngine``, ``speculative.RolloutEngine``) shard over the "model"
axis only (heads, kv heads and their cache, mlp and vocab by the "tp" rules); an FSDP axis buys a
decoder nothing (every step would gather every weight). :func:`tp_mesh` checks the mesh, places the
parameters and returns the mesh's Auto twin (the layers' layout annotations are hints there);
:func:`kv_spec` is the placement of a contiguous ``[batch, length, kv_heads, head_dim]`` cache.
"""

from __future__ import annotations

import jax

from jaxsys.core.errors import ConfigError
from jaxsys.core.mesh import auto_mesh
from jaxsys.nn.layers import shard_params

__all__ = ["kv_spec", "tp_mesh"]


def tp_mesh(model, mesh, engine: str = "the engine"):
  """The Auto twin of ``mesh`` with ``model``'s parameters placed on it by the "tp" rules (in
  place), or None for ``mesh=None``. Every axis but "model" must have size 1, and the model's kv
  heads must divide over "model" (each device serves whole kv heads)."""
  if mesh is None:
    return None
  extra = {a: n for a, n in mesh.shape.items() if a != "model" and n > 1}
  if extra:
    raise ConfigError(f"{engine} shards over the 'model' axis only (tensor parallelism); "
                      f"mesh {dict(mesh.shape)} also has {extra}")
  mesh = auto_mesh(mesh)
  kv, tp = model.config.num_kv_heads, mesh.shape.get("model", 1)
  if kv % tp:
    raise ConfigError(f"num_kv_heads={kv} must be a multiple of the mesh's model={tp} axis: each "
                      "device serves whole kv heads (and their cache)")
  shard_params(model, mesh, "tp")
  return mesh


def kv_spec(mesh) -> jax.sharding.PartitionSpec:
  """``[batch, length, kv_heads, head_dim]`` caches: kv heads over "model" (when the mesh has it)."""
  return jax.P(None, None, "model" if "model" in mesh.shape else None, None)
