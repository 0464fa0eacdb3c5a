"""Cluster-aware graph parallelism: halo plan, forward and gradients equal single-device."""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxsys import graphs as G
from jaxsys.core.errors import ConfigError
from jaxsys.core.mesh import make_mesh
from jaxsys.models.graph.graph_transformer import GraphTransformer, GraphTransformerConfig
from jaxsys.nn.graph import graph_inputs
from jaxsys.parallel.graph import graph_parallel_apply, halo_exchange, plan_graph_partition

sys.path.insert(0, os.path.dirname(__file__))
from _sp_helpers import build_mesh, mesh_context  # noqa: E402


@pytest.fixture(scope="module")
def ds():
  return G.sbm_graph(96, num_classes=3, num_communities=8, avg_degree=6, num_features=8, seed=0)


@pytest.fixture(scope="module")
def model():
  cfg = GraphTransformerConfig(8, 3, hidden=8, num_heads=2, num_layers=2, dropout=0.0,
                               input_dropout=0.0, attention="dual", dense_every_layers=2)
  m = GraphTransformer(cfg, rngs=nnx.Rngs(0))  # layer 1: sparse + halo, layer 2: dense (SP ring)
  m.eval()
  return m


def test_plan_halo_rows_point_at_the_right_nodes(ds):
  plan = plan_graph_partition(ds, 8)
  n_local, h = plan.n_local, plan.h_max
  pairs = set()
  for p in range(8):
    for s, r in zip(plan.senders[p], plan.receivers[p]):
      r_node = plan.node_of_slot[p * n_local + r]
      if r_node < 0:
        continue  # padding edge
      if s < n_local:
        s_node = plan.node_of_slot[p * n_local + s]
      else:  # halo row: block src, position j -> src's local row send_idx[src, p, j]
        src, j = divmod(int(s) - n_local, h)
        s_node = plan.node_of_slot[src * n_local + plan.send_idx[src, p, j]]
      pairs.add((int(s_node), int(r_node)))
  want = set(zip(ds.senders.tolist(), ds.receivers.tolist())) | {(i, i) for i in range(ds.num_nodes)}
  assert pairs == want
  assert 0 < plan.halo_fraction() < 0.5  # far fewer rows than an all-gather of K/V
  with pytest.raises(ConfigError, match="num_parts=97 must lie in"):
    plan_graph_partition(ds, 97)


@pytest.mark.parametrize("num_devices", [1, 8])
def test_forward_and_gradients_match_single_device(ds, model, num_devices, devices):
  x = jnp.asarray(ds.features)
  inputs = graph_inputs(ds.graph)
  labels, mask = jnp.asarray(ds.labels), jnp.asarray(ds.train_mask)
  plan = plan_graph_partition(ds, num_devices)
  mesh = make_mesh({"graph": num_devices}, devices[:num_devices])
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  slab_labels = jnp.asarray(plan.to_slots(ds.labels))
  slab_mask = jnp.asarray(plan.to_slots(ds.train_mask, False))

  @jax.jit
  def reference(params):
    def loss(params):
      logits = nnx.merge(graphdef, params, rest)(x, inputs)
      ce = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
      return jnp.sum(ce * mask) / jnp.sum(mask), logits
    return jax.value_and_grad(loss, has_aux=True)(params)

  @jax.jit
  def parallel(params):
    def loss(params):
      slab = graph_parallel_apply(nnx.merge(graphdef, params, rest), plan, mesh)
      ce = optax.softmax_cross_entropy_with_integer_labels(slab, slab_labels)
      return jnp.sum(ce * slab_mask) / jnp.sum(slab_mask), plan.to_original(slab)
    return jax.value_and_grad(loss, has_aux=True)(params)

  (l_ref, out_ref), g_ref = reference(params)
  (l_par, out_par), g_par = parallel(params)
  np.testing.assert_allclose(out_par, out_ref, atol=2e-5)
  np.testing.assert_allclose(l_par, l_ref, atol=2e-6)
  for a, b in zip(jax.tree.leaves(g_ref), jax.tree.leaves(g_par)):
    np.testing.assert_allclose(a, b, atol=2e-5)


@pytest.fixture(scope="module")
def reference(ds, model):
  """Single-device logits and gradients of the summed logits."""
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  x, inputs = jnp.asarray(ds.features), graph_inputs(ds.graph)
  f = lambda p: nnx.merge(graphdef, p, rest)(x, inputs)  # noqa: E731
  return jax.jit(lambda p: (f(p), jax.grad(lambda p: f(p).sum())(p)))(params)


def test_forward_and_gradients_on_every_mesh_kind(ds, model, reference, mesh_kind):
  """Halo all-to-all + dense ring on 2 devices of each mesh kind, without a mesh context and
  inside one (Explicit axes) or as the Auto kind's case; gradients inside an Explicit context
  (Auto axes: the test above). There the slab -> node gather names its output sharding."""
  plan = plan_graph_partition(ds, 2)
  mesh = build_mesh(mesh_kind, {"graph": 2})
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  f = lambda p: plan.to_original(graph_parallel_apply(nnx.merge(graphdef, p, rest), plan, mesh))  # noqa: E731
  with mesh_context(mesh, mesh_kind == "auto"):
    np.testing.assert_allclose(jax.jit(f)(params), reference[0], atol=2e-5)
  if mesh_kind == "explicit":
    with mesh_context(mesh, True):
      out, grads = jax.jit(lambda p: (f(p), jax.grad(lambda p: f(p).sum())(p)))(params)
    np.testing.assert_allclose(out, reference[0], atol=2e-5)
    for a, b in zip(jax.tree.leaves(reference[1]), jax.tree.leaves(grads)):
      np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


def test_halo_exchange_delivers_only_requested_rows(devices):
  mesh = make_mesh({"graph": 4}, devices[:4])
  x = jnp.arange(4 * 3, dtype=jnp.float32).reshape(4 * 3, 1)  # device p owns rows 3p..3p+2
  send = np.zeros((4, 4, 1), np.int32)
  send[:, :, 0] = np.arange(4)[None, :] % 3  # device p sends its local row (d % 3) to device d
  fn = jax.shard_map(lambda x, s: halo_exchange(x, s[0], "graph"), mesh=mesh,
                     in_specs=(jax.P("graph"), jax.P("graph")), out_specs=jax.P("graph"))
  out = np.asarray(fn(x, jnp.asarray(send))).reshape(4, 3 + 4)
  for d in range(4):
    np.testing.assert_array_equal(out[d, 3:], [3 * p + d % 3 for p in range(4)])


def test_train_step_under_shard_map_reduces_loss(ds, devices):
  from jaxsys.parallel.graph import make_graph_parallel_step
  cfg = GraphTransformerConfig(8, 3, hidden=8, num_heads=2, num_layers=1, dropout=0.0,
                               input_dropout=0.0, attention="sparse")
  model = GraphTransformer(cfg, rngs=nnx.Rngs(1))
  plan = plan_graph_partition(ds, 2)
  mesh = make_mesh({"graph": 2}, devices[:2])
  tx = optax.adam(3e-2)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  opt_state = tx.init(params)
  batch = (jnp.asarray(plan.to_slots(ds.labels)), jnp.asarray(plan.to_slots(ds.train_mask, False)))
  step = make_graph_parallel_step(plan, mesh, tx)
  losses = []
  for _ in range(6):
    params, opt_state, loss = step(graphdef, params, rest, opt_state, batch, False)
    losses.append(float(loss))
  assert losses[-1] < 0.8 * losses[0]
