"""METIS graph partitioning (pymetis) and cluster-contiguous node reordering.

``metis_partition`` splits nodes into ``num_parts`` clusters minimising the edge cut (Karypis &
Kumar 1998). ``cluster_permutation`` relabels nodes contiguously by cluster (TorchGT's
cluster-aware reordering): after it the adjacency is concentrated in diagonal blocks.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxsys.core.errors import ConfigError
from jaxsys.graphs.dataset import NodeDataset, canonical_edges, check_edges, make_graph

__all__ = ["cluster_permutation", "cluster_reorder", "metis_partition", "reorder_dataset", "Reordering"]


def metis_partition(senders, receivers, num_nodes: int, num_parts: int, seed: int = 0) -> np.ndarray:
  """Cluster id ``int32[num_nodes]`` in ``[0, num_parts)`` from METIS (edges symmetrised).

  Raises ``ConfigError`` if ``num_parts`` is not in ``[1, num_nodes]``.
  """
  if num_nodes < 1:
    raise ConfigError(f"{num_nodes=} must be >= 1")
  if not 1 <= num_parts <= num_nodes:
    raise ConfigError(f"{num_parts=} must lie in [1, num_nodes={num_nodes}]")
  check_edges(senders, receivers, num_nodes)
  if num_parts == 1:
    return np.zeros(num_nodes, np.int32)
  import pymetis
  s, r = canonical_edges(senders, receivers, num_nodes, symmetrize=True)
  xadj = np.concatenate([[0], np.cumsum(np.bincount(r, minlength=num_nodes))]).astype(np.int64)
  opts = pymetis.Options()
  opts.seed = int(seed)
  adj = pymetis.CSRAdjacency(xadj, s.astype(np.int64))
  _, parts = pymetis.part_graph(num_parts, adj, options=opts)
  return np.asarray(parts, np.int32)


@dataclasses.dataclass(frozen=True, eq=False)
class Reordering:
  """A node relabelling. ``perm[new] = old``; ``inverse[old] = new``; clusters contiguous.

  ``offsets[c]`` is the first new id of cluster ``c`` (``offsets[-1] == num_nodes``).
  """
  perm: np.ndarray
  inverse: np.ndarray
  offsets: np.ndarray

  @property
  def num_nodes(self) -> int:
    return int(self.perm.shape[0])

  def to_new(self, x):
    """Rows of a per-node array in new order (``x[perm]``)."""
    return x[self.perm]

  def to_old(self, x):
    """Rows of a new-order per-node array back in the original order (``x[inverse]``)."""
    return x[self.inverse]

  def relabel_edges(self, senders, receivers):
    return canonical_edges(self.inverse[np.asarray(senders)], self.inverse[np.asarray(receivers)],
                           self.num_nodes, symmetrize=False)


def cluster_permutation(parts, num_parts: int | None = None) -> Reordering:
  """Stable relabelling that makes every cluster a contiguous id range (in cluster order)."""
  parts = np.asarray(parts)
  if parts.ndim != 1:
    raise ConfigError(f"parts must be 1-D, got shape {parts.shape}")
  num_parts = int(parts.max()) + 1 if num_parts is None else num_parts
  if parts.size and (parts.min() < 0 or parts.max() >= num_parts):
    raise ConfigError(f"parts must lie in [0, num_parts={num_parts})")
  perm = np.argsort(parts, kind="stable").astype(np.int32)
  inverse = np.empty_like(perm)
  inverse[perm] = np.arange(perm.size, dtype=np.int32)
  offsets = np.concatenate([[0], np.cumsum(np.bincount(parts, minlength=num_parts))]).astype(np.int64)
  return Reordering(perm, inverse, offsets)


def reorder_dataset(ds: NodeDataset, order: Reordering) -> NodeDataset:
  """The same dataset with nodes relabelled by ``order`` (edges re-sorted canonically)."""
  if order.num_nodes != ds.num_nodes:
    raise ConfigError(f"reordering has {order.num_nodes} nodes but the dataset has {ds.num_nodes}")
  s, r = order.relabel_edges(ds.senders, ds.receivers)
  g = make_graph(order.to_new(ds.features), s, r)
  return NodeDataset(g, order.to_new(ds.labels), order.to_new(ds.train_mask),
                     order.to_new(ds.val_mask), order.to_new(ds.test_mask), ds.num_classes, ds.name)


def cluster_reorder(ds: NodeDataset, num_parts: int, seed: int = 0) -> tuple[NodeDataset, Reordering]:
  """METIS-partitions ``ds`` and relabels it contiguously by cluster."""
  parts = metis_partition(ds.senders, ds.receivers, ds.num_nodes, num_parts, seed=seed)
  order = cluster_permutation(parts, num_parts)
  return reorder_dataset(ds, order), order
