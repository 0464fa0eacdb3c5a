"""Cluster-aware graph parallelism (TorchGT section 4.2): nodes sharded by METIS cluster, halo
exchange of the boundary keys/values, dense steps via sequence-parallel attention.

Host side, ``plan_graph_partition`` partitions the graph into ``P`` clusters (one per device on
mesh axis ``axis``) and lays nodes out in ``P`` equal slabs of ``n_local`` slots (cluster ``p``
in slab ``p``, padded). For every device pair it lists the boundary nodes whose keys/values the
other side needs (cross-partition edges). Device side, inside ``shard_map``:

* ``halo_exchange``: each device gathers the rows every peer needs into ``[P, h_max, ...]`` and
  one ``all_to_all`` delivers them: a device receives only halo rows (``P * h_max`` instead of
  the ``P * n_local`` rows of an all-gather), appended after its local rows.
* sparse attention runs locally on ``[local + halo]`` keys with edges re-indexed on the host.
* dense (global) attention uses ``jaxsys.parallel.sequence_parallel_attention_shard`` (MM-SP;
  "ring" over the graph axis by default, "ulysses" when heads divide) or an all-gather of K/V.

``graph_parallel_apply`` runs a ``GraphTransformer`` forward under ``shard_map``; gradients of a
loss built on it are taken outside (``jax.grad`` transposes the program: the all_to_all's
transpose sends halo cotangents back to their owners, replicated parameters get psum'd).

Usage::

  plan = plan_graph_partition(ds, num_parts=8)
  mesh = make_mesh({"graph": 8})
  logits = graph_parallel_apply(model, plan, mesh)     # [P * n_local, C] in slab order
  logits_orig = plan.to_original(logits)               # [N, C] original node order
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxsys.core.errors import ConfigError
from jaxsys.core.mesh import explicit_axes, place, program_mesh, put
from jaxsys.core.step import make_train_step
from jaxsys.graphs.dataset import NodeDataset, degrees
from jaxsys.graphs.partition import metis_partition
from jaxsys.graphs.inputs import GraphInputs
from jaxsys.graphs.node_loss import masked_node_cross_entropy
from jaxsys.ops.graph_attn import sparse_graph_attention

__all__ = [
    "DENSE_STRATEGIES", "graph_parallel_apply", "graph_parallel_loss", "GraphPartitionPlan",
    "halo_exchange", "make_graph_parallel_step", "plan_arrays", "plan_graph_partition",
]

DENSE_STRATEGIES = ("ring", "ulysses", "allgather")


@dataclasses.dataclass(frozen=True, eq=False)
class GraphPartitionPlan:
  """Host-side layout of a graph over ``num_parts`` devices (arrays stacked per device)."""
  num_parts: int
  n_local: int  # slots per device (max cluster size + at least one padding slot)
  h_max: int  # halo rows sent per device pair (padded)
  slot_of: np.ndarray  # int64 [N] original node -> global slot
  node_of_slot: np.ndarray  # int64 [P*n_local] slot -> original node (-1 for padding)
  senders: np.ndarray  # int32 [P, e_max] into [local (n_local) + halo (P*h_max)]
  receivers: np.ndarray  # int32 [P, e_max] local, sorted
  send_idx: np.ndarray  # int32 [P, P, h_max] local rows device p sends to device d
  features: np.ndarray  # float32 [P*n_local, F]
  degree: np.ndarray  # int32 [P*n_local]
  node_mask: np.ndarray  # bool [P*n_local]
  num_halo: int  # real halo rows (sum over pairs)
  num_edges: int  # real edges incl. self loops

  @property
  def num_slots(self) -> int:
    return self.num_parts * self.n_local

  def to_slots(self, x, fill=0):
    """Per-node array (original order) -> slab layout ``[P*n_local, ...]``."""
    x = np.asarray(x)
    out = np.full((self.num_slots,) + x.shape[1:], fill, x.dtype)
    out[self.slot_of] = x
    return out

  def to_original(self, y):
    """Slab-layout rows -> original node order ``[N, ...]`` (replicated when ``y`` is typed
    sharded on Explicit mesh axes: a gather there must name its output sharding)."""
    idx = jnp.asarray(self.slot_of)
    if explicit_axes(jax.typeof(y).sharding.mesh):
      return y.at[idx].get(out_sharding=P())
    return y[idx]

  def halo_fraction(self) -> float:
    """Halo rows received / rows an all-gather of K/V would receive."""
    return self.num_halo / max(self.num_parts * (self.num_parts - 1) * self.n_local, 1)


def plan_graph_partition(ds: NodeDataset, num_parts: int, *, parts=None, self_loops: bool = True,
                         seed: int = 0, multiple: int = 8) -> GraphPartitionPlan:
  """Partitions ``ds`` (METIS unless ``parts`` is given) and builds the per-device layout."""
  n = ds.num_nodes
  if not 1 <= num_parts <= n:
    raise ConfigError(f"{num_parts=} must lie in [1, num_nodes={n}]")
  if parts is None:
    parts = metis_partition(ds.senders, ds.receivers, n, num_parts, seed=seed)
  parts = np.asarray(parts, np.int64)
  if parts.shape != (n,) or parts.min() < 0 or parts.max() >= num_parts:
    raise ConfigError(f"parts must be int[num_nodes={n}] in [0, {num_parts})")
  sizes = np.bincount(parts, minlength=num_parts)
  n_local = int(-(-(sizes.max() + 1) // multiple) * multiple)  # >= 1 padding slot per device
  order = np.argsort(parts, kind="stable")
  rank = np.empty(n, np.int64)
  starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
  rank[order] = np.arange(n) - starts[parts[order]]
  slot_of = parts * n_local + rank
  node_of_slot = np.full(num_parts * n_local, -1, np.int64)
  node_of_slot[slot_of] = np.arange(n)

  s, r = ds.senders.astype(np.int64), ds.receivers.astype(np.int64)
  if self_loops:
    ids = np.arange(n)
    s, r = np.concatenate([s, ids]), np.concatenate([r, ids])
  ps, pr = parts[s], parts[r]
  remote = ps != pr
  # halo lists: for device pair (src p -> dst d), the unique local ranks of p's nodes d needs
  pair_key = (ps[remote] * num_parts + pr[remote]) * n + s[remote]
  uniq = np.unique(pair_key)
  u_pair, u_node = uniq // n, uniq % n
  pair_counts = np.bincount(u_pair, minlength=num_parts * num_parts)
  h_max = int(max(pair_counts.max(initial=0), 1))
  pair_start = np.concatenate([[0], np.cumsum(pair_counts)[:-1]])
  pos_in_pair = np.arange(uniq.size) - pair_start[u_pair]
  send_idx = np.zeros((num_parts, num_parts, h_max), np.int32)
  send_idx[u_pair // num_parts, u_pair % num_parts, pos_in_pair] = rank[u_node]
  # edge re-indexing: local sender rank, or n_local + src_part * h_max + halo position
  s_local = rank[s].copy()
  edge_pair_key = (ps * num_parts + pr) * n + s
  hpos = np.searchsorted(uniq, edge_pair_key[remote])
  s_local[remote] = n_local + ps[remote] * h_max + pos_in_pair[hpos]
  r_local = rank[r]
  e_counts = np.bincount(pr, minlength=num_parts)
  e_max = int(-(-max(e_counts.max(), 1) // multiple) * multiple)
  senders = np.full((num_parts, e_max), n_local - 1, np.int32)  # padding: last slot -> itself
  receivers = np.full((num_parts, e_max), n_local - 1, np.int32)
  for p in range(num_parts):
    sel = pr == p
    o = np.lexsort((s_local[sel], r_local[sel]))
    senders[p, :sel.sum()] = s_local[sel][o]
    receivers[p, :sel.sum()] = r_local[sel][o]
  plan = GraphPartitionPlan(num_parts, n_local, h_max, slot_of, node_of_slot, senders, receivers,
                            send_idx, None, None, None, int(uniq.size), int(s.size))
  feats = plan.to_slots(ds.features.astype(np.float32))
  deg = plan.to_slots(degrees(ds.receivers, n))
  mask = plan.to_slots(np.ones(n, bool), fill=False)
  return dataclasses.replace(plan, features=feats, degree=deg, node_mask=mask)


# ----------------------------------------------------------------------------- device side

def halo_exchange(x, send_idx, axis: str):
  """Inside ``shard_map``: local rows ``x [n_local, ...]`` -> ``[n_local + P*h_max, ...]``.

  ``send_idx [P, h_max]``: local rows to send to each device. One ``all_to_all``; received
  block ``p`` holds device p's rows for us.
  """
  num_parts, h_max = send_idx.shape
  buf = x[send_idx.reshape(-1)]  # [P*h_max, ...] block d goes to device d
  recv = jax.lax.all_to_all(buf, axis, 0, 0, tiled=True)  # block p came from device p
  return jnp.concatenate([x, recv], axis=0)


def _dense_shard_attention(q, k, v, node_mask, axis, strategy, num_parts):
  """Global attention over all shards; padding slots are invisible keys."""
  seg = jnp.where(node_mask, 0, -1)[None]  # [1, n_local]
  if strategy == "allgather":
    from jaxsys.ops.attn import attention
    kg = jax.lax.all_gather(k, axis, axis=0, tiled=True)
    vg = jax.lax.all_gather(v, axis, axis=0, tiled=True)
    sg = jax.lax.all_gather(seg, axis, axis=1, tiled=True)
    qs = jnp.zeros_like(seg)
    return attention(q[None], kg[None], vg[None], segment_ids=(qs, sg), q_offset=0)[0]
  from jaxsys.parallel.api import SPPlan, sequence_parallel_attention_shard
  if strategy == "ring":
    plan = SPPlan("ring", (axis,), (), num_parts, 1, "contiguous")
  else:
    plan = SPPlan("ulysses", (), (axis,), 1, num_parts, "contiguous")
  qs = jnp.zeros_like(seg)
  return sequence_parallel_attention_shard(q[None], k[None], v[None], plan=plan,
                                           segment_ids=(qs, seg))[0]


def graph_parallel_apply(model, plan: GraphPartitionPlan, mesh: Mesh, *, axis: str = "graph",
                         dense_step: bool = False, dense_strategy: str = "ring", features=None,
                         arrays: dict | None = None):
  """Forward of a ``GraphTransformer`` (node task) with nodes sharded over ``mesh[axis]``.

  Returns logits ``[P*n_local, C]`` in slab order (``plan.to_original`` restores node order).
  Differentiable w.r.t. the model state and ``features``. ``arrays``: ``plan_arrays(...)``
  (built here when None; inside ``jit`` pass them as arguments).
  """
  if axis not in mesh.axis_names or mesh.shape[axis] != plan.num_parts:
    raise ConfigError(f"mesh axis {axis!r} must exist with size num_parts={plan.num_parts}; "
                      f"mesh is {dict(mesh.shape)}")
  if dense_strategy not in DENSE_STRATEGIES:
    raise ConfigError(f"{dense_strategy=} must be one of {DENSE_STRATEGIES}")
  graphdef, state = nnx.split(model)
  arrays = plan_arrays(plan, mesh, axis) if arrays is None else arrays
  feats = arrays["features"] if features is None else features
  return _apply(graphdef, state, feats, arrays, plan, mesh, axis, dense_step, dense_strategy)


def plan_arrays(plan: GraphPartitionPlan, mesh: Mesh, axis: str = "graph") -> dict:
  """The plan's per-device arrays placed on the mesh (pass them as jit arguments so a jitted
  step does not embed graph-sized constants)."""
  shard = NamedSharding(program_mesh(mesh), P(axis))
  names = ("senders", "receivers", "send_idx", "degree", "node_mask", "features")
  return put({k: getattr(plan, k) for k in names}, shard)  # host -> shards, no reshard program


def _apply(graphdef, state, feats, arrays, plan, mesh, axis, dense_step, dense_strategy):
  mesh = program_mesh(mesh)  # Explicit axes: see jaxsys.core.mesh
  state = jax.tree.map(lambda t: place(t, P(), mesh), state)
  feats = place(feats, P(axis), mesh)
  arrays = [place(arrays[k], P(axis), mesh)
            for k in ("senders", "receivers", "send_idx", "degree", "node_mask")]
  fn = _sharded_forward(graphdef, plan.num_parts, mesh, axis, bool(dense_step), dense_strategy)
  return fn(state, feats, *arrays)


@functools.lru_cache(maxsize=32)
def _sharded_forward(graphdef, num_parts, mesh, axis, dense_step, dense_strategy):
  """The jitted shard_map forward, one per (model structure, mesh, step kind). A shard_map called
  outside a traced program runs eagerly, one compiled program per primitive (~470 for a 2-layer
  GT: 40 s for 128 nodes on CPU); inside a jitted step this jit is inlined."""

  def body(state, x, senders, receivers, send_idx, degree, node_mask):
    model = nnx.merge(graphdef, state)
    senders, receivers, send_idx = senders[0], receivers[0], send_idx[0]
    n_local = x.shape[0]
    inputs = GraphInputs(senders, receivers, degree, node_mask,
                         jnp.zeros((n_local,), jnp.int32), jnp.asarray([n_local], jnp.int32))

    def attention_fn(q, k, v, mode):
      if mode == "dense":
        return _dense_shard_attention(q, k, v, node_mask, axis, dense_strategy, num_parts)
      k_ext = halo_exchange(k, send_idx, axis)
      v_ext = halo_exchange(v, send_idx, axis)
      return sparse_graph_attention(q, k_ext, v_ext, senders, receivers, indices_are_sorted=True)

    return model(x, inputs, dense_step=dense_step, attention_fn=attention_fn)

  spec = P(axis)
  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), spec, spec, spec, spec, spec, spec),
                               out_specs=spec, check_vma=False))


def graph_parallel_loss(model, plan: GraphPartitionPlan, mesh: Mesh, labels, train_mask, *,
                        axis: str = "graph", dense_step: bool = False,
                        dense_strategy: str = "ring", arrays: dict | None = None):
  """Masked mean cross-entropy of the graph-parallel forward (labels int, mask bool, both in slab
  layout)."""
  logits = graph_parallel_apply(model, plan, mesh, axis=axis, dense_step=dense_step,
                                dense_strategy=dense_strategy, arrays=arrays)
  return masked_node_cross_entropy(logits, labels, train_mask)


def make_graph_parallel_step(plan: GraphPartitionPlan, mesh: Mesh, optimizer_tx, *,
                             axis: str = "graph", dense_strategy: str = "ring"):
  """A jitted ``step(graphdef, params, rest, opt_state, (labels, mask), dense_step)`` ->
  ``(params, opt_state, loss)`` training a ``GraphTransformer`` whose forward runs under
  ``shard_map`` (graph arrays are passed as arguments, not constants)."""
  arrays = plan_arrays(plan, mesh, axis)

  def step(graphdef, params, rest, opt_state, batch, dense_step):
    return _step(graphdef, params, rest, opt_state, batch, dense_step, arrays)

  @functools.partial(jax.jit, static_argnums=(0, 5))
  def _step(graphdef, params, rest, opt_state, batch, dense_step, arrays):
    labels, mask = batch

    def loss_fn(params):
      model = nnx.merge(graphdef, params, rest)
      return graph_parallel_loss(model, plan, mesh, labels, mask, axis=axis,
                                 dense_step=dense_step, dense_strategy=dense_strategy,
                                 arrays=arrays)

    params, opt_state, loss, _ = make_train_step(loss_fn, optimizer_tx, jit=False)(params, opt_state)
    return params, opt_state, loss

  return step
