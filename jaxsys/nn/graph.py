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

from jaxsys.nn.explicit import explicit_ok
from jaxsys.core.errors import ConfigError, ShapeError
from jaxsys.graphs.inputs import GraphInputs, graph_inputs  # noqa: F401  (re-exported: the layers' input)
from jaxsys.ops.graph_attn import graph_attention
from jaxsys.core import init

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


def _linear(din, dout, axes, *, dtype, param_dtype, rngs):
  """``nnx.Linear`` whose kernel ``[din, dout]`` and bias ``[dout]`` carry ``logical_axes``."""
  return nnx.Linear(din, dout, dtype=dtype, param_dtype=param_dtype, rngs=rngs, **init.dense_defaults(),
                    kernel_metadata={"logical_axes": axes}, bias_metadata={"logical_axes": axes[1:]})


def _nodes_first(x):
  """``[..., nodes, f] -> [nodes, ..., f]``: graph ops gather and scatter along axis 0."""
  return jnp.moveaxis(x, -2, 0)


class GraphAttention(nnx.Module):
  """Multi-head attention over a graph: q/k/v projections, ``graph_attention``, output projection.

  ``x [..., nodes, dim] -> [..., nodes, dim]`` in ``dtype``: every leading axis is another set
  of node features over the same graph (they run as extra heads of one ``graph_attention``
  call). ``mode`` (per call): "sparse" (topology, equation (1) of ``jaxsys.ops.graph_attn``),
  "reformed" (same result via dense tiles + edges), "block" (tiles only), "dense" (global,
  within each graph, padding hidden). Parameters: ``qkv`` (``nnx.Linear`` ``[dim, 3 * heads *
  head_dim]``, logical ``("embed", "heads")``) and ``out`` (``[heads * head_dim, dim]``,
  ``("heads", "embed")``) in ``param_dtype``.

  Example::

    inputs = graph_inputs(graph)                         # a jraph.GraphsTuple
    layer = GraphAttention(64, num_heads=4, rngs=nnx.Rngs(0))
    y = layer(x, inputs, mode="sparse")                  # x [nodes, 64] or [batch, nodes, 64]
  """

  def __init__(self, dim: int, num_heads: int, *, head_dim: int | None = None, impl: str = "auto",
               dtype=None, param_dtype=jnp.float32, rngs: nnx.Rngs):
    if dim % num_heads and head_dim is None:
      raise ConfigError(f"{dim=} must be divisible by {num_heads=} (or pass head_dim)")
    self.dim, self.num_heads = dim, num_heads
    self.head_dim = head_dim or dim // num_heads
    self.impl = impl
    inner = num_heads * self.head_dim
    kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.qkv = _linear(dim, 3 * inner, ("embed", "heads"), **kw)
    self.out = _linear(inner, dim, ("heads", "embed"), **kw)

  @explicit_ok
  def __call__(self, x, inputs: GraphInputs, *, mode: str = "sparse", attention_fn=None):
    """``attention_fn(q, k, v, mode)`` (e.g. a graph-parallel program) replaces ``attend``; it
    gets ``q, k, v [nodes, lead * heads, head_dim]``."""
    if x.ndim < 2 or x.shape[-1] != self.dim:
      raise ShapeError(f"x must be [..., nodes, {self.dim}], got shape {x.shape}")
    lead, n, h, hd = x.shape[:-2], x.shape[-2], self.num_heads, self.head_dim
    qkv = _nodes_first(self.qkv(x).reshape(-1, n, 3 * h * hd))      # [nodes, lead, 3 heads hd]
    qkv = qkv.reshape(n, -1, 3, h, hd).transpose(0, 2, 1, 3, 4).reshape(n, 3, -1, hd)
    q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]                        # [nodes, lead * heads, hd]
    if attention_fn is not None:
      o = attention_fn(q, k, v, mode)
    else:
      o = attend(q, k, v, inputs, mode, impl=self.impl)
    o = jnp.moveaxis(o.reshape(n, -1, h * hd), 0, 1)                 # [lead, nodes, heads hd]
    return self.out(o.reshape(*lead, n, h * hd))


class DegreeEncoding(nnx.Module):
  """Graphormer centrality encoding: a learned vector per (clipped) node degree.

  ``degree int[...] -> [..., dim]``; table ``embed.embedding [max_degree + 1, dim]``.

  Example::

    enc = DegreeEncoding(64, 32, rngs=nnx.Rngs(0))
    h = enc(inputs.degree)                               # [nodes, 32]
  """

  def __init__(self, max_degree: int, dim: int, *, dtype=None, param_dtype=jnp.float32,
               rngs: nnx.Rngs):
    self.max_degree = max_degree
    self.embed = nnx.Embed(max_degree + 1, dim, dtype=dtype, param_dtype=param_dtype, rngs=rngs, **init.embed_defaults(),
                           embedding_metadata={"logical_axes": (None, "embed")})

  @explicit_ok
  def __call__(self, degree):
    return self.embed(jnp.minimum(degree, self.max_degree))


def gcn_norm(senders, receivers, num_nodes: int):
  """Symmetric GCN edge weights ``1/sqrt(d_s d_r)`` (Kipf & Welling 2017), edges with self loops."""
  deg = jax.ops.segment_sum(jnp.ones_like(receivers, jnp.float32), receivers, num_nodes)
  inv = jnp.where(deg > 0, jax.lax.rsqrt(jnp.maximum(deg, 1.0)), 0.0)
  return inv[senders] * inv[receivers]


class GCNConv(nnx.Module):
  """``H' = D^-1/2 (A + I) D^-1/2 H W`` (Kipf & Welling 2017); edges from ``GraphInputs`` already
  hold self loops.

  ``x [..., nodes, in_dim] -> [..., nodes, out_dim]``; ``linear``: ``nnx.Linear [in_dim,
  out_dim]`` (logical ``("embed", "mlp")``).

  Example::

    conv = GCNConv(16, 32, rngs=nnx.Rngs(0))
    y = conv(x, graph_inputs(graph))                     # x [nodes, 16] -> [nodes, 32]
  """

  def __init__(self, in_dim: int, out_dim: int, *, dtype=None, param_dtype=jnp.float32,
               rngs: nnx.Rngs):
    self.linear = _linear(in_dim, out_dim, ("embed", "mlp"), dtype=dtype, param_dtype=param_dtype,
                          rngs=rngs)

  @explicit_ok
  def __call__(self, x, inputs: GraphInputs):
    if x.ndim < 2:
      raise ShapeError(f"x must be [..., nodes, features], got shape {x.shape}")
    h = _nodes_first(self.linear(x))                                 # [nodes, ..., out]
    n = h.shape[0]
    w = gcn_norm(inputs.senders, inputs.receivers, n).astype(h.dtype)
    w = w.reshape((-1,) + (1,) * (h.ndim - 1))                       # [edges, 1, ..., 1]
    out = jax.ops.segment_sum(h[inputs.senders] * w, inputs.receivers, n, indices_are_sorted=True)
    return jnp.moveaxis(out, 0, -2)
