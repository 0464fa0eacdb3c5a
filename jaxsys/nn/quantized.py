"""Quantized GNN layers (Flax NNX) with A2Q on node features and weights.

* ``FeatureQuantizer``: per-node learnable (step, bits) (``[N, 1]``), or the Nearest Neighbor
  Strategy with m learned pairs (``nns_pairs > 0``) so the layer quantizes unseen graphs.
* ``WeightQuantizer``: per-output-channel (step, bits) ``[1, out]``.
* ``QuantLinear``, ``QuantGCNConv``, ``QuantGINConv``, ``QuantGATConv``: quantize the layer input
  features and the weights, then combine (``X_q W_q``) and aggregate over the graph. An optional
  ``dropout`` callable is applied after the feature quantizer.

Quantizer parameters are ``StepParam`` / ``BitsParam`` (subclasses of ``nnx.Param``) so an
optimizer can give them their own learning rates. Each layer call returns ``(out, bits_info)``
where ``bits_info`` lists ``(b [rows, 1], dim)`` of its feature quantizers, the input of A2Q's
memory penalty (``jaxsys.quant.a2q.memory_penalty``).

Usage::

  cfg = A2QConfig(init_feature_bits=4, target_bits=2.0)
  conv = QuantGCNConv(1433, 16, num_nodes=2708, quant=cfg, rngs=nnx.Rngs(0))
  edges = normalized_edges(senders, receivers, 2708, "gcn")
  h, bits_info = conv(x, edges)
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from jaxsys.nn.explicit import explicit_ok
from jaxsys.core.errors import ConfigError, InputError, ShapeError, check_min, check_range
from jaxsys.quant import a2q
from jaxsys.core import init

__all__ = [
    "A2QConfig", "BitsParam", "FeatureQuantizer", "QuantGATConv", "QuantGCNConv", "QuantGINConv",
    "QuantLinear", "StepParam", "WeightQuantizer",
]


class StepParam(nnx.Param):
  """A quantizer step size (kept positive through ``abs`` in the forward pass)."""


class BitsParam(nnx.Param):
  """A continuous learnable bitwidth (forward uses round(clip(b, 1, 8)))."""


@dataclasses.dataclass(frozen=True)
class A2QConfig:
  """A2Q settings shared by all quantizers of a model."""
  init_feature_bits: float = 4.0
  init_weight_bits: float = 4.0
  target_bits: float | None = 2.0   # memory-penalty budget for feature bits; None: no penalty
  penalty: float = 0.1              # lambda of the memory penalty
  local_gradient: bool = True       # feature (s, b) learn from their own quantization error
  nns_pairs: int = 0                # > 0: Nearest Neighbor Strategy with that many (s, b) pairs
  quantize_weights: bool = True

  def __post_init__(self):
    for name in ("init_feature_bits", "init_weight_bits"):
      check_range(name, getattr(self, name), a2q.MIN_BITS, a2q.MAX_BITS)
    if self.target_bits is not None:
      a2q.check_target_bits(self.target_bits)
    check_min(self, 0, "penalty", "nns_pairs")


_EPS = 1e-8


class FeatureQuantizer(nnx.Module):
  """A2Q feature quantizer: per node (``[N, 1]`` params) or NNS (``[m]`` pairs)."""

  def __init__(self, num_nodes: int, cfg: A2QConfig, *, signed: bool = False,
               init_bits=None):
    self.cfg, self.signed, self.num_nodes = cfg, signed, num_nodes
    self.calibrating = False
    m = cfg.nns_pairs
    if m:
      self.step = StepParam(jnp.geomspace(1e-3, 1.0, m).astype(jnp.float32))
      self.bits = BitsParam(jnp.full((m,), cfg.init_feature_bits, jnp.float32))
    else:
      b0 = (jnp.full((num_nodes, 1), cfg.init_feature_bits, jnp.float32) if init_bits is None
            else jnp.asarray(init_bits, jnp.float32).reshape(num_nodes, 1))
      a2q.check_bits("init_bits", b0)
      self.step = StepParam(jnp.full((num_nodes, 1), 0.1, jnp.float32))
      self.bits = BitsParam(b0)

  def params_for(self, x):
    """``(s [rows, 1], b [rows, 1])`` used for ``x``: own rows, or NNS-selected pairs."""
    if self.cfg.nns_pairs:
      s, b, _ = a2q.nns_select(x, jnp.abs(self.step[...]) + _EPS, self.bits[...], self.signed)
      return s, b
    if x.shape[0] != self.num_nodes:
      raise InputError(f"per-node quantizer holds {self.num_nodes} nodes but x has "
                       f"{x.shape[0]} rows; use nns_pairs > 0 to quantize other graphs")
    return jnp.abs(self.step[...]) + _EPS, self.bits[...]

  def calibrate(self, x):
    """Sets steps so each node's (or pair's) clip range covers its max |x|."""
    b = a2q.round_bits(self.bits[...])
    qmax = a2q.qmax_of(b, self.signed)
    rowmax = jnp.max(jnp.abs(x), axis=-1)
    if self.cfg.nns_pairs:
      qs = jnp.quantile(rowmax, jnp.linspace(0.0, 1.0, self.cfg.nns_pairs))
      self.step[...] = jnp.maximum(qs / jnp.maximum(qmax, 1.0), _EPS)
    else:
      self.step[...] = jnp.maximum(rowmax[:, None] / jnp.maximum(qmax, 1.0), _EPS)

  def __call__(self, x):
    if self.calibrating:
      self.calibrate(x)
    s, b = self.params_for(x)
    xq = a2q.a2q_quantize(x, s, b, self.signed, self.cfg.local_gradient)
    return xq, (b, x.shape[-1])


class WeightQuantizer(nnx.Module):
  """A2Q weight quantizer, one (step, bits) per output channel, initialised from the weights."""

  def __init__(self, kernel, cfg: A2QConfig, *, out_axis: str | None = None):
    """``kernel [din, dout]``; ``out_axis``: the logical name of ``dout`` (step / bits ``[1, dout]``
    shard with the kernel's output channels)."""
    b = jnp.full((1, kernel.shape[-1]), cfg.init_weight_bits, jnp.float32)
    axes = (None, out_axis)
    self.step = StepParam(a2q.init_step_from_data(kernel, b, True, axis=0), logical_axes=axes)
    self.bits = BitsParam(b, logical_axes=axes)

  def __call__(self, w):
    return a2q.a2q_quantize(w, jnp.abs(self.step[...]) + _EPS, self.bits[...], True, False)


class QuantLinear(nnx.Module):
  """``x @ Q(W) (+ b)`` with a per-output-channel A2Q weight quantizer (float when ``quant`` is
  None or does not quantize weights).

  ``x [..., din] -> [..., dout]`` in ``dtype`` (default: x's and the parameters' common type).
  Parameters ``kernel [din, dout]`` and ``bias [dout]`` in ``param_dtype``, logical axes
  ``kernel_axes`` (default ``("embed", "mlp")``; the bias takes the second); the quantizer's
  ``step`` / ``bits [1, dout]`` stay float32.

  Example::

    lin = QuantLinear(64, 32, A2QConfig(init_weight_bits=4), rngs=nnx.Rngs(0))
    y = lin(jnp.ones((2, 8, 64)))             # [2, 8, 32]
  """

  def __init__(self, din: int, dout: int, quant: A2QConfig | None = None, *, rngs: nnx.Rngs,
               use_bias: bool = True, dtype=None, param_dtype=jnp.float32,
               kernel_axes: tuple[str | None, str | None] = ("embed", "mlp")):
    if len(kernel_axes) != 2:
      raise ConfigError(f"{kernel_axes=} must name the 2 kernel axes [din, dout]")
    kernel_axes = tuple(kernel_axes)
    self.din, self.dtype = din, dtype
    w = init.glorot_uniform()(rngs.params(), (din, dout), jnp.float32)
    self.kernel = nnx.Param(w.astype(param_dtype), logical_axes=kernel_axes)
    self.bias = (nnx.Param(jnp.zeros((dout,), param_dtype), logical_axes=kernel_axes[1:])
                 if use_bias else None)
    self.wq = (WeightQuantizer(w, quant, out_axis=kernel_axes[1])
               if quant is not None and quant.quantize_weights else None)

  def quantized_kernel(self):
    """The kernel the layer multiplies by: ``Q(W) [din, dout]`` (float32 when quantized)."""
    w = self.kernel[...]
    return self.wq(w.astype(jnp.float32)) if self.wq is not None else w

  @explicit_ok
  def __call__(self, x, *, bias: bool = True):
    if x.ndim < 1 or x.shape[-1] != self.din:
      raise ShapeError(f"x must be [..., {self.din}], got shape {x.shape}")
    dtype = self.dtype or jnp.result_type(x.dtype, self.kernel[...].dtype)
    y = jnp.einsum("...f,fo->...o", x.astype(dtype), self.quantized_kernel().astype(dtype))
    if bias and self.bias is not None:
      y = y + self.bias[...].astype(dtype)
    return y


def _maybe_quantize(fq: FeatureQuantizer | None, x, dropout=None):
  """Quantizes (if fq) and then applies ``dropout``: the quantizer sees the same distribution
  in training and inference (the stored / packed features are the pre-dropout ones)."""
  info = []
  if fq is not None:
    x, i = fq(x)
    info = [i]
  if dropout is not None:
    x = dropout(x)
  return x, info


def _scatter(msg, receivers, num_nodes):
  return jax.ops.segment_sum(msg, receivers, num_nodes)  # [nodes, ...]


class QuantGCNConv(nnx.Module):
  """``D^-1/2 (A+I) D^-1/2 Q(X) Q(W) + b``; edges from ``normalized_edges(..., "gcn")``.

  ``x [nodes, din] -> ([nodes, dout], bits_info)``: node features stay 2-D because the feature
  quantizer holds one (step, bits) per node row (``num_nodes`` of them, or NNS pairs).

  Example::

    conv = QuantGCNConv(16, 8, num_nodes=100, quant=A2QConfig(), rngs=nnx.Rngs(0))
    h, bits_info = conv(x, normalized_edges(senders, receivers, 100, "gcn"))
  """

  def __init__(self, din: int, dout: int, *, num_nodes: int, quant: A2QConfig | None,
               rngs: nnx.Rngs, signed_input: bool = False, init_bits=None):
    self.fq = (FeatureQuantizer(num_nodes, quant, signed=signed_input, init_bits=init_bits)
               if quant is not None else None)
    self.lin = QuantLinear(din, dout, quant, rngs=rngs)

  def __call__(self, x, edges, dropout=None):
    s, r, w = edges
    x, info = _maybe_quantize(self.fq, x, dropout)
    h = self.lin(x, bias=False)                                # [nodes, out]
    out = _scatter(h[s] * w[:, None], r, x.shape[0]) + self.lin.bias[...]
    return out, info


class QuantGINConv(nnx.Module):
  """``MLP((1 + eps) Q(x_i) + sum_j Q(x_j))`` with quantized MLP inputs; edges unweighted.

  ``x [nodes, din] -> ([nodes, dout], bits_info)`` (2-D: per-node quantizers, as QuantGCNConv).

  Example::

    conv = QuantGINConv(16, 8, num_nodes=100, quant=A2QConfig(), rngs=nnx.Rngs(0))
    h, bits_info = conv(x, (senders, receivers, None))
  """

  def __init__(self, din: int, dout: int, *, num_nodes: int, quant: A2QConfig | None,
               rngs: nnx.Rngs, signed_input: bool = False, init_bits=None):
    self.fq = (FeatureQuantizer(num_nodes, quant, signed=signed_input, init_bits=init_bits)
               if quant is not None else None)
    self.fq_hidden = FeatureQuantizer(num_nodes, quant) if quant is not None else None
    self.eps = nnx.Param(jnp.zeros((), jnp.float32))
    self.lin1 = QuantLinear(din, dout, quant, rngs=rngs)
    self.lin2 = QuantLinear(dout, dout, quant, rngs=rngs)

  def __call__(self, x, edges, dropout=None):
    s, r, _ = edges
    x, info = _maybe_quantize(self.fq, x, dropout)
    agg = (1.0 + self.eps[...]) * x + _scatter(x[s], r, x.shape[0])  # [nodes, in]
    h = jax.nn.relu(self.lin1(agg))
    h, info2 = _maybe_quantize(self.fq_hidden, h)
    return self.lin2(h), info + info2


class QuantGATConv(nnx.Module):
  """Multi-head graph attention on quantized features/weights; edges must include self loops.

  ``x [nodes, din] -> ([nodes, heads * dout] (concat) or [nodes, dout], bits_info)`` (2-D:
  per-node quantizers, as QuantGCNConv).

  Example::

    conv = QuantGATConv(16, 8, heads=2, num_nodes=100, quant=A2QConfig(), rngs=nnx.Rngs(0))
    h, bits_info = conv(x, (senders, receivers, None))
  """

  def __init__(self, din: int, dout: int, *, heads: int, num_nodes: int,
               quant: A2QConfig | None, rngs: nnx.Rngs, concat: bool = True,
               signed_input: bool = False, init_bits=None):
    if heads <= 0:
      raise ConfigError(f"{heads=} must be positive")
    self.heads, self.dout, self.concat = heads, dout, concat
    self.fq = (FeatureQuantizer(num_nodes, quant, signed=signed_input, init_bits=init_bits)
               if quant is not None else None)
    self.lin = QuantLinear(din, heads * dout, quant, rngs=rngs, use_bias=False)
    glorot = init.glorot_uniform()
    self.att_src = nnx.Param(glorot(rngs.params(), (heads, dout), jnp.float32))
    self.att_dst = nnx.Param(glorot(rngs.params(), (heads, dout), jnp.float32))
    self.bias = nnx.Param(jnp.zeros((heads * dout if concat else dout,), jnp.float32))

  def __call__(self, x, edges, dropout=None):
    s, r, _ = edges
    n = x.shape[0]
    x, info = _maybe_quantize(self.fq, x, dropout)
    h = self.lin(x).reshape(n, self.heads, self.dout)               # [nodes, heads, out]
    a_s = jnp.einsum("nhc,hc->nh", h, self.att_src[...])
    a_d = jnp.einsum("nhc,hc->nh", h, self.att_dst[...])
    logit = jax.nn.leaky_relu(a_s[s] + a_d[r], 0.2)                  # [edges, heads]
    logit = logit - jax.ops.segment_max(logit, r, n)[r]
    p = jnp.exp(logit)
    p = p / jnp.maximum(jax.ops.segment_sum(p, r, n)[r], 1e-16)
    out = _scatter(h[s] * p[..., None], r, n)                        # [nodes, heads, out]
    out = out.reshape(n, -1) if self.concat else out.mean(axis=1)
    return out + self.bias[...], info

