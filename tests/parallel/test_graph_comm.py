"""Sylvie: exactness vs single device, 1-bit bytes measured from the all_to_all operands."""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxsys import graphs
from jaxsys.core.errors import ConfigError, InputError
from jaxsys.core.mesh import make_mesh
from jaxsys.parallel.graph_comm import (SylvieConfig, SylvieTrainer, build_partition_plan,
                                        init_gcn_params, reference_step)
from jaxsys.quant.comm import bytes_per_row

sys.path.insert(0, os.path.dirname(__file__))
from _sp_helpers import build_mesh, mesh_context  # noqa: E402


@pytest.fixture(scope="module")
def setup(devices):
  ds = graphs.sbm_graph(160, num_classes=4, num_features=40, avg_degree=6, seed=1)
  parts = graphs.metis_partition(ds.senders, ds.receivers, ds.num_nodes, 8)
  plan = build_partition_plan(ds.senders, ds.receivers, ds.num_nodes, parts, 8)
  dims = (ds.num_features, 8, ds.num_classes)
  params = init_gcn_params(jax.random.key(0), dims)
  return ds, plan, dims, params


def test_unquantized_synchronous_equals_single_device(setup):
  ds, plan, dims, params = setup
  cfg = SylvieConfig(quantize=False, staleness=0, dropout=0.5)
  trainer = SylvieTrainer(plan, dims, cfg, make_mesh({"graph": 8}))
  state = trainer.init(params, ds.features, ds.labels, ds.train_mask)
  tx = optax.adamw(cfg.lr, weight_decay=cfg.weight_decay)
  p, o = params, tx.init(params)
  args = [jnp.asarray(a) for a in (ds.features, ds.senders, ds.receivers, ds.labels, ds.train_mask)]
  ref = jax.jit(lambda p, o, s: reference_step(p, o, *args, s, tx, cfg.dropout))
  for epoch in range(4):
    state, loss = trainer.step(state, epoch)
    p, o, ref_loss = ref(p, o, jnp.uint32(epoch))
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
  for a, b in zip(jax.tree.leaves(state["params"]), jax.tree.leaves(p)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
  assert not np.allclose(jax.tree.leaves(p)[0], jax.tree.leaves(params)[0])  # it trained


@pytest.fixture(scope="module")
def small():
  """A 2-part graph, its plan, GCN params and the single-device loss of one exact step."""
  ds = graphs.sbm_graph(48, num_classes=3, num_features=8, avg_degree=4, seed=2)
  plan = build_partition_plan(ds.senders, ds.receivers, ds.num_nodes,
                              np.arange(ds.num_nodes) % 2, 2)
  dims = (ds.num_features, 4, ds.num_classes)
  params = init_gcn_params(jax.random.key(0), dims)
  cfg = SylvieConfig(quantize=False, staleness=0, dropout=0.5)
  tx = optax.adamw(cfg.lr, weight_decay=cfg.weight_decay)
  args = [jnp.asarray(a) for a in (ds.features, ds.senders, ds.receivers, ds.labels, ds.train_mask)]
  ref = jax.jit(lambda p, o: reference_step(p, o, *args, jnp.uint32(0), tx, cfg.dropout))
  return ds, plan, dims, params, cfg, ref(params, tx.init(params))[2]


def test_step_on_every_mesh_kind(small, mesh_kind):
  """One exact step (float exchange) == single device on 2 devices of each mesh kind: Explicit
  and Auto axes inside a mesh context (Explicit: resharded inputs), jaxsys meshes without."""
  ds, plan, dims, params, cfg, ref_loss = small
  mesh = build_mesh(mesh_kind, {"graph": 2})
  with mesh_context(mesh, mesh_kind != "jaxsys"):
    trainer = SylvieTrainer(plan, dims, cfg, mesh)
    state = trainer.init(params, ds.features, ds.labels, ds.train_mask)
    _, loss = trainer.step(state, 0)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)


def test_one_bit_bytes_measured_from_sent_arrays(setup):
  ds, plan, dims, params = setup
  mesh = make_mesh({"graph": 8})
  measured = {}
  for quantize in (False, True):
    trainer = SylvieTrainer(plan, dims, SylvieConfig(quantize=quantize), mesh)
    state = trainer.init(params, ds.features, ds.labels, ds.train_mask)
    measured[quantize] = trainer.measured_wire_bytes(state)
    claimed = plan.wire_bytes(dims[:-1], quantize)["total"]
    assert measured[quantize] == claimed
  rows = 8 * 7 * plan.halo_size
  assert measured[True] == rows * (bytes_per_row(40) + 2 * bytes_per_row(8))  # fwd 2 + bwd 1
  assert measured[False] == rows * 4 * (40 + 2 * 8)
  assert measured[False] / measured[True] > 4


def test_quantized_and_stale_training_runs(setup):
  ds, plan, dims, params = setup
  mesh = make_mesh({"graph": 8})
  trainer = SylvieTrainer(plan, dims, SylvieConfig(quantize=True, staleness=1, lr=0.05), mesh)
  state = trainer.init(params, ds.features, ds.labels, ds.train_mask)
  assert trainer.measured_wire_bytes(state) == plan.wire_bytes(dims[:-1], True)["total"]
  losses = []
  for epoch in range(12):
    state, loss = trainer.step(state, epoch)
    losses.append(float(loss))
  assert np.all(np.isfinite(losses)) and losses[-1] < losses[0]
  assert trainer.logits(state["params"]).shape == (ds.num_nodes, ds.num_classes)
  assert float(jnp.abs(state["halo"][1]).sum()) > 0  # stale halos were filled


def test_single_device_mesh(setup, devices):
  ds, _, dims, params = setup
  plan = build_partition_plan(ds.senders, ds.receivers, ds.num_nodes,
                              np.zeros(ds.num_nodes, np.int32), 1)
  trainer = SylvieTrainer(plan, dims, SylvieConfig(quantize=True),
                          make_mesh({"graph": 1}, devices[:1]))
  state = trainer.init(params, ds.features, ds.labels, ds.train_mask)
  state, loss = trainer.step(state, 0)
  assert np.isfinite(float(loss)) and trainer.measured_wire_bytes(state) == 0


def test_bad_partitions(setup):
  ds, plan, dims, _ = setup
  n = ds.num_nodes
  with pytest.raises(InputError, match="missing from the partition"):
    build_partition_plan(ds.senders, ds.receivers, n, np.zeros(n - 3, np.int32), 8)
  bad = np.zeros(n, np.int32)
  bad[5] = -1
  with pytest.raises(InputError, match="missing from the partition"):
    build_partition_plan(ds.senders, ds.receivers, n, bad, 8)
  bad[5] = 8
  with pytest.raises(InputError, match="outside"):
    build_partition_plan(ds.senders, ds.receivers, n, bad, 8)
  with pytest.raises(ConfigError, match="num_parts"):
    SylvieTrainer(plan, dims, SylvieConfig(), make_mesh({"graph": 4}))
  with pytest.raises(ConfigError, match="staleness"):
    SylvieConfig(staleness=-1)


def test_node_arrays_go_from_host_to_their_shards_without_a_compile(setup):
  """``put_nodes`` places numpy straight into the shards; a whole-array copy on one device,
  resharded, would compile a slicing program for every new shape (the second half shows it)."""
  from jaxsys.core.bench import compile_count
  ds, plan, dims, _ = setup
  trainer = SylvieTrainer(plan, dims, SylvieConfig(), make_mesh({"graph": 8}))
  feats = np.asarray(ds.features, np.float64)[:, :7] + 0.5   # a shape no other test places
  before = compile_count()
  placed = trainer.put_nodes(feats)
  assert compile_count() == before
  assert placed.dtype == jnp.float32 and placed.sharding.spec[0] == "graph"
  slab = plan.shard_nodes(feats, 0)
  np.testing.assert_allclose(np.asarray(placed), slab.astype(np.float32))
  via_device = jax.device_put(jnp.asarray(slab[:, :, :5]), placed.sharding)  # the old way
  assert compile_count() > before
  np.testing.assert_allclose(np.asarray(via_device), slab[:, :, :5].astype(np.float32))
