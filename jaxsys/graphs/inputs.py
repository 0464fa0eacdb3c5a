"""``GraphInputs``: the device-side structure of a graph every graph layer and graph-parallel
program takes, and ``graph_inputs``, which builds it on the host from a ``jraph.GraphsTuple``:
edges (with self loops, sorted by receiver), the ECR split (dense tiles + leftover edges) when
reformation is on, per-node degree, graph ids (batched graphs) and the padding mask.
(``jaxsys.nn.graph`` re-exports both beside the layers.)
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import jraph
import numpy as np

from jaxsys.core.errors import InputError, ShapeError, check_one_of
from jaxsys.graphs.blocks import ReformConfig, reform
from jaxsys.graphs.dataset import check_graph, degrees
from jaxsys.graphs.padding import node_mask as padding_node_mask
from jaxsys.ops.graph_attn import GraphTiles

__all__ = ["DUPLICATES", "GraphInputs", "graph_inputs"]


class GraphInputs(NamedTuple):
  """Device-side graph structure. Optional fields are None when unused."""
  senders: jax.Array  # int32 [E'] (self loops included)
  receivers: jax.Array  # int32 [E'] sorted
  degree: jax.Array  # int32 [N] degree without self loops
  node_mask: jax.Array  # bool [N] real nodes
  graph_ids: jax.Array  # int32 [N] graph of each node (0 for a single graph)
  n_node: jax.Array  # int32 [G] nodes per graph (its static length is the graph count)
  tiles: GraphTiles | None = None  # ECR dense tiles
  rest_senders: jax.Array | None = None  # ECR leftover edges
  rest_receivers: jax.Array | None = None

  @property
  def num_nodes(self) -> int:
    return int(self.degree.shape[0])


DUPLICATES = ("drop", "raise")


def graph_inputs(graph: jraph.GraphsTuple, *, self_loops: bool = True,
                 reform_config: ReformConfig | None = None, padded: bool = False,
                 duplicates: str = "drop") -> GraphInputs:
  """Builds ``GraphInputs`` on the host from a (possibly padded / batched) ``GraphsTuple``.

  ``self_loops`` appends one self loop per node (the input must have none -- jaxsys datasets
  never do); ``padded``: the last graph is jraph-style padding (``pad_graph``), its nodes are
  masked out of dense attention.

  Attention is over the neighbour *set* (every mode: a dense tile holds one bit per node pair),
  so a repeated real edge ``s -> r`` would count twice in the sparse softmax only. With
  ``duplicates="drop"`` (default) repeats are removed (the edge count is ``E' = E - repeats +
  N``; in a padded graph each repeat becomes a padding-node edge instead, so ``E' = E + N`` stays
  the bucket's static size); ``duplicates="raise"`` raises ``InputError`` naming the first one.
  """
  check_one_of("duplicates", duplicates, DUPLICATES)
  n = check_graph(graph)
  n_node = np.asarray(graph.n_node)
  if n_node.sum() != n:
    raise ShapeError(f"graph.n_node sums to {int(n_node.sum())} but graph.nodes has {n} rows")
  mask = padding_node_mask(graph) if padded else np.ones(n, bool)
  s, r = np.asarray(graph.senders, np.int32), np.asarray(graph.receivers, np.int32)
  real_edge = mask[r]
  if self_loops and np.any((s == r) & real_edge):
    raise InputError("graph already has self loops on real nodes; pass self_loops=False")
  dup = _repeats(s, r, real_edge)
  if dup.any():
    if duplicates == "raise":
      i = int(np.flatnonzero(dup)[0])
      raise InputError(f"graph has {int(dup.sum())} repeated edges (first: edge {i}, {s[i]} -> "
                       f"{r[i]}); pass duplicates='drop' to remove them")
    if padded:  # keep the static edge count: repeats become edges of the padding node
      s, r = s.copy(), r.copy()
      s[dup] = r[dup] = n - int(n_node[-1])
    else:
      s, r, real_edge = s[~dup], r[~dup], real_edge[~dup]
  deg = degrees(r[real_edge & (s != r)], n)
  if self_loops:
    ids = np.arange(n, dtype=np.int32)
    s, r = np.concatenate([s, ids]), np.concatenate([r, ids])
  order = np.lexsort((s, r))
  s, r = s[order], r[order]
  graph_ids = np.repeat(np.arange(n_node.size, dtype=np.int32), n_node)
  tiles = rest_s = rest_r = None
  if reform_config is not None:
    rg = reform(s, r, n, reform_config)
    tiles = GraphTiles.from_reformed(rg)
    rest_s, rest_r = jnp.asarray(rg.senders), jnp.asarray(rg.receivers)
  return GraphInputs(jnp.asarray(s), jnp.asarray(r), jnp.asarray(deg), jnp.asarray(mask),
                     jnp.asarray(graph_ids), jnp.asarray(n_node, jnp.int32), tiles, rest_s, rest_r)


def _repeats(s, r, real):
  """bool[E]: real edges equal to an earlier real edge (the first copy is kept)."""
  order = np.lexsort((np.arange(s.size), s, r))   # by receiver, sender, then original position
  ss, rs = s[order], r[order]
  same = np.zeros(s.size, bool)
  same[1:] = (ss[1:] == ss[:-1]) & (rs[1:] == rs[:-1])
  dup = np.zeros(s.size, bool)
  dup[order] = same
  return dup & real
