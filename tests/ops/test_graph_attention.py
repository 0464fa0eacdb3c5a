"""Graph attention: sparse == block == reformed == dense-masked (forward and gradient)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsys import graphs as G
from jaxsys.core.errors import ConfigError, InputError, ShapeError
from jaxsys.ops import graph_attn as GA
from jaxsys.ops import masks


@pytest.fixture(scope="module")
def graph():
  ds = G.sbm_graph(200, num_classes=2, num_communities=4, avg_degree=6, seed=0)
  ds, _ = G.cluster_reorder(ds, 4)
  # one isolated node (no in-edges): its output must be zero and lse -inf
  keep = (ds.senders != 5) & (ds.receivers != 5)
  return ds.num_nodes, ds.senders[keep], ds.receivers[keep]


def _qkv(n, h=2, d=8, seed=0):
  return jax.random.normal(jax.random.PRNGKey(seed), (3, n, h, d))


def dense_masked(q, k, v, senders, receivers):
  """Dense attention masked by the adjacency, through jaxsys.ops.attention (reference)."""
  n = q.shape[0]
  adj = np.zeros((n, n), bool)
  adj[receivers, senders] = True
  layout = np.ones((1, 1, 1), bool)
  tok = GA.AdjacencyMask(np.zeros((1, 1), np.int32), adj[None])
  mask = masks.BlockSparse(layout, n, n, token_mask=tok)
  from jaxsys.ops.attn import attention
  out, lse = attention(q[None], k[None], v[None], mask=mask, impl="reference", return_lse=True)
  return out[0], jnp.swapaxes(lse[0], 0, 1)


def _paths(n, senders, receivers, block=16, threshold=0.05):
  exact_all = G.reform(senders, receivers, n, G.ReformConfig(block, 0.0))
  assert exact_all.senders.size == 0
  rg = G.reform(senders, receivers, n, G.ReformConfig(block, threshold))
  assert 0 < rg.dense_edge_fraction < 1
  no_tiles = G.reform(senders, receivers, n, G.ReformConfig(block, 1.01))  # nothing dense enough
  assert no_tiles.num_tiles == 0 and no_tiles.senders.size == senders.size
  tiles_all, tiles = GA.GraphTiles.from_reformed(exact_all), GA.GraphTiles.from_reformed(rg)
  return {
      "reformed_no_tiles": lambda q, k, v: GA.reformed_graph_attention(
          q, k, v, GA.GraphTiles.from_reformed(no_tiles), no_tiles.senders, no_tiles.receivers,
          return_lse=True, indices_are_sorted=True),
      "sparse": lambda q, k, v: GA.sparse_graph_attention(q, k, v, senders, receivers, return_lse=True),
      "block": lambda q, k, v: GA.tile_graph_attention(q, k, v, tiles_all, return_lse=True, chunk=5),
      "block_attention_op": lambda q, k, v: GA.tile_graph_attention(q, k, v, tiles_all, impl="attention_op", return_lse=True),
      "reformed": lambda q, k, v: GA.reformed_graph_attention(
          q, k, v, tiles, rg.senders, rg.receivers, return_lse=True, indices_are_sorted=True),
  }


def test_all_paths_match_dense_masked_forward(graph):
  n, s, r = graph
  q, k, v = _qkv(n)
  ref_out, ref_lse = dense_masked(q, k, v, s, r)
  assert np.all(np.asarray(ref_out[5]) == 0) and np.all(np.isneginf(ref_lse[5]))
  for name, fn in _paths(n, s, r).items():
    out, lse = fn(q, k, v)
    np.testing.assert_allclose(out, ref_out, atol=2e-5, err_msg=name)
    np.testing.assert_allclose(lse, ref_lse, atol=2e-5, err_msg=name)


def test_all_paths_match_dense_masked_gradient(graph):
  n, s, r = graph
  q, k, v = _qkv(n, seed=1)
  w = jax.random.normal(jax.random.PRNGKey(2), q.shape)

  def loss(fn):
    def f(q, k, v):
      out, lse = fn(q, k, v)
      return jnp.sum(out * w) + 0.1 * jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))
    return jax.grad(f, (0, 1, 2))(q, k, v)

  ref = loss(lambda q, k, v: dense_masked(q, k, v, s, r))
  for name, fn in _paths(n, s, r).items():
    if name == "block_attention_op":
      continue  # same reference math, forward covered above
    for a, b in zip(loss(fn), ref):
      np.testing.assert_allclose(a, b, atol=5e-5, err_msg=name)


def test_graph_attention_dispatch_and_jit(graph):
  n, s, r = graph
  q, k, v = _qkv(n)
  rg = G.reform(s, r, n, G.ReformConfig(16, 0.05))
  tiles = GA.GraphTiles.from_reformed(rg)
  f = jax.jit(lambda q, k, v, s, r, t, rs, rr: (
      GA.graph_attention(q, k, v, senders=s, receivers=r, indices_are_sorted=True),
      GA.graph_attention(q, k, v, mode="reformed", tiles=t, senders=rs, receivers=rr)))
  a, b = f(q, k, v, s, r, tiles, rg.senders, rg.receivers)
  np.testing.assert_allclose(a, b, atol=2e-5)


def test_dense_graph_attention_with_segments_and_padding():
  q, k, v = _qkv(12)
  seg = jnp.array([0] * 5 + [1] * 7)
  mask = jnp.arange(12) < 10
  out = GA.dense_graph_attention(q, k, v, segment_ids=seg, node_mask=mask)
  s = jnp.einsum("ihd,jhd->hij", q, k) / np.sqrt(8)
  vis = (seg[:, None] == seg[None]) & mask[None]
  p = jax.nn.softmax(jnp.where(vis[None], s, -jnp.inf), -1)
  np.testing.assert_allclose(out, jnp.einsum("hij,jhd->ihd", p, v), atol=2e-5)


def test_segment_softmax_is_max_subtracted():
  logits = jnp.array([1000.0, 1001.0, -jnp.inf, 5.0, -1000.0])
  seg = jnp.array([0, 0, 0, 1, 2])
  p = GA.segment_softmax(logits, seg, 4)
  np.testing.assert_allclose(p, [1 / (1 + np.e), np.e / (1 + np.e), 0.0, 1.0, 1.0], rtol=1e-6)
  assert np.all(np.isfinite(p))


def test_bad_inputs():
  q, k, v = _qkv(4)
  with pytest.raises(InputError, match="senders must lie in"):
    GA.sparse_graph_attention(q, k, v, jnp.array([0, 4]), jnp.array([0, 1]))
  with pytest.raises(InputError, match="receivers must lie in"):
    GA.sparse_graph_attention(q, k, v, jnp.array([0, 1]), jnp.array([-1, 1]))
  with pytest.raises(ShapeError, match="equal length"):
    GA.sparse_graph_attention(q, k, v, jnp.array([0, 1]), jnp.array([1]))
  with pytest.raises(ShapeError, match=r"\[nodes, heads, head_dim\]"):
    GA.sparse_graph_attention(q[0], k, v, jnp.array([0]), jnp.array([1]))
  with pytest.raises(ConfigError, match="needs tiles"):
    GA.graph_attention(q, k, v, mode="block")
  with pytest.raises(ConfigError, match="mode="):
    GA.graph_attention(q, k, v, mode="fast")
  with pytest.raises(NotImplementedError, match="Pallas"):
    GA.sparse_graph_attention(q, k, v, jnp.array([0]), jnp.array([1]), impl="pallas")


def test_edge_ids_are_validated_eagerly_and_under_jit():
  """Ids are checked before the int32 cast, and under jit through checkify (issue #14 item 9)."""
  q, k, v = _qkv(8, h=1, d=4)
  with pytest.raises(InputError, match=r"senders must lie in \[0, key_nodes=8\), got senders\[0\]=4294967297"):
    GA.sparse_graph_attention(q, k, v, np.array([2**32 + 1]), np.array([1]))  # int32 cast: 1
  with pytest.raises(ShapeError, match=r"receivers must be an integer array.*receivers\[0\]=1.5"):
    GA.sparse_graph_attention(q, k, v, np.array([0]), np.array([1.5]))
  from jaxsys.ops import checked
  f = jax.jit(lambda s, r: GA.sparse_graph_attention(q, k, v, s, r))
  ok = checked(f)(jnp.array([0, 2]), jnp.array([1, 1]))
  np.testing.assert_allclose(ok, f(jnp.array([0, 2]), jnp.array([1, 1])))
  with pytest.raises(InputError, match=r"senders must lie in \[0, key_nodes=8\), got senders\[1\]=-1"):
    checked(f)(jnp.array([0, -1]), jnp.array([1, 1]))  # would read node 7
  with pytest.raises(InputError, match=r"receivers must lie in \[0, num_nodes=8\), got receivers\[0\]=9"):
    checked(f)(jnp.array([0, 1]), jnp.array([9, 1]))  # would be dropped by segment_sum
  with pytest.raises(ShapeError, match="senders must be an integer array"):
    f(jnp.array([0.0]), jnp.array([1]))


def test_sparse_attention_in_edge_chunks_matches(graph, monkeypatch):
  """Large edge sets are processed in chunks (``EDGE_CHUNK``): same values and gradients."""
  n, s, r = graph
  q, k, v = _qkv(n, seed=3)

  def run():
    f = lambda q, k, v: GA.sparse_graph_attention(q, k, v, s, r, return_lse=True)
    out, lse = f(q, k, v)
    grads = jax.grad(lambda q, k, v: jnp.sum(f(q, k, v)[0] ** 2), (0, 1, 2))(q, k, v)
    return out, lse, grads

  whole = run()
  monkeypatch.setattr(GA, "EDGE_CHUNK", 64)  # ~10 chunks, the last one padded
  assert len(s) > 5 * GA.EDGE_CHUNK and len(s) % GA.EDGE_CHUNK
  chunked = run()
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5), whole, chunked)
