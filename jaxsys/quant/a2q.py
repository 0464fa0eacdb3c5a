"""A2Q: aggregation-aware quantization with learnable per-node bitwidth and step size.

Forward (A2Q eq. 1), with ``b_r = round(clip(b, 1, 8))``::

  qmax = 2^(b_r - 1) - 1            (signed: weights, features that may be negative)
  qmax = 2^b_r - 1                  (unsigned: non-negative features, e.g. after ReLU)
  x_q  = sign(x) * floor(|clip(x / s, -qmax, qmax)| + 0.5) * s

Backward (A2Q eq. 3-4; straight-through for x inside the clip range, zero outside)::

  d x_q / d s = sign(x) * (floor(|x/s| + 0.5) - |x/s|)    if |x| <= qmax * s
              = sign(x) * qmax                            otherwise
  d x_q / d b = 0                                         if |x| <= qmax * s
              = sign(x) * s * (qmax + 1) * ln 2           otherwise   (d qmax / d b = (qmax+1) ln 2)

Local Gradient (A2Q sec. 3.3): for feature quantizers the (s, b) gradients come from the
quantization error ``E_i = 1/d * sum_j (x_q - x)^2`` of each node instead of the task loss, so
nodes far from labelled nodes still learn their parameters.

Memory penalty (A2Q eq. 6): ``L_mem = (sum_i dim_i * b_i / sum_i dim_i - M_target)^2``.

Nearest Neighbor Strategy (A2Q sec. 3.4): m learned (s, b) pairs; node i uses the pair whose
``qmax_j * s_j`` is nearest to ``max_j |x_ij|``, so a trained model quantizes unseen graphs.

Usage::

  xq = a2q_quantize(x, step[:, None], bits[:, None], signed=False)       # per node
  wq = a2q_quantize(w, w_step[None, :], w_bits[None, :], signed=True)    # per output channel
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from jaxsys.core.errors import ConfigError, InputError

__all__ = [
    "a2q_quantize", "average_bits", "check_bits", "check_target_bits", "init_step_from_data", "MAX_BITS",
    "memory_penalty", "MIN_BITS", "nns_select", "qmax_of", "quantize_codes", "round_bits",
    "surrogate_derivatives",
]

MIN_BITS = 1
MAX_BITS = 8
_LN2 = math.log(2.0)


def check_bits(name: str, bits) -> None:
  """Raises ConfigError if concrete ``bits`` fall outside [1, 8] (traced values pass)."""
  try:
    arr = jnp.asarray(bits)
    lo, hi = float(arr.min()), float(arr.max())
  except (jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError,
          TypeError):
    return
  if lo < MIN_BITS or hi > MAX_BITS:
    raise ConfigError(f"{name} must lie in [{MIN_BITS}, {MAX_BITS}], got range [{lo}, {hi}]")


def round_bits(b):
  """The integer bitwidth the forward pass uses: round(clip(b, 1, 8))."""
  return jnp.round(jnp.clip(b, MIN_BITS, MAX_BITS))


def qmax_of(bits_rounded, signed: bool):
  """Largest code magnitude for a rounded bitwidth."""
  if signed:
    return 2.0 ** (bits_rounded - 1) - 1
  return 2.0 ** bits_rounded - 1


def quantize_codes(x, s, bits_rounded, signed: bool):
  """Integer codes (as float) of eq. 1: ``sign(x) * floor(|clip(x/s)| + 0.5)``."""
  qmax = qmax_of(bits_rounded, signed)
  lo = -qmax if signed else jnp.zeros_like(qmax)
  u = jnp.clip(x / s, lo, qmax)
  return jnp.sign(u) * jnp.floor(jnp.abs(u) + 0.5)


def _reduce_to(g, shape):
  """Sums a broadcast gradient back to the parameter's shape."""
  if g.shape == tuple(shape):
    return g
  lead = g.ndim - len(shape)
  g = g.sum(axis=tuple(range(lead))) if lead else g
  axes = tuple(i for i, n in enumerate(shape) if n == 1 and g.shape[i] != 1)
  return g.sum(axis=axes, keepdims=True).reshape(shape)


def surrogate_derivatives(x, s, b, signed: bool):
  """Per-element ``(in_range, d x_q/d s, d x_q/d b)`` of the paper's backward pass."""
  br = round_bits(b)
  qmax = qmax_of(br, signed)
  u = x / s
  lo = -qmax if signed else jnp.zeros_like(qmax)
  in_range = (u <= qmax) & (u >= lo)
  sgn = jnp.sign(x)
  d_s = jnp.where(in_range, sgn * jnp.floor(jnp.abs(u) + 0.5) - u, jnp.where(u > qmax, qmax, -qmax))
  d_s = jnp.where(~in_range & (u < lo) & (not signed), 0.0, d_s)  # unsigned: clipped at 0
  d_b = jnp.where(in_range, 0.0, sgn * s * (qmax + 1.0) * _LN2)
  d_b = jnp.where(~in_range & (u < lo) & (not signed), 0.0, d_b)
  return in_range, d_s, d_b


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def a2q_quantize(x, s, b, signed: bool = True, local_gradient: bool = False):
  """A2Q fake quantization ``x_q`` (eq. 1) with the paper's custom gradients.

  Args:
    x: values ``[..., F]``.
    s: positive step sizes broadcastable to x (``[N, 1]`` per node, ``[1, F]`` per channel).
    b: continuous bitwidths, same shape as s; the forward uses ``round(clip(b, 1, 8))``.
    signed: codes in ``[-qmax, qmax]`` with ``qmax = 2^(b-1)-1``; unsigned: ``[0, 2^b-1]``.
    local_gradient: take the (s, b) gradients from the node's own quantization error.
  """
  return quantize_codes(x, s, round_bits(b), signed) * s


def _fwd(x, s, b, signed, local_gradient):
  return a2q_quantize(x, s, b, signed, local_gradient), (x, s, b)


def _bwd(signed, local_gradient, res, g):
  x, s, b = res
  in_range, d_s, d_b = surrogate_derivatives(x, s, b, signed)
  g_x = jnp.where(in_range, g, 0.0)
  if local_gradient:
    # E = 1/d sum_j (x_q - x)^2 over the elements sharing one (s, b): dE/dp = 2/d (x_q - x) dx_q/dp.
    xq = quantize_codes(x, s, round_bits(b), signed) * s
    d = x.size // max(s.size, 1)
    err = 2.0 * (xq - x) / d
    g_s, g_b = err * d_s, err * d_b
  else:
    g_s, g_b = g * d_s, g * d_b
  return g_x, _reduce_to(g_s, s.shape).astype(s.dtype), _reduce_to(g_b, b.shape).astype(b.dtype)


a2q_quantize.defvjp(_fwd, _bwd)


def memory_penalty(bits_and_dims, target_bits: float):
  """A2Q eq. 6: ``(sum_i dim_i * b_i / sum_i dim_i - target)^2`` over all feature quantizers.

  ``bits_and_dims`` is a list of ``(b, dim)``: continuous bits (any shape) and the number of
  elements each entry of b quantizes. Bits are clipped to [1, 8] (no pull outside the range).
  """
  check_target_bits(target_bits)
  total = sum(jnp.sum(jnp.clip(b, MIN_BITS, MAX_BITS)) * dim for b, dim in bits_and_dims)
  count = sum(b.size * dim for b, dim in bits_and_dims)
  return (total / count - target_bits) ** 2


def check_target_bits(target_bits: float) -> None:
  if not (MIN_BITS <= float(target_bits) <= MAX_BITS):
    raise ConfigError(f"target_bits={target_bits} must lie in [{MIN_BITS}, {MAX_BITS}] "
                      f"(every element takes at least {MIN_BITS} bit)")


def average_bits(bits_and_dims) -> jax.Array:
  """Element-weighted average of the rounded bitwidths actually used in the forward pass."""
  total = sum(jnp.sum(round_bits(b)) * dim for b, dim in bits_and_dims)
  count = sum(b.size * dim for b, dim in bits_and_dims)
  return total / count


def nns_select(x, steps, bits, signed: bool):
  """Nearest Neighbor Strategy: per-row (s, b) picked from m learned pairs.

  Args:
    x: ``[N, F]`` features.
    steps, bits: ``[m]`` learned pairs.
  Returns:
    ``(s [N, 1], b [N, 1], index [N])``; gradients flow to the chosen pairs (gather transpose).
  """
  if steps.ndim != 1 or bits.shape != steps.shape:
    raise InputError(f"steps and bits must be equal 1-D arrays, got {steps.shape} and {bits.shape}")
  fmax = jax.lax.stop_gradient(jnp.max(jnp.abs(x), axis=-1))  # [N]
  reach = jax.lax.stop_gradient(qmax_of(round_bits(bits), signed) * jnp.abs(steps))  # [m]
  idx = jnp.argmin(jnp.abs(fmax[:, None] - reach[None, :]), axis=-1)  # [N]
  return steps[idx][:, None], bits[idx][:, None], idx


def init_step_from_data(x, bits, signed: bool, axis: int = -1, eps: float = 1e-8):
  """A step size whose clip range covers each row's max |x|: ``max|x| / qmax``."""
  qmax = qmax_of(round_bits(jnp.asarray(bits, jnp.float32)), signed)
  m = jnp.max(jnp.abs(x), axis=axis, keepdims=True)
  return jnp.maximum(m / jnp.maximum(qmax, 1.0), eps)
