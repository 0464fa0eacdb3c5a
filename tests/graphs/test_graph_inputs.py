"""``graph_inputs`` on repeated edges (dropped by default, or rejected), and GraphAttention's
modes agreeing on any graph, repeats included (a hypothesis property on small random graphs)."""

import functools

import jax
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings, strategies as st

from jaxsys.core.errors import InputError
from jaxsys.graphs.blocks import ReformConfig
from jaxsys.graphs.dataset import make_graph
from jaxsys.graphs.padding import pad_graph
from jaxsys.nn import GraphAttention, graph_inputs

DIM = 8


def _graph(n, senders, receivers):
  return make_graph(np.zeros((n, 1), np.float32), np.asarray(senders, np.int32),
                    np.asarray(receivers, np.int32))


def _naive(layer, x, n, senders, receivers):
  """Equation (1) over the neighbour set (unique edges + self loops), by a dense masked softmax."""
  adj = np.eye(n, dtype=bool)
  adj[np.asarray(receivers, int), np.asarray(senders, int)] = True      # [receiver, sender]
  h, hd = layer.num_heads, layer.head_dim
  q, k, v = np.split(np.asarray(layer.qkv(x)).reshape(n, 3, h, hd), 3, axis=1)
  s = np.einsum("qhd,khd->hqk", q[:, 0], k[:, 0]) / np.sqrt(hd)
  s = np.where(adj[None], s, -np.inf)
  p = np.exp(s - s.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  return np.asarray(layer.out(np.einsum("hqk,khd->qhd", p, v[:, 0]).reshape(n, -1)))


@st.composite
def graphs(draw):
  """A graph of 2..10 nodes, no self loops, with repeated edges; sometimes complete (then the
  dense mode, which attends to every node, must agree too)."""
  n = draw(st.integers(2, 10))
  pairs = [(s, r) for s in range(n) for r in range(n) if s != r]
  complete = draw(st.booleans())
  edges = pairs if complete else draw(st.lists(st.sampled_from(pairs), max_size=3 * n))
  repeats = draw(st.lists(st.sampled_from(pairs), min_size=1, max_size=n))
  edges = list(edges) + repeats + repeats[:1]
  order = draw(st.permutations(range(len(edges))))
  s, r = zip(*[edges[i] for i in order])
  return n, list(s), list(r), complete


_LAYER = GraphAttention(DIM, 2, rngs=nnx.Rngs(0))
_DEF, _STATE = nnx.split(_LAYER)
NODES, EDGES = 16, 128  # every example padded to one bucket: one compiled program per mode


@functools.partial(jax.jit, static_argnums=2)
def _run(x, inputs, mode):
  return nnx.merge(_DEF, _STATE)(x, inputs, mode=mode)


@settings(max_examples=6, deadline=None, derandomize=True)
@given(graphs())
def test_modes_agree_with_repeated_edges(g):
  n, s, r, complete = g
  x = jax.random.normal(jax.random.key(n), (NODES, DIM))
  inputs = graph_inputs(pad_graph(_graph(n, s, r), NODES, EDGES), padded=True,
                        reform_config=ReformConfig(block_size=4, threshold=0.3))
  want = _naive(_LAYER, x[:n], n, s, r)
  modes = ("sparse", "reformed", "dense") if complete else ("sparse", "reformed")
  for mode in modes:
    np.testing.assert_allclose(_run(x, inputs, mode)[:n], want, atol=2e-5, rtol=2e-5, err_msg=mode)


def test_repeated_edges_dropped_or_rejected():
  g = _graph(4, [0, 1, 0, 2], [1, 2, 1, 3])                # 0 -> 1 twice
  inputs = graph_inputs(g)
  assert len(inputs.senders) == 3 + 4                     # unique edges + self loops
  assert inputs.degree.tolist() == [0, 1, 1, 1]
  with pytest.raises(InputError, match=r"1 repeated edges \(first: edge 2, 0 -> 1\)"):
    graph_inputs(g, duplicates="raise")
  with pytest.raises(Exception, match="duplicates='keep' must be one of"):
    graph_inputs(g, duplicates="keep")
  # padded: the static edge count stays E + N, the repeat becomes a padding-node edge
  padded = graph_inputs(pad_graph(g, 8, 8), padded=True)
  assert len(padded.senders) == 8 + 8
  real = np.asarray(padded.node_mask)[np.asarray(padded.receivers)]
  assert sorted(zip(np.asarray(padded.senders)[real].tolist(),
                    np.asarray(padded.receivers)[real].tolist())) == sorted(
      [(0, 1), (1, 2), (2, 3)] + [(i, i) for i in range(4)])
