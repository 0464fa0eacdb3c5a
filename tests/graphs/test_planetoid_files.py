"""load_planetoid(name, path=...) on small generated files in the original Planetoid pickle format."""

import collections
import pickle

import numpy as np
import pytest
import scipy.sparse as sp

from jaxsys import graphs as G
from jaxsys.core.errors import ConfigError, InputError


def _onehot(labels, c):
  return np.eye(c, dtype=np.int64)[labels]


def write_planetoid(root, name, *, feats, labels, num_train, test_index, edges, classes=3):
  """Writes ind.<name>.* as the original release does: allx/ally are the nodes before the test
  range, tx/ty the test rows in ``test.index`` order (which need not be sorted or contiguous)."""
  n_all = min(test_index)
  rows = {"x": feats[:num_train], "allx": feats[:n_all], "tx": feats[test_index]}
  for k, m in rows.items():
    with open(root / f"ind.{name}.{k}", "wb") as fh:
      pickle.dump(sp.csr_matrix(m), fh)
  for k, lab in {"y": labels[:num_train], "ally": labels[:n_all], "ty": labels[test_index]}.items():
    with open(root / f"ind.{name}.{k}", "wb") as fh:
      pickle.dump(_onehot(lab, classes), fh)
  graph = collections.defaultdict(list)
  for u, v in edges:
    graph[u].append(v)
  with open(root / f"ind.{name}.graph", "wb") as fh:
    pickle.dump(graph, fh)
  np.savetxt(root / f"ind.{name}.test.index", np.asarray(test_index), fmt="%d")


def _citeseer_like(tmp_path, *, tfidf=False):
  rng = np.random.default_rng(0)
  n, f = 12, 5
  feats = (rng.random((n, f)) < 0.5).astype(np.float32)
  if tfidf:
    feats = feats * rng.random((n, f)).astype(np.float32)
  feats[:, 0] = 1.0  # no all-zero real row, so the gap rows are the only zero rows
  labels = rng.integers(0, 3, n)
  labels[:3] = [0, 1, 2]
  # nodes 0..7 before the test range; test rows for 8, 9, 11 listed out of order; 10 is a gap
  test_index = [11, 8, 9]
  edges = [(0, 1), (1, 0), (1, 2), (2, 2), (3, 8), (8, 3), (9, 11), (10, 4), (5, 6), (5, 6)]
  write_planetoid(tmp_path, "citeseer", feats=feats, labels=labels, num_train=3,
                  test_index=test_index, edges=edges)
  return feats, labels


def test_citeseer_gaps_are_zero_rows_in_no_split(tmp_path):
  feats, labels = _citeseer_like(tmp_path)
  import jaxsys.graphs.planetoid as P
  r = P.read_planetoid(tmp_path, "citeseer", num_val=2)
  assert r.features.shape == (12, 5)
  dense = r.features.toarray()
  for node in (0, 7, 8, 9, 11):  # every real row lands at its own node id
    np.testing.assert_array_equal(dense[node], feats[node])
    assert r.labels[node] == labels[node]
  assert not dense[10].any() and r.labels[10] == 0
  assert r.test_idx.tolist() == [8, 9, 11] and r.train_idx.tolist() == [0, 1, 2]
  assert r.val_idx.tolist() == [3, 4]
  # no self loop, no duplicate, gap node 10 keeps its edge
  assert sorted(map(tuple, r.edges.T.tolist())) == [(0, 1), (1, 2), (3, 8), (4, 10), (5, 6), (9, 11)]


def test_load_from_path_builds_the_dataset(tmp_path):
  _citeseer_like(tmp_path)
  with pytest.raises(ConfigError, match="num_val"):
    G.load_planetoid("citeseer", path=tmp_path)  # 3 train + 500 val do not fit in 8 nodes
  ds = G.load_planetoid("citeseer", path=tmp_path, num_val=2, row_normalize=True)
  assert (ds.num_nodes, ds.num_features, ds.num_classes) == (12, 5, 3)
  assert (ds.train_mask.sum(), ds.val_mask.sum(), ds.test_mask.sum()) == (3, 2, 3)
  assert not (ds.train_mask | ds.val_mask | ds.test_mask)[10]  # the gap node is in no split
  assert ds.num_edges == 12  # 6 undirected edges, both directions
  np.testing.assert_allclose(np.asarray(ds.graph.nodes)[:10].sum(1), 1.0, rtol=1e-6)


def test_tfidf_features_load_but_do_not_convert(tmp_path):
  feats, _ = _citeseer_like(tmp_path, tfidf=True)
  import jaxsys.graphs.planetoid as P
  r = P.read_planetoid(tmp_path, "citeseer", num_val=2)
  np.testing.assert_allclose(r.features.toarray()[9], feats[9])
  with pytest.raises(InputError, match="binary"):
    G.convert_planetoid(tmp_path, "citeseer", tmp_path / "c.npz", num_val=2)


def test_bad_files_get_clear_errors(tmp_path):
  with pytest.raises(InputError, match="not a directory"):
    G.load_planetoid("cora", path=tmp_path / "nope")
  with pytest.raises(InputError, match=r"ind\.pubmed\.x"):
    G.load_planetoid("pubmed", path=tmp_path)
  with pytest.raises(ConfigError, match="not a Planetoid dataset"):
    G.load_planetoid("reddit", path=tmp_path)
  with pytest.raises(ConfigError, match="pass path="):
    G.load_planetoid("citeseer")
  _citeseer_like(tmp_path)
  with open(tmp_path / "ind.citeseer.graph", "wb") as fh:
    pickle.dump({0: [40]}, fh)
  with pytest.raises(InputError, match=r"outside \[0, 12\)"):
    G.load_planetoid("citeseer", path=tmp_path)
  (tmp_path / "ind.citeseer.tx").write_bytes(b"\x80\x04truncated")
  with pytest.raises(InputError, match="cannot read"):
    G.load_planetoid("citeseer", path=tmp_path)


class _Payload:
  """Unpickling this calls ``os.system`` (what a crafted ``ind.<name>.x`` can do to plain pickle)."""

  def __init__(self, marker):
    self.marker = marker

  def __reduce__(self):
    import os
    return (os.system, (f"touch {self.marker}",))


def test_a_crafted_pickle_is_refused_and_never_runs(tmp_path):
  _citeseer_like(tmp_path)
  marker = tmp_path / "ran"
  with open(tmp_path / "ind.citeseer.x", "wb") as fh:
    pickle.dump(_Payload(marker), fh)
  with pytest.raises(InputError, match="posix.system is not allowed|os.system is not allowed"):
    G.load_planetoid("citeseer", path=tmp_path)
  assert not marker.exists()
  # the plain unpickler would have run it: the test's payload is real
  with open(tmp_path / "ind.citeseer.x", "rb") as fh:
    pickle.load(fh)
  assert marker.exists()
