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

from jaxsys.core.errors import InputError, ShapeError
from jaxsys.graphs.blocks import ReformConfig, reform
from jaxsys.graphs.dataset import check_graph, degrees
from jaxsys.graphs.padding import node_mask as padding_node_mask
from jaxsys.ops.graph_attn import GraphTiles

__all__ = ["GraphInputs", "graph_inputs"]


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


def graph_inputs(graph: jraph.GraphsTuple, *, self_loops: bool = True,
                 reform_config: ReformConfig | None = None, padded: bool = False) -> GraphInputs:
  """Builds ``GraphInputs`` on the host from a (possibly padded / batched) ``GraphsTuple``.

  ``self_loops`` appends one self loop per node (the input must have none -- jaxsys datasets
  never do); shapes stay static: ``E' = E + N``. ``padded``: the last graph is jraph-style
  padding (``pad_graph``), its nodes are masked out of dense attention.
  """
  n = check_graph(graph)
  n_node = np.asarray(graph.n_node)
  if n_node.sum() != n:
    raise ShapeError(f"graph.n_node sums to {int(n_node.sum())} but graph.nodes has {n} rows")
  mask = padding_node_mask(graph) if padded else np.ones(n, bool)
  s, r = np.asarray(graph.senders, np.int32), np.asarray(graph.receivers, np.int32)
  real_edge = mask[r]
  if self_loops and np.any((s == r) & real_edge):
    raise InputError("graph already has self loops on real nodes; pass self_loops=False")
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
