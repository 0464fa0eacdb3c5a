"""Spiking layers: a multi-step LIF / PLIF neuron over ``lax.scan`` (SpikingJelly semantics).

The neuron runs over a time-major input ``x [T, B, C]`` (``B`` is any batch: the rays of
SpikingNeRF) and keeps one membrane potential per ``[B, C]`` that flows from ``t = 0`` to
``t = T - 1``. Per step (SpikingJelly ``LIFNode`` with ``decay_input=True``, ``v_reset = 0``)::

  H[t] = V[t-1] + (X[t] - V[t-1]) / tau       # charge (leaky integration)
  S[t] = Heaviside(H[t] - v_th)              # fire
  V[t] = H[t] * (1 - sg(S[t]))               # hard reset to 0, reset detached (detach_reset)

The Heaviside's gradient is the sigmoid surrogate ``alpha * sig(alpha x) * (1 - sig(alpha x))``
(alpha = 4), through a ``custom_vjp``. PLIF (Fang et al., 2021) learns ``1/tau = sigmoid(w)``
per layer, with ``w`` initialised so that ``tau = tau0``.

Usage::

  lif = LIF(LIFConfig(tau=2.0))              # or LIFConfig(learn_tau=True) for PLIF
  spikes = lif(x)                            # [T, B, C] float 0/1
  n = spike_count(spikes, valid)             # spikes on valid (time, batch) entries only

:class:`SpikingLinear` is ``Linear (no bias) -> LIF``; a stack of them is the spiking colour
MLP of ``jaxsys.models.nerf.spiking_nerf``, whose spike counts feed ``jaxsys.nerf.energy``.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from jaxsys.core.errors import ShapeError, check_positive
from jaxsys.core import init

__all__ = [
    "LIF", "lif_scan", "LIFConfig", "spike", "spike_count", "SpikingLinear", "SURROGATE_ALPHA",
    "surrogate_grad",
]


@jax.custom_vjp
def spike(x):
  """Heaviside ``x >= 0`` forward; sigmoid surrogate (alpha = 4) backward."""
  return (x >= 0).astype(x.dtype)


SURROGATE_ALPHA = 4.0


def surrogate_grad(x, alpha: float = SURROGATE_ALPHA):
  """d spike / d x of the sigmoid surrogate: ``alpha * sig(alpha x) * (1 - sig(alpha x))``."""
  s = jax.nn.sigmoid(alpha * x)
  return alpha * s * (1 - s)


def _spike_fwd(x):
  return spike(x), x


def _spike_bwd(x, g):
  return (g * surrogate_grad(x),)


spike.defvjp(_spike_fwd, _spike_bwd)


@dataclasses.dataclass(frozen=True)
class LIFConfig:
  tau: float = 2.0          # membrane time constant (the PLIF initial value when learn_tau)
  v_threshold: float = 1.0
  learn_tau: bool = False   # PLIF: 1/tau = sigmoid(w), one w per layer

  def __post_init__(self):
    check_positive(self, "v_threshold")
    if not self.tau > 1.0:
      from jaxsys.core.errors import ConfigError
      raise ConfigError(f"tau={self.tau!r} must be > 1 (1/tau is a decay factor in (0, 1))")


def lif_scan(x, inv_tau, v_threshold: float = 1.0):
  """Multi-step LIF over the leading time axis: ``x [T, ...] -> spikes [T, ...]``.

  ``inv_tau`` is ``1/tau`` (a scalar, traced for PLIF). Membrane starts at 0 (reset state).
  """
  def step(v, xt):
    h = v + (xt - v) * inv_tau                       # charge, decay_input
    s = spike(h - v_threshold)                       # fire
    v = h * (1.0 - jax.lax.stop_gradient(s))         # hard reset to 0, detached reset
    return v, s

  _, spikes = jax.lax.scan(step, jnp.zeros(x.shape[1:], x.dtype), x)
  return spikes


class LIF(nnx.Module):
  """LIF (fixed tau) or PLIF (learned tau) neuron over time-major inputs.

  ``x [T, ...] -> spikes [T, ...]`` (0/1 in x's dtype); one membrane potential per trailing
  element. PLIF's parameter ``w`` is a scalar.

  Example::

    lif = LIF(LIFConfig(tau=2.0))
    s = lif(jnp.ones((4, 2, 8, 16)))          # [4, 2, 8, 16]
  """

  def __init__(self, cfg: LIFConfig = LIFConfig()):
    self.cfg = cfg
    if cfg.learn_tau:
      # sigmoid(w) = 1/tau0  =>  w = -log(tau0 - 1)
      self.w = nnx.Param(jnp.asarray(-math.log(cfg.tau - 1.0), jnp.float32))

  def inv_tau(self):
    return jax.nn.sigmoid(self.w[...]) if self.cfg.learn_tau else 1.0 / self.cfg.tau

  def __call__(self, x):
    if x.ndim < 2:
      raise ShapeError(f"x must be time-major [T, batch, ...], got shape {tuple(x.shape)}")
    return lif_scan(x, self.inv_tau(), self.cfg.v_threshold)


class SpikingLinear(nnx.Module):
  """``Linear(in, out, no bias) -> LIF``: real-valued (first layer) or spike inputs.

  ``x [T, ..., in] -> spikes [T, ..., out]``; ``linear.kernel [in, out]`` (logical ``("embed",
  "mlp")``) in ``param_dtype``.

  Example::

    layer = SpikingLinear(16, 32, rngs=nnx.Rngs(0))
    s = layer(jnp.ones((4, 8, 16)))           # [4, 8, 32]
  """

  def __init__(self, in_features: int, out_features: int, cfg: LIFConfig = LIFConfig(), *,
               dtype=None, param_dtype=jnp.float32, rngs: nnx.Rngs):
    self.linear = nnx.Linear(in_features, out_features, use_bias=False, dtype=dtype, **init.dense_defaults(),
                             param_dtype=param_dtype, rngs=rngs,
                             kernel_metadata={"logical_axes": ("embed", "mlp")})
    self.neuron = LIF(cfg)

  def __call__(self, x):
    return self.neuron(self.linear(x))


def spike_count(spikes, valid=None):
  """Total spikes of ``spikes [T, B, C]``, counting only ``valid [T, B]`` entries when given
  (padding of a packed ray batch is not computation the hardware would do)."""
  if valid is None:
    return jnp.sum(spikes)
  if valid.shape != spikes.shape[:2]:
    raise ShapeError(f"valid must have shape {spikes.shape[:2]} (spikes' [T, B]), "
                     f"got {tuple(valid.shape)}")
  return jnp.sum(spikes * valid[..., None].astype(spikes.dtype))
