"""Planetoid citation graphs: the bundled Cora, or cora / citeseer / pubmed from a folder of the
original files.

The data is the Planetoid split of Yang, Cohen & Salakhutdinov, "Revisiting Semi-Supervised
Learning with Graph Embeddings" (ICML 2016), MIT license (see ``jaxsys/assets/planetoid/``).
The original release is eight files per dataset, ``ind.<name>.{x,y,tx,ty,allx,ally,graph,test.index}``
(pickled scipy/numpy objects, read with an unpickler that resolves only those types: a file that
names any other global is an ``InputError`` and never runs). The standard processing, as the reference GCN and PyG loaders do it:

* features / labels = ``allx`` / ``ally`` followed by the test rows ``tx`` / ``ty``, the test rows
  re-ordered so that node ``test.index[i]`` holds test row ``i``;
* train = the ``y`` rows, i.e. indices [0, len(y)); val = the next 500; test = the ``test.index`` nodes;
* CiteSeer's test indices have gaps (15 isolated nodes that are in the graph but have no test row):
  the range [min, max] of ``test.index`` is filled, the missing rows get zero features and label 0,
  and they are in no split (so nothing is trained or scored on them);
* edges: both directions, no duplicates, no self loops, node ids checked against the node count.

Usage::

  ds = jaxsys.graphs.load_planetoid("cora")                          # bundled: 2708 nodes, 10556 edges
  ds = jaxsys.graphs.load_planetoid("citeseer", path="data/planetoid")  # 3327 nodes, 3703 features
"""

from __future__ import annotations

import dataclasses
import os
import pickle
from importlib import resources
from pathlib import Path

import numpy as np

from jaxsys.core.errors import ConfigError, InputError
from jaxsys.graphs.dataset import NodeDataset, make_node_dataset

__all__ = ["AVAILABLE", "STANDARD", "asset_path", "convert_planetoid", "load_planetoid", "read_planetoid"]

AVAILABLE = ("cora",)  # bundled inside the package
STANDARD = ("cora", "citeseer", "pubmed")  # readable from a folder of the original files
_KEYS = ("x", "y", "tx", "ty", "allx", "ally", "graph")


def asset_path(name: str) -> Path:
  return Path(str(resources.files("jaxsys") / "assets" / "planetoid" / f"{name}.npz"))


@dataclasses.dataclass(frozen=True)
class RawPlanetoid:
  """The standard processing of the original files (see the module docstring).

  Attributes:
    features: float32 csr ``[num_nodes, num_features]`` (binary for cora/citeseer, TF-IDF for pubmed).
    labels: int64 ``[num_nodes]``; 0 for CiteSeer's gap nodes.
    edges: int64 ``[2, num_undirected_edges]``, ``edges[0] < edges[1]``, unique.
    train_idx, val_idx, test_idx: int64 node ids of the splits (sorted).
  """
  features: object
  labels: np.ndarray
  edges: np.ndarray
  train_idx: np.ndarray
  val_idx: np.ndarray
  test_idx: np.ndarray


#: The only globals a Planetoid pickle may name: numpy arrays and scalars, scipy's CSR matrix, the
#: adjacency's ``defaultdict(list)`` and the pickle protocol's own object reconstruction.
_ALLOWED = {
    ("numpy", "ndarray"), ("numpy", "dtype"),
    ("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
    ("numpy.core.multiarray", "scalar"), ("numpy._core.multiarray", "scalar"),
    ("scipy.sparse.csr", "csr_matrix"), ("scipy.sparse._csr", "csr_matrix"), ("scipy.sparse", "csr_matrix"),
    ("collections", "defaultdict"), ("builtins", "list"), ("builtins", "dict"), ("builtins", "object"),
    ("copy_reg", "_reconstructor"), ("copyreg", "_reconstructor"),
}


class _PlanetoidUnpickler(pickle.Unpickler):
  """Resolves only :data:`_ALLOWED` globals: a pickle can call any importable function while it
  loads, so a file naming anything else (``os.system``, ``builtins.eval``...) is refused before
  it is called."""

  def find_class(self, module, name):
    module = {"copy_reg": "copyreg", "__builtin__": "builtins"}.get(module, module)
    if (module, name) not in _ALLOWED:
      raise pickle.UnpicklingError(f"global {module}.{name} is not allowed in a Planetoid file")
    return super().find_class(module, name)


def _unpickle(path: Path):
  """Reads one ``ind.<name>.*`` pickle with :class:`_PlanetoidUnpickler` (never the plain
  ``pickle.load``): a crafted file is an ``InputError``, and its payload does not run."""
  import warnings
  try:
    with open(path, "rb") as fh, warnings.catch_warnings():
      warnings.simplefilter("ignore", DeprecationWarning)  # old pickles name scipy.sparse.csr
      return _PlanetoidUnpickler(fh, encoding="latin1").load()
  except (pickle.UnpicklingError, EOFError, ValueError, ModuleNotFoundError, AttributeError) as e:
    raise InputError(f"cannot read Planetoid file {path}: {type(e).__name__}: {e}") from e


def read_planetoid(raw_dir: str | os.PathLike, name: str = "cora", *, num_val: int = 500) -> RawPlanetoid:
  """Reads ``ind.<name>.*`` from ``raw_dir`` with the standard processing (module docstring)."""
  import scipy.sparse as sp
  name = name.lower()
  raw = Path(raw_dir)
  if not raw.is_dir():
    raise InputError(f"{raw_dir=} is not a directory (expected the original ind.{name}.* files)")
  missing = [f"ind.{name}.{k}" for k in (*_KEYS, "test.index") if not (raw / f"ind.{name}.{k}").exists()]
  if missing:
    raise InputError(f"missing Planetoid files in {raw}: {', '.join(missing)}")
  parts = {k: _unpickle(raw / f"ind.{name}.{k}") for k in _KEYS}
  test_index = np.loadtxt(raw / f"ind.{name}.test.index", dtype=np.int64, ndmin=1)
  tx, ty = sp.csr_matrix(parts["tx"]), np.asarray(parts["ty"])
  allx, ally = sp.csr_matrix(parts["allx"]), np.asarray(parts["ally"])
  if tx.shape[0] != test_index.size or ty.shape[0] != test_index.size:
    raise InputError(f"{name}: tx has {tx.shape[0]} rows and ty {ty.shape[0]}, but test.index lists "
                     f"{test_index.size} nodes")
  test_sorted = np.sort(test_index)
  lo, hi = int(test_sorted[0]), int(test_sorted[-1])
  if lo != allx.shape[0]:
    raise InputError(f"{name}: test nodes must follow the {allx.shape[0]} allx rows, but the smallest "
                     f"test index is {lo}")
  # Fill [lo, hi]: test rows land at their (sorted) index, gaps (CiteSeer) stay zero rows.
  span = hi - lo + 1
  order = np.argsort(test_index, kind="stable")  # test row order[i] belongs to node test_sorted[i]
  place = sp.csr_matrix((np.ones(test_index.size), (test_sorted - lo, order)), shape=(span, test_index.size))
  tx_full = (place @ tx).tocsr()
  ty_full = np.zeros((span, ty.shape[1]), ty.dtype)
  ty_full[test_sorted - lo] = ty[order]
  feats = sp.vstack([allx, tx_full]).tocsr().astype(np.float32)
  feats.sort_indices()
  onehot = np.vstack([ally, ty_full])
  labels = onehot.argmax(1).astype(np.int64)  # a zero row (gap node) gives 0, as the reference loaders
  n = feats.shape[0]
  src, dst = [], []
  for u, nbrs in parts["graph"].items():
    for v in nbrs:
      src.append(u)
      dst.append(v)
  src, dst = np.asarray(src, np.int64), np.asarray(dst, np.int64)
  bad = (src < 0) | (src >= n) | (dst < 0) | (dst >= n)
  if bad.any():
    raise InputError(f"{name}: {int(bad.sum())} edges name nodes outside [0, {n}) (first: "
                     f"{int(src[bad][0])} -> {int(dst[bad][0])})")
  keep = src != dst
  a, b = np.minimum(src, dst)[keep], np.maximum(src, dst)[keep]
  pairs = np.unique(a * n + b)
  edges = np.stack([pairs // n, pairs % n])
  num_train = int(np.asarray(parts["y"]).shape[0])
  if num_train + num_val > lo:
    raise ConfigError(f"{num_val=}: train ({num_train}) + val rows exceed the {lo} non-test nodes")
  return RawPlanetoid(feats, labels, edges, np.arange(num_train), np.arange(num_train, num_train + num_val),
                      test_sorted)


def _dataset(name, x, labels, edges, splits, row_normalize) -> NodeDataset:
  if row_normalize:
    x = x / np.maximum(x.sum(1, keepdims=True), 1e-12)
  n = x.shape[0]
  masks = {}
  for k, ids in splits.items():
    m = np.zeros(n, bool)
    m[ids] = True
    masks[f"{k}_mask"] = m
  return make_node_dataset(x, edges[0], edges[1], labels, num_classes=int(labels.max()) + 1,
                           name=name, **masks)


def load_planetoid(name: str = "cora", *, path: str | os.PathLike | None = None,
                   row_normalize: bool = False, num_val: int = 500) -> NodeDataset:
  """Loads a Planetoid dataset with the standard split (140 / 500 / 1000 for Cora).

  Without ``path``: the bundled copy (``AVAILABLE``). With ``path``: the original
  ``ind.<name>.*`` files in that folder, for any of ``STANDARD``. Features are as in the files
  (binary bag-of-words; TF-IDF for pubmed) unless ``row_normalize`` (rows scaled to sum 1, as
  GCN does). Edges: both directions, no duplicates, no self loops. ``num_val``: the size of the
  validation split read from files (500 in the standard split).
  """
  name = name.lower()
  if path is not None:
    if name not in STANDARD:
      raise ConfigError(f"{name=} is not a Planetoid dataset; expected one of {STANDARD}")
    r = read_planetoid(path, name, num_val=num_val)
    splits = {"train": r.train_idx, "val": r.val_idx, "test": r.test_idx}
    return _dataset(name, r.features.toarray(), r.labels, r.edges, splits, row_normalize)
  if name not in AVAILABLE:
    raise ConfigError(f"{name=} is not bundled (bundled: {AVAILABLE}); pass path= to a folder with the "
                      f"original ind.{name}.* files")
  p = asset_path(name)
  if not p.exists():
    raise InputError(f"bundled dataset file {p} is missing (reinstall jaxsys)")
  with np.load(p) as z:
    n, f = (int(v) for v in z["shape"])
    x = np.zeros((n, f), np.float32)
    indptr, indices = z["feat_indptr"], z["feat_indices"].astype(np.int64)
    rows = np.repeat(np.arange(n), np.diff(indptr))
    x[rows, indices] = 1.0
    labels = z["labels"].astype(np.int32)
    edges = z["edges"].astype(np.int32)
    splits = {k: z[f"{k}_idx"].astype(np.int64) for k in ("train", "val", "test")}
  return _dataset(name, x, labels, edges, splits, row_normalize)


def convert_planetoid(raw_dir: str | os.PathLike, name: str = "cora",
                      out_path: str | os.PathLike | None = None, *, num_val: int = 500) -> Path:
  """Converts the original ``ind.<name>.*`` files into the compact bundled ``.npz`` (binary features)."""
  r = read_planetoid(raw_dir, name, num_val=num_val)
  feats = r.features
  if feats.data.size and not np.all(feats.data == 1):
    raise InputError(f"{name}: the compact format stores binary features only; load it with "
                     f"load_planetoid({name!r}, path=...) instead")
  n = feats.shape[0]
  small = np.int16 if max(n, feats.shape[1]) < 2**15 else np.int32
  out = Path(out_path) if out_path is not None else asset_path(name)
  out.parent.mkdir(parents=True, exist_ok=True)
  np.savez_compressed(
      out, shape=np.asarray(feats.shape, np.int64),
      feat_indptr=feats.indptr.astype(np.int32), feat_indices=feats.indices.astype(small),
      labels=r.labels.astype(np.int8), edges=r.edges.astype(small),
      train_idx=r.train_idx.astype(small), val_idx=r.val_idx.astype(small), test_idx=r.test_idx.astype(small))
  return out
