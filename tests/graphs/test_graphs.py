"""Datasets, padding, partitioning, reordering and ECR (host-side graph tooling)."""

import numpy as np
import pytest

from jaxsys import graphs as G
from jaxsys.core.errors import ConfigError, InputError, ShapeError


@pytest.fixture(scope="module")
def cora():
  return G.load_planetoid("cora")


def test_cora_matches_planetoid_statistics(cora):
  assert (cora.num_nodes, cora.num_features, cora.num_classes) == (2708, 1433, 7)
  assert cora.num_edges == 10556  # 5278 undirected edges, both directions
  assert (cora.train_mask.sum(), cora.val_mask.sum(), cora.test_mask.sum()) == (140, 500, 1000)
  assert not (cora.train_mask & cora.test_mask).any()
  assert cora.senders.dtype == np.int32 and cora.graph.nodes.dtype == np.float32
  assert not np.any(cora.senders == cora.receivers)  # no self loops
  pairs = set(zip(cora.senders.tolist(), cora.receivers.tolist()))
  assert len(pairs) == cora.num_edges and all((r, s) in pairs for s, r in pairs)
  assert np.all(np.diff(cora.receivers) >= 0)  # sorted by receiver
  assert cora.labels[:10].tolist() == [3, 4, 4, 0, 3, 2, 0, 3, 3, 2]
  assert np.bincount(cora.labels[cora.train_mask]).tolist() == [20] * 7


def test_bundled_asset_matches_raw_files(tmp_path):
  raw = "/work/shared/data/planetoid"
  import os
  if not os.path.exists(f"{raw}/ind.cora.x"):
    pytest.skip("raw Planetoid files not available")
  out = G.convert_planetoid(raw, "cora", tmp_path / "cora.npz")
  a, b = np.load(out), np.load(G.planetoid.asset_path("cora"))
  for k in a.files:
    np.testing.assert_array_equal(a[k], b[k])


@pytest.mark.parametrize("gen", [G.sbm_graph, G.powerlaw_graph])
def test_synthetic_generators(gen):
  ds = gen(2000, num_classes=4, avg_degree=8, seed=3)
  assert ds.num_nodes == 2000 and ds.num_classes == 4
  assert 0.7 * 8 * 2000 < ds.num_edges <= 8 * 2000
  assert not np.any(ds.senders == ds.receivers)
  same = ds.labels[ds.senders] == ds.labels[ds.receivers]
  assert same.mean() > 0.6  # homophilous: neighbourhoods carry the label
  ds2 = gen(2000, num_classes=4, avg_degree=8, seed=3)
  np.testing.assert_array_equal(ds.senders, ds2.senders)


def test_powerlaw_has_heavy_tail():
  ds = G.powerlaw_graph(5000, avg_degree=10, seed=0)
  deg = G.degrees(ds.receivers, ds.num_nodes)
  assert deg.max() > 5 * deg.mean()
  sbm = G.sbm_graph(5000, avg_degree=10, seed=0)
  assert G.degrees(sbm.receivers, sbm.num_nodes).max() < 3 * deg.mean()


def test_pad_graph_buckets_and_masks(cora):
  nb, eb = G.graph_buckets(cora.num_nodes, cora.num_edges)
  assert (nb, eb) == (4096, 16384)
  g = G.pad_graph(cora.graph, nb, eb)
  assert g.nodes.shape == (nb, 1433) and g.senders.shape == (eb,)
  assert G.node_mask(g).sum() == cora.num_nodes and G.edge_mask(g).sum() == cora.num_edges
  pad_edges = ~G.edge_mask(g)
  assert np.all(g.receivers[pad_edges] >= cora.num_nodes)  # padding never reaches real nodes
  with pytest.raises(ShapeError, match="node_bucket"):
    G.pad_graph(cora.graph, cora.num_nodes, eb)
  with pytest.raises(ShapeError, match="edge_bucket"):
    G.pad_graph(cora.graph, nb, 16)
  assert G.next_bucket(9) == 16 and G.next_bucket(3) == 8


def test_metis_partition_and_reorder_is_permutation():
  ds = G.sbm_graph(1024, num_classes=4, num_communities=8, avg_degree=8, seed=1)
  parts = G.metis_partition(ds.senders, ds.receivers, ds.num_nodes, 8)
  assert parts.dtype == np.int32 and set(parts.tolist()) == set(range(8))
  cut = np.mean(parts[ds.senders] != parts[ds.receivers])
  assert cut < 0.5  # far better than the 7/8 of a random split
  ds_r, order = G.cluster_reorder(ds, 8)
  assert sorted(order.perm.tolist()) == list(range(1024))
  np.testing.assert_array_equal(order.perm[order.inverse], np.arange(1024))
  np.testing.assert_array_equal(order.to_old(ds_r.features), ds.features)
  np.testing.assert_array_equal(order.to_old(ds_r.labels), ds.labels)
  old_pairs = set(zip(ds.senders.tolist(), ds.receivers.tolist()))
  new_pairs = {(int(order.perm[s]), int(order.perm[r])) for s, r in zip(ds_r.senders, ds_r.receivers)}
  assert old_pairs == new_pairs
  before = G.block_layout(ds.senders, ds.receivers, ds.num_nodes, 64).dense_edge_fraction(0.05)
  after = G.block_layout(ds_r.senders, ds_r.receivers, ds_r.num_nodes, 64).dense_edge_fraction(0.05)
  assert after > before + 0.3


def test_reform_splits_every_edge_exactly_once():
  ds = G.sbm_graph(1000, num_classes=4, num_communities=16, avg_degree=8, seed=2)
  ds, _ = G.cluster_reorder(ds, 16)
  rg = G.reform(ds.senders, ds.receivers, ds.num_nodes, G.ReformConfig(block_size=32, threshold=0.04))
  assert 0 < rg.num_tiles and 0 < rg.dense_edge_fraction < 1
  t, i, j = np.nonzero(rg.block_bits)
  tile_edges = set(zip((rg.cols[t] * 32 + j).tolist(), (rg.rows[t] * 32 + i).tolist()))
  rest = set(zip(rg.senders.tolist(), rg.receivers.tolist()))
  assert not tile_edges & rest
  assert tile_edges | rest == set(zip(ds.senders.tolist(), ds.receivers.tolist()))
  approx = G.reform(ds.senders, ds.receivers, ds.num_nodes,
                    G.ReformConfig(block_size=32, threshold=0.04, mode="approximate", random_blocks=1))
  assert approx.num_tiles >= rg.num_tiles and approx.block_bits.sum() > rg.block_bits.sum()


def test_edge_ids_are_checked_before_the_int32_cast():
  """Float ids and ids out of range are rejected on the arrays as given (issue #14 item 9):
  cast to int32 first, 2**32 + 1 would become node 1."""
  x = np.zeros((8, 2), np.float32)
  with pytest.raises(ShapeError, match=r"senders must be an integer array.*senders\[1\]=1.5"):
    G.make_graph(x, [0.0, 1.5], [1, 2])
  with pytest.raises(InputError, match=r"senders must lie in \[0, num_nodes=8\), got senders\[1\]=4294967297"):
    G.make_graph(x, np.array([0, 2**32 + 1]), np.array([1, 1]))
  with pytest.raises(InputError, match=r"receivers must lie in \[0, num_nodes=8\), got receivers\[2\]=-1"):
    G.canonical_edges([0, 1, 2], [1, 2, -1], 8)
  with pytest.raises(ShapeError, match="receivers must be an integer array"):
    G.canonical_edges([0, 1], [1.0, 2.0], 8)
  # ids that do not fit int32 at all: the int32 result would wrap (2**32 + 1 -> 1)
  with pytest.raises(ShapeError, match=r"num_nodes=8589934592 exceeds the int32 id range"):
    G.canonical_edges([2**32 + 1], [0], 2**33)
  g = G.make_graph(x, np.array([0, 7], np.int64), np.array([7, 0], np.int64))
  assert g.senders.dtype == np.int32 and g.senders.tolist() == [0, 7]


def test_bad_inputs_raise_clear_errors():
  x = np.zeros((5, 3), np.float32)
  with pytest.raises(InputError, match="senders must lie in"):
    G.make_node_dataset(x, [0, 7], [1, 2], np.zeros(5, int), train_mask=np.ones(5, bool),
                        val_mask=np.ones(5, bool), test_mask=np.ones(5, bool))
  with pytest.raises(ShapeError, match="labels must have shape"):
    G.make_node_dataset(x, [0], [1], np.zeros(4, int), train_mask=np.ones(5, bool),
                        val_mask=np.ones(5, bool), test_mask=np.ones(5, bool))
  ds = G.make_node_dataset(x, [0], [1], np.zeros(5, int), train_mask=np.ones(5, bool),
                           val_mask=np.ones(5, bool), test_mask=np.ones(5, bool))
  with pytest.raises(ShapeError, match="train_mask"):
    ds.replace(train_mask=np.ones(4, bool))
  with pytest.raises(ShapeError, match="features"):
    G.make_graph(np.zeros(5), [0], [1])
  with pytest.raises(ConfigError, match="num_parts=6 must lie in"):
    G.metis_partition([0], [1], 5, 6)
  with pytest.raises(InputError, match="receivers must lie in"):
    G.metis_partition([0], [-1], 5, 2)
  with pytest.raises(ConfigError, match="mode"):
    G.ReformConfig(mode="fast")
  with pytest.raises(ConfigError, match="num_communities"):
    G.sbm_graph(100, num_classes=4, num_communities=2)


def test_threshold_tuner_picks_fastest_with_loss_progress():
  now = [0.0]  # a fake clock: each step advances it by the candidate's cost

  def make_step(thr):
    state = {"loss": 1.0}

    def step():
      now[0] += {0.1: 1.0, 0.5: 3.0, 0.9: 0.5}[thr]
      state["loss"] -= 0.01 if thr == 0.9 else 0.1  # 0.9 is fastest but barely trains
      return state["loss"]
    return step

  res = G.tune_threshold(make_step, [0.1, 0.5, 0.9], steps=3, clock=lambda: now[0])
  assert res.threshold == 0.1
  assert [r.step_ms for r in res.records] == [1000.0, 3000.0, 500.0]
  assert res.records[2].loss_progress < res.records[0].loss_progress
  loose = G.tune_threshold(make_step, [0.1, 0.9], steps=3, loss_tolerance=0.95, clock=lambda: now[0])
  assert loose.threshold == 0.9
  with pytest.raises(ConfigError, match="candidates"):
    G.tune_threshold(make_step, [])
