"""Static shapes for jit: pad a ``GraphsTuple`` to node/edge buckets (powers of two).

Padding follows jraph's convention: the padded nodes and edges form one extra graph appended
at the end (``n_node[-1]``, ``n_edge[-1]``), and every padded edge connects padded node
``num_real_nodes`` to itself, so no real node ever receives a padded message. Masks
(``node_mask`` / ``edge_mask``) carry the truth; dense attention must use ``node_mask`` to hide
padded keys. Padding therefore never changes the results on real nodes.
"""

from __future__ import annotations

import jraph
import numpy as np

from jaxsys.core.errors import ConfigError, ShapeError
from jaxsys.graphs.dataset import NodeDataset, make_graph


def next_bucket(n: int, minimum: int = 8) -> int:
  """Smallest power of two ``>= max(n, minimum)``."""
  if n < 0:
    raise ConfigError(f"{n=} must be >= 0")
  b = max(int(minimum), 1)
  while b < n:
    b *= 2
  return b


def graph_buckets(num_nodes: int, num_edges: int, *, minimum: int = 8) -> tuple[int, int]:
  """(node_bucket, edge_bucket): powers of two with room for one padding node."""
  return next_bucket(num_nodes + 1, minimum), next_bucket(num_edges, minimum)


def pad_graph(graph: jraph.GraphsTuple, node_bucket: int, edge_bucket: int) -> jraph.GraphsTuple:
  """Pads ``graph`` (host arrays) to exactly ``node_bucket`` nodes and ``edge_bucket`` edges.

  Adds one padding graph (so ``n_node`` gains one entry); needs ``node_bucket > num_nodes``
  when there is anything to pad. Raises ``ShapeError`` if the graph does not fit (never
  truncates).
  """
  x = np.asarray(graph.nodes)
  n, e = x.shape[0], int(np.asarray(graph.senders).shape[0])
  if node_bucket < n + 1:
    raise ShapeError(f"{node_bucket=} must be > num_nodes={n} (room for the padding node)")
  if edge_bucket < e:
    raise ShapeError(f"{edge_bucket=} must be >= num_edges={e}")
  pn, pe = node_bucket - n, edge_bucket - e
  nodes = np.concatenate([x, np.zeros((pn,) + x.shape[1:], x.dtype)])
  fill = np.full(pe, n, np.int32)
  senders = np.concatenate([np.asarray(graph.senders, np.int32), fill])
  receivers = np.concatenate([np.asarray(graph.receivers, np.int32), fill])
  edges = graph.edges
  if edges is not None:
    edges = np.asarray(edges)
    edges = np.concatenate([edges, np.zeros((pe,) + edges.shape[1:], edges.dtype)])
  glob = graph.globals
  if glob is not None:
    glob = np.asarray(glob)
    glob = np.concatenate([glob, np.zeros((1,) + glob.shape[1:], glob.dtype)])
  return jraph.GraphsTuple(
      nodes=nodes, edges=edges, senders=senders, receivers=receivers,
      n_node=np.append(np.asarray(graph.n_node, np.int32), pn).astype(np.int32),
      n_edge=np.append(np.asarray(graph.n_edge, np.int32), pe).astype(np.int32), globals=glob)


def node_mask(graph: jraph.GraphsTuple):
  """bool[N]: True on real nodes (all graphs but the last padding graph)."""
  n_node = np.asarray(graph.n_node)
  total = int(n_node.sum())
  return np.arange(total) < total - int(n_node[-1])


def edge_mask(graph: jraph.GraphsTuple):
  """bool[E]: True on real edges."""
  n_edge = np.asarray(graph.n_edge)
  total = int(n_edge.sum())
  return np.arange(total) < total - int(n_edge[-1])


def pad_dataset(ds: NodeDataset, node_bucket: int | None = None,
                edge_bucket: int | None = None) -> tuple[NodeDataset, np.ndarray]:
  """Pads a ``NodeDataset`` (labels 0 and all split masks False on padding).

  Returns ``(padded, node_mask)``. Buckets default to ``graph_buckets``.
  """
  nb, eb = graph_buckets(ds.num_nodes, ds.num_edges)
  g = pad_graph(ds.graph, node_bucket or nb, edge_bucket or eb)
  pn = g.nodes.shape[0] - ds.num_nodes

  def ext(a, fill):
    return np.concatenate([a, np.full(pn, fill, a.dtype)])

  padded = NodeDataset(g, ext(ds.labels, 0), ext(ds.train_mask, False), ext(ds.val_mask, False),
                       ext(ds.test_mask, False), ds.num_classes, ds.name)
  return padded, node_mask(g)


__all__ = ["next_bucket", "graph_buckets", "pad_graph", "node_mask", "edge_mask", "pad_dataset",
           "make_graph"]
