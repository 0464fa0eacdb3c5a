"""Node-classification datasets as ``jraph.GraphsTuple`` plus labels and split masks.

Conventions (stable API, shared by the graph transformer and the quantized GNNs):

* ``graph.nodes``: float32 features ``[N, F]``; ``graph.senders`` / ``graph.receivers``: int32
  ``[E]``; an edge ``(s, r)`` carries a message from node ``s`` to node ``r`` (in attention:
  query ``r`` reads key ``s``).
* Edges are undirected graphs stored in both directions, without duplicates and WITHOUT self
  loops (models add them, e.g. ``add_self_loops``), sorted by ``(receiver, sender)`` so that
  segment reductions may use ``indices_are_sorted=True``.
* Arrays are host numpy arrays (partitioners and reorderers work on the host); ``jnp.asarray``
  them at the model boundary.
"""

from __future__ import annotations

import dataclasses

import jraph
import numpy as np

from jaxsys.core.errors import ConfigError, InputError, ShapeError, check_min
from jaxsys.ops.ids import check_ids

__all__ = [
    "add_self_loops", "canonical_edges", "check_edges", "check_graph", "degrees", "make_graph",
    "make_node_dataset", "NodeDataset", "split_masks",
]


@dataclasses.dataclass(frozen=True, eq=False)
class NodeDataset:
  """One graph with node labels and train/val/test masks (all host numpy arrays)."""
  graph: jraph.GraphsTuple
  labels: np.ndarray  # int32 [N]
  train_mask: np.ndarray  # bool [N]
  val_mask: np.ndarray  # bool [N]
  test_mask: np.ndarray  # bool [N]
  num_classes: int
  name: str = ""

  def __post_init__(self):
    g = self.graph
    n = check_graph(g)
    labels = np.asarray(self.labels)
    if labels.shape != (n,):
      raise ShapeError(f"labels must have shape [num_nodes={n}], got {labels.shape}")
    if not np.issubdtype(labels.dtype, np.integer):
      raise ShapeError(f"labels must be integers, got dtype {labels.dtype}")
    check_min(self, 1, "num_classes")
    if n and (labels.min() < 0 or labels.max() >= self.num_classes):
      raise InputError(f"labels must lie in [0, num_classes={self.num_classes}), "
                       f"got range [{labels.min()}, {labels.max()}]")
    object.__setattr__(self, "labels", labels.astype(np.int32))
    for field in ("train_mask", "val_mask", "test_mask"):
      m = np.asarray(getattr(self, field))
      if m.shape != (n,):
        raise ShapeError(f"{field} must have shape [num_nodes={n}], got {m.shape}")
      object.__setattr__(self, field, m.astype(bool))

  @property
  def num_nodes(self) -> int:
    return int(self.graph.nodes.shape[0])

  @property
  def num_edges(self) -> int:
    return int(self.graph.senders.shape[0])

  @property
  def num_features(self) -> int:
    return int(self.graph.nodes.shape[1])

  @property
  def features(self) -> np.ndarray:
    return self.graph.nodes

  @property
  def senders(self) -> np.ndarray:
    return self.graph.senders

  @property
  def receivers(self) -> np.ndarray:
    return self.graph.receivers

  def replace(self, **kw) -> "NodeDataset":
    return dataclasses.replace(self, **kw)


def check_graph(g: jraph.GraphsTuple) -> int:
  """Validates a single-graph ``GraphsTuple`` (features, edge index range); returns N."""
  nodes = np.asarray(g.nodes) if not hasattr(g.nodes, "shape") else g.nodes
  if nodes.ndim != 2:
    raise ShapeError(f"graph.nodes must be features [num_nodes, num_features], got shape {nodes.shape}")
  n = int(nodes.shape[0])
  check_edges(g.senders, g.receivers, n)
  return n


def check_edges(senders, receivers, num_nodes: int):
  """Raises unless senders/receivers are equal-length int vectors in ``[0, num_nodes)``.

  Checked on the arrays as given, before any cast (``jaxsys.ops.ids.check_ids``): float ids are
  a ``ShapeError``, an id out of range (``-1``, ``2**32 + 1``) an ``InputError`` naming it.
  """
  s_shape, r_shape = np.shape(senders), np.shape(receivers)
  if len(s_shape) != 1 or s_shape != r_shape:
    raise ShapeError(f"senders and receivers must be 1-D of equal length, got {s_shape} and {r_shape}")
  check_ids("senders", senders, num_nodes)
  check_ids("receivers", receivers, num_nodes)


def canonical_edges(senders, receivers, num_nodes: int, *, symmetrize: bool = True,
                    self_loops: bool = False) -> tuple[np.ndarray, np.ndarray]:
  """Deduplicated int32 edges sorted by (receiver, sender); both directions if ``symmetrize``.

  Self loops are removed unless ``self_loops`` (then every node gets exactly one).
  """
  check_edges(senders, receivers, num_nodes)
  s = np.asarray(senders, np.int64)
  r = np.asarray(receivers, np.int64)
  if symmetrize:
    s, r = np.concatenate([s, r]), np.concatenate([r, s])
  keep = s != r
  s, r = s[keep], r[keep]
  if self_loops:
    ids = np.arange(num_nodes, dtype=np.int64)
    s, r = np.concatenate([s, ids]), np.concatenate([r, ids])
  key = np.unique(r * num_nodes + s)  # sorted by receiver, then sender
  return (key % num_nodes).astype(np.int32), (key // num_nodes).astype(np.int32)


def add_self_loops(senders, receivers, num_nodes: int) -> tuple[np.ndarray, np.ndarray]:
  """Edges plus one self loop per node (existing self loops are not duplicated)."""
  return canonical_edges(senders, receivers, num_nodes, symmetrize=False, self_loops=True)


def degrees(receivers, num_nodes: int) -> np.ndarray:
  """In-degree per node (equals the degree for symmetric edge lists)."""
  return np.bincount(np.asarray(receivers), minlength=num_nodes).astype(np.int32)


def make_graph(features, senders, receivers) -> jraph.GraphsTuple:
  """A one-graph ``GraphsTuple`` from host arrays (no edge features, no globals)."""
  x = np.asarray(features, np.float32)
  if x.ndim != 2:
    raise ShapeError(f"features must be [num_nodes, num_features], got shape {x.shape}")
  check_edges(senders, receivers, x.shape[0])  # before the int32 cast, which would wrap
  s = np.asarray(senders, np.int32)
  r = np.asarray(receivers, np.int32)
  return jraph.GraphsTuple(nodes=x, edges=None, senders=s, receivers=r,
                           n_node=np.asarray([x.shape[0]], np.int32),
                           n_edge=np.asarray([s.shape[0]], np.int32), globals=None)


def make_node_dataset(features, senders, receivers, labels, *, train_mask, val_mask, test_mask,
                      num_classes: int | None = None, name: str = "",
                      symmetrize: bool = True) -> NodeDataset:
  """Builds a ``NodeDataset`` with canonical edges (both directions, no dups, no self loops)."""
  x = np.asarray(features, np.float32)
  if x.ndim != 2:
    raise ShapeError(f"features must be [num_nodes, num_features], got shape {x.shape}")
  n = x.shape[0]
  labels = np.asarray(labels)
  if labels.shape != (n,):
    raise ShapeError(f"labels must have shape [num_nodes={n}] (features have {n} rows), got {labels.shape}")
  s, r = canonical_edges(senders, receivers, n, symmetrize=symmetrize)
  if num_classes is None:
    num_classes = int(labels.max()) + 1 if n else 1
  return NodeDataset(make_graph(x, s, r), labels, train_mask, val_mask, test_mask,
                     int(num_classes), name)


def split_masks(num_nodes: int, labels: np.ndarray, num_classes: int, *, train_per_class: int,
                num_val: int, num_test: int, seed: int = 0):
  """Planetoid-style split: ``train_per_class`` nodes per class, then val and test at random."""
  rng = np.random.default_rng(seed)
  order = rng.permutation(num_nodes)
  train = np.zeros(num_nodes, bool)
  for c in range(num_classes):
    train[order[labels[order] == c][:train_per_class]] = True
  rest = order[~train[order]]
  if num_val + num_test > rest.size:
    raise ConfigError(f"{num_val=} + {num_test=} exceeds the {rest.size} nodes left after training nodes")
  val = np.zeros(num_nodes, bool)
  test = np.zeros(num_nodes, bool)
  val[rest[:num_val]] = True
  test[rest[num_val:num_val + num_test]] = True
  return train, val, test
