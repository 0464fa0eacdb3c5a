"""Graph transformer: padding / reordering invariance, topology paths agree, schedule, training."""

import jax
import jax.numpy as jnp
import jraph
import numpy as np
import pytest
from flax import nnx

from jaxsys import graphs as G
from jaxsys.core.errors import ConfigError, InputError
from jaxsys.models.graph.graph_transformer import (GCN, GraphTransformer, GraphTransformerConfig,
                                             _sparse_attention_dropout, add_virtual_node,
                                             laplacian_pe, train_graph_transformer)
from jaxsys.ops.graph_attn import graph_attention
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
  with pytest.raises(ConfigError, match="attn_dropout"):
    GraphTransformerConfig(8, 3, attn_dropout=1.0)
  with pytest.raises(ConfigError, match="lap_pe"):
    GraphTransformerConfig(8, 3, lap_pe=8)


def test_training_learns_and_virtual_node(ds):
  dsv = add_virtual_node(ds)
  assert dsv.num_nodes == ds.num_nodes + 1 and dsv.num_edges == ds.num_edges + 2 * ds.num_nodes
  cfg = GraphTransformerConfig(8, 3, hidden=16, num_heads=2, num_layers=1, dropout=0.1,
                               input_dropout=0.1, attention="dual", dense_every_steps=2)
  model = GraphTransformer(cfg, rngs=nnx.Rngs(0))
  res = train_graph_transformer(model, jnp.asarray(dsv.features), graph_inputs(dsv.graph), dsv,
                                steps=30, lr=1e-2, dense_schedule=cfg.is_dense_step, eval_every=10)
  assert res["losses"][-1] < 0.5 * res["losses"][0]
  gcn = GCN(8, 16, 3, rngs=nnx.Rngs(0))
  res = train_graph_transformer(gcn, jnp.asarray(ds.features), graph_inputs(ds.graph), ds,
                                steps=30, lr=1e-2, eval_every=10)
  assert res["losses"][-1] < 0.6 * res["losses"][0]


def test_graph_inputs_rejects_existing_self_loops():
  g = G.make_graph(np.zeros((3, 2)), [0, 1], [0, 2])
  with pytest.raises(InputError, match="self loops"):
    graph_inputs(g)


def test_attention_dropout_matches_op_and_is_off_in_eval(ds):
  inputs = graph_inputs(ds.graph)
  q, k, v = jax.random.normal(jax.random.PRNGKey(0), (3, ds.num_nodes, 2, 4))
  ref = graph_attention(q, k, v, mode="sparse", senders=inputs.senders, receivers=inputs.receivers)
  off = nnx.Dropout(0.5, deterministic=True, rngs=nnx.Rngs(0))
  np.testing.assert_allclose(_sparse_attention_dropout(q, k, v, inputs, off), ref, atol=1e-5)
  on = nnx.Dropout(0.5, rngs=nnx.Rngs(0))
  assert not np.allclose(_sparse_attention_dropout(q, k, v, inputs, on), ref, atol=1e-3)

  x = jnp.asarray(ds.features)
  plain = _model("sparse", ffn=False, attn_residual=False)
  dropped = _model("sparse", ffn=False, attn_residual=False, attn_dropout=0.5)
  nnx.update(dropped, nnx.state(plain, nnx.Param))
  np.testing.assert_allclose(dropped(x, inputs), plain(x, inputs), atol=1e-5)  # eval: no dropout
  dropped.train()
  a, b = dropped(x, inputs), dropped(x, inputs)
  assert not np.allclose(a, b, atol=1e-4) and not np.allclose(a, plain(x, inputs), atol=1e-4)


def test_dense_gate_starts_closed_and_learns(ds):
  x, inputs = jnp.asarray(ds.features), graph_inputs(ds.graph)
  model = _model("dual", ffn=False, dense_gate=True)
  out = model(x, inputs, dense_step=True)
  for layer in model.layers:
    layer.attn.out.kernel[...] = jnp.ones_like(layer.attn.out.kernel[...])
  np.testing.assert_allclose(model(x, inputs, dense_step=True), out, atol=1e-5)  # tanh(0) = 0
  grads = nnx.grad(lambda m: jnp.sum(m(x, inputs, dense_step=True) ** 2))(model)
  assert float(jnp.abs(grads["layers"][0]["gate"][...])) > 0
  assert not np.allclose(model(x, inputs, dense_step=False), out, atol=1e-3)


def _two_component_graph():
  a = G.sbm_graph(40, num_classes=2, num_communities=2, avg_degree=6, num_features=4, seed=1)
  s = np.concatenate([a.senders, a.senders + 40])
  r = np.concatenate([a.receivers, a.receivers + 40])
  return s, r, 81  # node 80 is isolated


def test_laplacian_pe_is_nontrivial_eigenbasis_up_to_sign():
  s, r, n = _two_component_graph()
  pe = laplacian_pe(s, r, n, 6, seed=0)
  assert pe.shape == (n, 6) and np.all(pe[80] == 0)
  adj = np.zeros((n, n))
  adj[r, s] = 1
  deg = adj.sum(1)
  inv = np.where(deg > 0, 1 / np.sqrt(np.maximum(deg, 1)), 0)
  lap = np.eye(n) - inv[:, None] * adj * inv[None]
  lam = np.sum(pe * (lap @ pe), 0)
  np.testing.assert_allclose(lap @ pe, pe * lam, atol=1e-4)  # eigenvectors
  assert np.all(lam > 1e-3)  # component indicators (eigenvalue 0) are skipped
  np.testing.assert_allclose(pe.T @ pe, np.eye(6), atol=1e-4)
  ref = np.sort(np.linalg.eigvalsh(lap[:80, :80]))
  np.testing.assert_allclose(np.sort(lam), ref[2:8], atol=1e-4)  # the smallest non-zero ones
  other = laplacian_pe(s, r, n, 6, seed=1)  # another start vector: same basis, signs may differ
  distinct = np.abs(np.diff(np.sort(lam))).min() > 1e-3
  if distinct:
    np.testing.assert_allclose(np.abs(np.sum(pe * other, 0)), 1.0, atol=1e-4)


def test_lap_pe_signs_random_in_training_only(ds):
  pe = laplacian_pe(ds.senders, ds.receivers, ds.num_nodes, 4)
  x = jnp.concatenate([jnp.asarray(ds.features), jnp.asarray(pe)], 1)
  cfg = GraphTransformerConfig(12, 3, hidden=16, num_heads=2, dropout=0.0, input_dropout=0.0,
                               lap_pe=4, attention="dense")
  model = GraphTransformer(cfg, rngs=nnx.Rngs(0))
  inputs = graph_inputs(ds.graph)
  model.eval()
  np.testing.assert_array_equal(model(x, inputs), model(x, inputs))
  model.train()
  outs = [np.asarray(model(x, inputs)) for _ in range(4)]
  assert any(not np.allclose(outs[0], o, atol=1e-5) for o in outs[1:])


def _gat(**kw):
  cfg = GraphTransformerConfig(8, 3, hidden=16, num_heads=4, dropout=0.0, input_dropout=0.0,
                               ffn=False, degree_encoding=False, embed=False, **kw)
  m = GraphTransformer(cfg, rngs=nnx.Rngs(0))
  m.eval()
  return m


def test_gat_stack_matches_reference_and_trains(ds):
  x, inputs = jnp.asarray(ds.features), graph_inputs(ds.graph)
  model = _gat(attention="sparse", out_heads=2)
  assert not hasattr(model, "embed") and not hasattr(model, "norm") and not hasattr(model, "head")
  assert model.layers[0].proj.kernel[...].shape == (8, 16)  # raw features -> 4 heads x 4

  def ref_layer(layer, h, heads, dim):
    z = layer.proj(h)
    qk = layer.qk(z).reshape(-1, 2, heads, dim)
    o = graph_attention(qk[:, 0], qk[:, 1], z.reshape(-1, heads, dim), mode="sparse",
                        senders=inputs.senders, receivers=inputs.receivers)
    return o

  h = jax.nn.elu(ref_layer(model.layers[0], x, 4, 4).reshape(ds.num_nodes, -1))
  ref = jnp.mean(ref_layer(model.layers[1], h, 2, 3), 1)  # 2 output heads of 3 classes, averaged
  out = model(x, inputs)
  assert out.shape == (ds.num_nodes, 3)
  np.testing.assert_allclose(out, ref, atol=1e-5)

  cfg = GraphTransformerConfig(8, 3, hidden=16, num_heads=4, dropout=0.3, input_dropout=0.3,
                               attn_dropout=0.3, ffn=False, degree_encoding=False, embed=False,
                               attention="sparse")
  res = train_graph_transformer(GraphTransformer(cfg, rngs=nnx.Rngs(0)), x, inputs, ds, steps=30,
                                lr=1e-2, eval_every=10)
  assert res["losses"][-1] < 0.6 * res["losses"][0]
  assert len(res["test_curve"]) == len(res["val_curve"]) == 3


def test_gat_dense_gate_starts_as_topology_step(ds):
  x, inputs = jnp.asarray(ds.features), graph_inputs(ds.graph)
  model = _gat(attention="dual", dense_gate=True)
  topo = model(x, inputs, dense_step=False)
  np.testing.assert_allclose(model(x, inputs, dense_step=True), topo, atol=1e-5)  # tanh(0) = 0
  grads = nnx.grad(lambda m: jnp.sum(m(x, inputs, dense_step=True) ** 2))(model)
  assert all(float(jnp.abs(g["gate"][...])) > 0 for g in grads["layers"].values())
  for layer in model.layers:
    layer.gate[...] = jnp.asarray(0.5)
  assert not np.allclose(model(x, inputs, dense_step=True), topo, atol=1e-3)
  np.testing.assert_allclose(model(x, inputs, dense_step=False), topo, atol=1e-5)
  ungated = _gat(attention="dual")  # no gate: a dense step is global attention alone
  assert not np.allclose(ungated(x, inputs, dense_step=True), ungated(x, inputs), atol=1e-3)


def test_gat_stack_config_errors():
  base = dict(ffn=False, degree_encoding=False, embed=False)
  for bad in (dict(lap_pe=2), dict(degree_encoding=True), dict(ffn=True), dict(task="graph"),
              dict(num_layers=1), dict(out_heads=0)):
    with pytest.raises(ConfigError, match="embed=False"):
      GraphTransformerConfig(8, 3, **{**base, **bad})
