"""Quantized GNN layers/models: shapes, NNS on unseen graphs, training, packed inference path."""

import numpy as np
import pytest
from flax import nnx

from jaxsys import graphs
from jaxsys.core.errors import ConfigError, InputError, ShapeError
from jaxsys.models.graph.gnn import (GNN, GNNConfig, GNNTrainConfig, NodeData, compression_ratio,
                               feature_quantizers, train_gnn)
from jaxsys.nn.quantized import A2QConfig
from jaxsys.ops import quantized_aggregate
from jaxsys.quant import a2q
from jaxsys.quant.mega import degree_aware_bits, in_degree
from jaxsys.quant.packing import pack_features


@pytest.fixture(scope="module")
def ds():
  d = graphs.sbm_graph(64, num_classes=4, num_features=12, avg_degree=6, seed=0)
  return d.replace(graph=d.graph._replace(nodes=np.abs(d.features)))  # non-negative features


@pytest.mark.parametrize("kind", ["gcn", "gin", "gat"])
def test_forward_fp_and_quantized(ds, kind):
  data = NodeData.from_dataset(ds, kind)
  for quant in (None, A2QConfig()):
    cfg = GNNConfig(ds.num_features, ds.num_classes, kind=kind, hidden=8, heads=2, quant=quant)
    model = GNN(cfg, ds.num_nodes, rngs=nnx.Rngs(0))
    logits, info = nnx.jit(lambda m, x, e: m(x, e, train=True, seed=1))(model, data.x, data.edges)
    assert logits.shape == (ds.num_nodes, ds.num_classes)
    assert np.all(np.isfinite(logits))
    if quant is None:
      assert info == []
    else:
      assert len(info) == len(feature_quantizers(model)) >= 2
      assert compression_ratio(model, info)["ratio"] > 4


def test_nns_quantizes_unseen_graph_and_per_node_refuses(ds):
  other = graphs.sbm_graph(40, num_classes=4, num_features=12, avg_degree=6, seed=5)
  data2 = NodeData.from_dataset(other, "gcn")
  cfg = GNNConfig(12, 4, hidden=8, quant=A2QConfig(nns_pairs=4))
  model = GNN(cfg, ds.num_nodes, rngs=nnx.Rngs(0))
  logits, info = model(data2.x, data2.edges)
  assert logits.shape == (40, 4) and info[0][0].shape == (40, 1)
  per_node = GNN(GNNConfig(12, 4, hidden=8, quant=A2QConfig()), ds.num_nodes, rngs=nnx.Rngs(0))
  with pytest.raises(InputError, match="nns_pairs"):
    per_node(data2.x, data2.edges)


def test_training_learns_and_respects_budget(ds):
  data = NodeData.from_dataset(ds, "gcn")
  deg_bits = degree_aware_bits(in_degree(ds.receivers, ds.num_nodes), 3.0)
  cfg = GNNConfig(12, 4, hidden=16, dropout=0.0, quant=A2QConfig(target_bits=3.0, penalty=1.0))
  model = GNN(cfg, ds.num_nodes, rngs=nnx.Rngs(0), init_bits=[deg_bits, None])
  np.testing.assert_array_equal(np.asarray(feature_quantizers(model)[0].bits[...])[:, 0], deg_bits)
  res = train_gnn(model, data, GNNTrainConfig(epochs=30, lr=0.02), seed=0)
  losses = [h[0] for h in res["history"]]
  assert losses[-1] < losses[0]
  assert res["history"][-1][1] > 0.5  # train accuracy, 4 classes
  assert 1.0 <= res["avg_bits"] <= 8.0


def test_packed_inference_equals_fake_quant_layer(ds):
  data = NodeData.from_dataset(ds, "gcn")
  cfg = GNNConfig(12, 4, hidden=8, quant=A2QConfig(init_feature_bits=3))
  model = GNN(cfg, ds.num_nodes, rngs=nnx.Rngs(0))
  model.calibrate(data.x, data.edges)
  conv = model.layers[0]
  fq = conv.fq
  s, b = fq.params_for(data.x)
  pk = pack_features(data.x, np.asarray(a2q.round_bits(b))[:, 0], np.asarray(s)[:, 0],
                     signed=False)
  agg = quantized_aggregate(pk, (ds.senders, ds.receivers), aggregation="gcn")
  packed_out = agg @ conv.lin.quantized_kernel() + conv.lin.bias[...]
  fake_out, _ = conv(data.x, data.edges)
  np.testing.assert_allclose(packed_out, fake_out, rtol=1e-4, atol=1e-5)


def test_config_errors():
  with pytest.raises(ConfigError, match="kind"):
    GNNConfig(4, 2, kind="sage")
  with pytest.raises(ConfigError, match="init_feature_bits"):
    A2QConfig(init_feature_bits=9)
  with pytest.raises(ConfigError, match="target_bits"):
    A2QConfig(target_bits=0.5)
  with pytest.raises(ConfigError, match=r"\[1, 8\]"):
    GNN(GNNConfig(4, 2, quant=A2QConfig()), 3, rngs=nnx.Rngs(0),
        init_bits=[np.array([0, 2, 3]), None])


def test_training_takes_any_seed(ds):
  """Large seeds (an experiment's ``--seed`` shifts them by ~1e5 each) wrap into the 32-bit step key
  instead of overflowing it."""
  data = NodeData.from_dataset(ds, "gcn")
  model = GNN(GNNConfig(12, 4, hidden=8, dropout=0.5), ds.num_nodes, rngs=nnx.Rngs(0))
  res = train_gnn(model, data, GNNTrainConfig(epochs=2, lr=0.02), seed=100_003 * 10_000)
  assert len(res["history"]) == 2 and np.isfinite(res["history"][-1][0])


def test_sylvie_on_the_loop_equals_its_steps_run_from_python(devices):
  """``train_sylvie`` (the one loop) against SylvieTrainer's own jitted steps and host-side
  accuracies, on 2 devices with 1-bit exchange and staleness 1."""
  import jax
  from jaxsys.core.mesh import make_mesh
  from jaxsys.models.graph.gnn import train_sylvie
  from jaxsys.parallel.graph_comm import (SylvieConfig, SylvieTrainer, build_partition_plan,
                                          init_gcn_params)
  g = graphs.sbm_graph(48, num_classes=3, num_features=8, avg_degree=4, seed=2)
  plan = build_partition_plan(g.senders, g.receivers, g.num_nodes, np.arange(g.num_nodes) % 2, 2)
  dims = (g.num_features, 4, g.num_classes)
  params = init_gcn_params(jax.random.key(0), dims)
  tr = SylvieTrainer(plan, dims, SylvieConfig(quantize=True, staleness=1, lr=0.05),
                     make_mesh({"graph": 2}, devices[:2]))
  state, curve = tr.init(params, g.features, g.labels, g.train_mask), []
  for epoch in range(4):
    state, loss = tr.step(state, epoch + 7)
    if epoch % 2 == 1:
      pred = tr.logits(state["params"]).argmax(-1)
      curve.append((epoch + 1, float(loss), *(float(np.mean(pred[m] == g.labels[m]))
                                              for m in (g.val_mask, g.test_mask))))
  res = train_sylvie(tr, params, g, epochs=4, eval_every=2, seeds=[e + 7 for e in range(4)])
  assert res["curve"] == curve
  best = max(range(len(curve)), key=lambda i: (curve[i][2], -i))
  assert (res["val_acc"], res["test_acc"], res["best_step"]) == (curve[best][2], curve[best][3], 2 * best + 1)
  for a, b in zip(jax.tree.leaves(res["state"]["params"]), jax.tree.leaves(state["params"])):
    np.testing.assert_array_equal(a, b)
  with pytest.raises(ShapeError, match="seeds"):
    train_sylvie(tr, params, g, epochs=4, seeds=[0, 1])
