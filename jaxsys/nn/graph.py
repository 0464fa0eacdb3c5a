"""Graph layers (Flax NNX): topology/global attention, GCN convolution, degree encoding.

``GraphInputs`` (defined in ``jaxsys.graphs.inputs``, re-exported here) bundles everything a
layer needs to know about the graph (a pytree of device arrays, built on the host by
``graph_inputs``): edges (with self loops, sorted by receiver), the
ECR split (dense tiles + leftover edges) when reformation is on, per-node degree (Graphormer's
centrality encoding), graph ids (batched graphs) and the padding mask.

Usage::

  inputs = graph_inputs(ds.graph, reform_config=ReformConfig(64, 0.1))
  layer = GraphAttention(64, num_heads=4, rngs=nnx.Rngs(0))
  y = layer(x, inputs, mode="reformed")            # or "sparse" / "dense" / "block"
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
from flax import nnx

from jaxsys.core.errors import ConfigError
from jaxsys.graphs.inputs import GraphInputs, graph_inputs  # noqa: F401  (re-exported: the layers' input)
from jaxsys.ops.graph_attn import graph_attention

__all__ = [
    "attend", "DegreeEncoding", "gcn_norm", "GCNConv", "graph_inputs", "GraphAttention", "GraphInputs",
]


def attend(q, k, v, inputs: GraphInputs, mode: str, *, impl: str = "auto"):
  """``q, k, v [nodes, heads, dim]`` attended over the graph in ``inputs`` by ``mode``:
  "sparse" (the edges), "dense" (all nodes of the same graph), "reformed" / "block" (dense tiles
  + leftover edges)."""
  if mode == "sparse":
    return graph_attention(q, k, v, mode="sparse", senders=inputs.senders, receivers=inputs.receivers,
                           impl=impl, indices_are_sorted=True)
  if mode == "dense":
    return graph_attention(q, k, v, mode="dense", segment_ids=inputs.graph_ids,
                           node_mask=inputs.node_mask, impl=impl)
  if mode in ("reformed", "block"):
    return graph_attention(q, k, v, mode=mode, tiles=inputs.tiles, senders=inputs.rest_senders,
                           receivers=inputs.rest_receivers, impl=impl, indices_are_sorted=True)
  raise ConfigError(f"{mode=} must be 'sparse', 'reformed', 'block' or 'dense'")


class GraphAttention(nnx.Module):
  """Multi-head attention over a graph: q/k/v projections, ``graph_attention``, output projection.

  ``mode`` (per call): "sparse" (topology, equation (1) of ``jaxsys.ops.graph_attn``),
  "reformed" (same result via dense tiles + edges), "block" (tiles only), "dense" (global,
  within each graph, padding hidden).
  """

  def __init__(self, dim: int, num_heads: int, *, head_dim: int | None = None, impl: str = "auto",
               rngs: nnx.Rngs):
    if dim % num_heads and head_dim is None:
      raise ConfigError(f"{dim=} must be divisible by {num_heads=} (or pass head_dim)")
    self.num_heads = num_heads
    self.head_dim = head_dim or dim // num_heads
    self.impl = impl
    inner = num_heads * self.head_dim
    self.qkv = nnx.Linear(dim, 3 * inner, rngs=rngs)
    self.out = nnx.Linear(inner, dim, rngs=rngs)

  def __call__(self, x, inputs: GraphInputs, *, mode: str = "sparse", attention_fn=None):
    n = x.shape[0]
    qkv = self.qkv(x).reshape(n, 3, self.num_heads, self.head_dim)  # [nodes, 3, heads, dim]
    q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]
    if attention_fn is not None:  # e.g. a graph-parallel program
      o = attention_fn(q, k, v, mode)
    else:
      o = attend(q, k, v, inputs, mode, impl=self.impl)
    return self.out(o.reshape(n, -1))


class DegreeEncoding(nnx.Module):
  """Graphormer centrality encoding: a learned vector per (clipped) node degree."""

  def __init__(self, max_degree: int, dim: int, *, rngs: nnx.Rngs):
    self.max_degree = max_degree
    self.embed = nnx.Embed(max_degree + 1, dim, rngs=rngs)

  def __call__(self, degree):
    return self.embed(jnp.minimum(degree, self.max_degree))


def gcn_norm(senders, receivers, num_nodes: int):
  """Symmetric GCN edge weights ``1/sqrt(d_s d_r)`` (Kipf & Welling 2017), edges with self loops."""
  deg = jax.ops.segment_sum(jnp.ones_like(receivers, jnp.float32), receivers, num_nodes)
  inv = jnp.where(deg > 0, jax.lax.rsqrt(jnp.maximum(deg, 1.0)), 0.0)
  return inv[senders] * inv[receivers]


class GCNConv(nnx.Module):
  """``H' = D^-1/2 (A + I) D^-1/2 H W`` (edges from ``GraphInputs`` already hold self loops)."""

  def __init__(self, in_dim: int, out_dim: int, *, rngs: nnx.Rngs):
    self.linear = nnx.Linear(in_dim, out_dim, rngs=rngs)

  def __call__(self, x, inputs: GraphInputs):
    h = self.linear(x)
    w = gcn_norm(inputs.senders, inputs.receivers, x.shape[0])
    return jax.ops.segment_sum(h[inputs.senders] * w[:, None], inputs.receivers, x.shape[0],
                               indices_are_sorted=True)
