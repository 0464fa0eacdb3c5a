"""Graph transformer: padding / reordering invariance, topology paths agree, schedule, training."""

import jax
import jax.numpy as jnp
import jraph
import numpy as np
import pytest
from flax import nnx

from jaxsys import graphs as G
from jaxsys.core.errors import ConfigError, InputError
from jaxsys.models.graph_transformer import (GCN, GraphTransformer, GraphTransformerConfig,
                                             add_virtual_node, train_node_classifier)
from jaxsys.nn.graph import graph_inputs


@pytest.fixture(scope="module")
def ds():
  return G.sbm_graph(72, num_classes=3, num_communities=6, avg_degree=6, num_features=8, seed=0)


def _model(attention="dual", **kw):
  cfg = GraphTransformerConfig(8, 3, hidden=16, num_heads=2, num_layers=2, dropout=0.0,
                               input_dropout=0.0, attention=attention, **kw)
  m = GraphTransformer(cfg, rngs=nnx.Rngs(0))
  m.eval()
  return m


@pytest.mark.parametrize("dense_step", [False, True])
def test_padding_never_changes_results(ds, dense_step):
  model = _model(dense_every_layers=2)
  ref = model(jnp.asarray(ds.features), graph_inputs(ds.graph), dense_step=dense_step)
  padded = G.pad_graph(ds.graph, *G.graph_buckets(ds.num_nodes, ds.num_edges))
  out = model(jnp.asarray(padded.nodes), graph_inputs(padded, padded=True), dense_step=dense_step)
  np.testing.assert_allclose(out[:ds.num_nodes], ref, atol=1e-5)


def test_topology_paths_agree_and_reordering_restores(ds):
  model = _model("sparse")
  x = jnp.asarray(ds.features)
  ref = model(x, graph_inputs(ds.graph))
  ds_r, order = G.cluster_reorder(ds, 4)
  inp = graph_inputs(ds_r.graph, reform_config=G.ReformConfig(16, 0.05))
  assert inp.tiles.rows.shape[0] > 0 and inp.rest_senders.shape[0] > 0
  for topology in ("sparse", "reformed", "block"):
    if topology == "block":
      inp = graph_inputs(ds_r.graph, reform_config=G.ReformConfig(16, 0.0))
    m = _model("sparse", topology=topology)
    out = m(jnp.asarray(ds_r.features), inp)
    np.testing.assert_allclose(order.to_old(np.asarray(out)), ref, atol=1e-5, err_msg=topology)


def test_graph_regression_with_batched_padded_graphs():
  rng = np.random.default_rng(0)
  graphs = []
  for n in (5, 9, 7):
    s = rng.integers(0, n, 2 * n)
    r = rng.integers(0, n, 2 * n)
    s, r = G.canonical_edges(s, r, n)
    graphs.append(G.make_graph(rng.standard_normal((n, 8)), s, r))
  batch = jraph.batch_np(graphs)
  cfg = GraphTransformerConfig(8, 1, hidden=16, num_heads=2, task="graph", dropout=0.0,
                               input_dropout=0.0, attention="dual", dense_every_layers=2)
  model = GraphTransformer(cfg, rngs=nnx.Rngs(1))
  model.eval()
  out = model(jnp.asarray(batch.nodes), graph_inputs(batch))
  assert out.shape == (3, 1)
  single = model(jnp.asarray(graphs[1].nodes), graph_inputs(graphs[1]))
  np.testing.assert_allclose(out[1], single[0], atol=1e-5)  # dense attention stays within a graph
  padded = G.pad_graph(batch, 32, 64)
  out_p = model(jnp.asarray(padded.nodes), graph_inputs(padded, padded=True))
  np.testing.assert_allclose(out_p[:3], out, atol=1e-5)


def test_dual_schedule():
  cfg = GraphTransformerConfig(8, 3, num_layers=4, attention="dual", dense_every_layers=2,
                               dense_every_steps=3, topology="reformed")
  assert cfg.layer_modes(False) == ("reformed", "dense", "reformed", "dense")
  assert cfg.layer_modes(True) == ("dense",) * 4
  assert [cfg.is_dense_step(s) for s in range(4)] == [True, False, False, True]
  assert GraphTransformerConfig(8, 3, attention="sparse").layer_modes(True) == ("sparse",) * 2
  with pytest.raises(ConfigError, match="num_heads"):
    GraphTransformerConfig(8, 3, hidden=30, num_heads=4)
  with pytest.raises(ConfigError, match="attention="):
    GraphTransformerConfig(8, 3, attention="fast")


def test_training_learns_and_virtual_node(ds):
  dsv = add_virtual_node(ds)
  assert dsv.num_nodes == ds.num_nodes + 1 and dsv.num_edges == ds.num_edges + 2 * ds.num_nodes
  cfg = GraphTransformerConfig(8, 3, hidden=16, num_heads=2, num_layers=1, dropout=0.1,
                               input_dropout=0.1, attention="dual", dense_every_steps=2)
  model = GraphTransformer(cfg, rngs=nnx.Rngs(0))
  res = train_node_classifier(model, jnp.asarray(dsv.features), graph_inputs(dsv.graph), dsv,
                              steps=30, lr=1e-2, dense_schedule=cfg.is_dense_step, eval_every=10)
  assert res["losses"][-1] < 0.5 * res["losses"][0]
  gcn = GCN(8, 16, 3, rngs=nnx.Rngs(0))
  res = train_node_classifier(gcn, jnp.asarray(ds.features), graph_inputs(ds.graph), ds,
                              steps=30, lr=1e-2, eval_every=10)
  assert res["losses"][-1] < 0.6 * res["losses"][0]


def test_graph_inputs_rejects_existing_self_loops():
  g = G.make_graph(np.zeros((3, 2)), [0, 1], [0, 2])
  with pytest.raises(InputError, match="self loops"):
    graph_inputs(g)
