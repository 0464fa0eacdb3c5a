"""Planetoid citation graphs (Cora) shipped inside the package as a compressed ``.npz``.

The data is the Planetoid split of Yang, Cohen & Salakhutdinov, "Revisiting Semi-Supervised
Learning with Graph Embeddings" (ICML 2016), MIT license (see ``jaxsys/assets/planetoid/``).
``convert_planetoid`` rebuilds the asset from the original ``ind.<name>.*`` pickle files with the
standard processing (test rows re-ordered by ``test.index``; train = first 20 per class as in the
files, i.e. indices [0, 140); val = [140, 640); test = the 1000 ``test.index`` nodes).

Usage::

  ds = jaxsys.graphs.load_planetoid("cora")   # NodeDataset, 2708 nodes, 10556 directed edges
"""

from __future__ import annotations

import os
import pickle
from importlib import resources
from pathlib import Path

import numpy as np

from jaxsys.core.errors import ConfigError, InputError
from jaxsys.graphs.dataset import NodeDataset, make_node_dataset

AVAILABLE = ("cora",)


def asset_path(name: str) -> Path:
  return Path(str(resources.files("jaxsys") / "assets" / "planetoid" / f"{name}.npz"))


def load_planetoid(name: str = "cora", *, row_normalize: bool = False) -> NodeDataset:
  """Loads a bundled Planetoid dataset with the standard split (140 / 500 / 1000 for Cora).

  Features are the raw binary bag-of-words unless ``row_normalize`` (rows scaled to sum 1, as
  GCN does). Edges: both directions, no duplicates, no self loops.
  """
  name = name.lower()
  if name not in AVAILABLE:
    raise ConfigError(f"{name=} is not bundled; available: {AVAILABLE}")
  path = asset_path(name)
  if not path.exists():
    raise InputError(f"bundled dataset file {path} is missing (reinstall jaxsys)")
  with np.load(path) as z:
    n, f = (int(v) for v in z["shape"])
    x = np.zeros((n, f), np.float32)
    indptr, indices = z["feat_indptr"], z["feat_indices"].astype(np.int64)
    rows = np.repeat(np.arange(n), np.diff(indptr))
    x[rows, indices] = 1.0
    labels = z["labels"].astype(np.int32)
    edges = z["edges"].astype(np.int32)
    idx = {k: z[f"{k}_idx"].astype(np.int64) for k in ("train", "val", "test")}
  if row_normalize:
    x = x / np.maximum(x.sum(1, keepdims=True), 1.0)
  masks = {}
  for k, ids in idx.items():
    m = np.zeros(n, bool)
    m[ids] = True
    masks[f"{k}_mask"] = m
  return make_node_dataset(x, edges[0], edges[1], labels, num_classes=int(labels.max()) + 1,
                           name=name, **masks)


def _unpickle(path: str):
  import warnings
  with open(path, "rb") as fh, warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)  # old pickles name scipy.sparse.csr
    return pickle.load(fh, encoding="latin1")


def convert_planetoid(raw_dir: str | os.PathLike, name: str = "cora",
                      out_path: str | os.PathLike | None = None) -> Path:
  """Converts the original ``ind.<name>.*`` files into the compact bundled ``.npz``."""
  raw = Path(raw_dir)
  parts = {}
  for key in ("x", "y", "tx", "ty", "allx", "ally", "graph"):
    p = raw / f"ind.{name}.{key}"
    if not p.exists():
      raise InputError(f"missing Planetoid file {p}")
    parts[key] = _unpickle(str(p))
  test_index = np.loadtxt(raw / f"ind.{name}.test.index", dtype=np.int64)
  import scipy.sparse as sp
  feats = sp.vstack([parts["allx"], parts["tx"]]).tolil()
  labels = np.vstack([parts["ally"], parts["ty"]])
  test_sorted = np.sort(test_index)
  feats[test_index, :] = feats[test_sorted, :]
  labels[test_index, :] = labels[test_sorted, :]
  feats = feats.tocsr()
  feats.sort_indices()
  if feats.data.size and not np.all(feats.data == 1):
    raise InputError("expected binary Planetoid features")
  n = feats.shape[0]
  adj = parts["graph"]
  src, dst = [], []
  for u, nbrs in adj.items():
    for v in nbrs:
      src.append(u)
      dst.append(v)
  src, dst = np.asarray(src), np.asarray(dst)
  keep = (src != dst) & (src < n) & (dst < n)
  lo, hi = np.minimum(src, dst)[keep], np.maximum(src, dst)[keep]
  pairs = np.unique(lo * n + hi)
  edges = np.stack([pairs // n, pairs % n]).astype(np.int16)
  num_train = parts["y"].shape[0]
  out = Path(out_path) if out_path is not None else asset_path(name)
  out.parent.mkdir(parents=True, exist_ok=True)
  np.savez_compressed(
      out, shape=np.asarray(feats.shape, np.int64),
      feat_indptr=feats.indptr.astype(np.int32), feat_indices=feats.indices.astype(np.int16),
      labels=labels.argmax(1).astype(np.int8), edges=edges,
      train_idx=np.arange(num_train, dtype=np.int16),
      val_idx=np.arange(num_train, num_train + 500, dtype=np.int16),
      test_idx=test_sorted.astype(np.int16))
  return out
