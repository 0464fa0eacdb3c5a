"""PalQuant: parallel low-precision groups with a cyclic shuffle between stages.

A high-precision layer is replaced by G parallel low-precision groups (a grouped convolution,
``feature_group_count=G``, each group ``C -> C`` channels at ``w_bits`` / ``a_bits``). Between
layers the cyclic-shuffle module splits every group's channels into G chunks and sends chunk k
of group g to group ``(g + k) mod G``, so the groups exchange information. Quantizers are
LSQ-style learnable-interval quantizers (step s learned, gradient scale ``1/sqrt(n * Qp)``):
``x_q = clip(round(x / s), Qn, Qp) * s``.

``PalQuantNet`` is a small image classifier (scikit-learn's 8x8 digits): a float stem conv,
three PalQuant convs, global average pooling and a float classifier. G=1 is a plain quantized
network (the W4A4 / W2A2 baselines).

Usage::

  net = PalQuantNet(PalQuantConfig(groups=2, w_bits=2, a_bits=2), rngs=nnx.Rngs(0))
  result = train_digits(PalQuantConfig(groups=2, w_bits=2, a_bits=2), seed=0, epochs=30)
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxsys.core.optim import OptimizerConfig, check_nested
from jaxsys.core.errors import ConfigError, ShapeError
from jaxsys.core.step import make_train_step, run_steps
from jaxsys.core import init

__all__ = [
    "bitops", "cyclic_shuffle", "grouped_conv3x3", "load_digits_split", "lsq_quantize", "PalQuantConfig",
    "PalQuantConv", "PalQuantNet", "StepSize", "train_digits",
]


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def lsq_quantize(x, s, bits: int, signed: bool):
  """LSQ fake quantization with a learnable step ``s`` (scalar or broadcastable)."""
  qn, qp = _levels(bits, signed)
  return jnp.clip(jnp.round(x / s), qn, qp) * s


def _levels(bits, signed):
  return (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1) if signed else (0, 2 ** bits - 1)


def _lsq_fwd(x, s, bits, signed):
  return lsq_quantize(x, s, bits, signed), (x, s)


def _lsq_bwd(bits, signed, res, g):
  x, s = res
  qn, qp = _levels(bits, signed)
  u = x / s
  inside = (u >= qn) & (u <= qp)
  d_s = jnp.where(inside, jnp.round(u) - u, jnp.where(u < qn, qn, qp))
  scale = 1.0 / np.sqrt(max(x.size // max(s.size, 1), 1) * qp)
  g_s = g * d_s * scale
  g_s = g_s.reshape(-1, *s.shape).sum(0) if s.ndim else g_s.sum()
  return jnp.where(inside, g, 0.0), g_s.astype(s.dtype)


lsq_quantize.defvjp(_lsq_fwd, _lsq_bwd)


@dataclasses.dataclass(frozen=True)
class PalQuantConfig:
  groups: int = 2
  w_bits: int | None = 2      # None: float weights
  a_bits: int | None = 2      # None: float activations
  channels: int = 16          # per group
  num_classes: int = 10

  def __post_init__(self):
    if self.groups <= 0:
      raise ConfigError(f"groups={self.groups} must be positive")
    if self.channels % self.groups:
      raise ConfigError(f"channels={self.channels} must be divisible by groups={self.groups} "
                        "(the cyclic shuffle splits a group into G chunks)")
    for name in ("w_bits", "a_bits"):
      b = getattr(self, name)
      if b is not None and not 1 <= b <= 8:
        raise ConfigError(f"{name}={b} must lie in [1, 8]")
    if self.w_bits == 1:
      raise ConfigError("w_bits=1 leaves signed LSQ weights one level; use >= 2")


def cyclic_shuffle(x, groups: int):
  """Chunk k of group g moves to group (g + k) mod G; ``x [..., G*C]``."""
  if groups == 1:
    return x
  c = x.shape[-1] // groups
  y = x.reshape(*x.shape[:-1], groups, groups, c // groups)  # [..., group, chunk, c/G]
  chunks = [jnp.roll(y[..., :, k, :], shift=k, axis=-2) for k in range(groups)]
  return jnp.stack(chunks, axis=-2).reshape(x.shape)


def grouped_conv3x3(x, w, groups: int):
  """SAME 3x3 grouped convolution as patches @ kernel (XLA:CPU's conv is slow at 8x8).

  ``x [B, H, W, G*C]``, ``w [3, 3, C, G*Cout]`` (HWIO; output group i reads input group i).
  """
  b, h, wd, gc = x.shape
  c, cout = gc // groups, w.shape[-1] // groups
  xp = jnp.pad(x, ((0, 0), (1, 1), (1, 1), (0, 0)))
  patches = jnp.stack([xp[:, i:i + h, j:j + wd] for i in range(3) for j in range(3)], axis=3)
  patches = patches.reshape(b, h, wd, 9, groups, c)                 # [B, H, W, tap, group, C]
  k = w.reshape(9, c, groups, cout)                                 # [tap, C, group, Cout]
  y = jnp.einsum("bhwtgc,tcgo->bhwgo", patches, k)
  return y.reshape(b, h, wd, groups * cout)


class StepSize(nnx.Param):
  pass


class PalQuantConv(nnx.Module):
  """G parallel ``C -> C`` 3x3 convolutions with LSQ weight (per group) and activation steps."""

  def __init__(self, cfg: PalQuantConfig, *, rngs: nnx.Rngs):
    g, c = cfg.groups, cfg.channels
    self.cfg = cfg
    # HWIO kernel of a grouped conv: output channels [i*C, (i+1)*C) read input group i.
    self.kernel = nnx.Param(init.he_normal()(rngs.params(), (3, 3, c, g * c), jnp.float32))
    self.bias = nnx.Param(init.zeros(None, (g * c,), jnp.float32))
    w = self.kernel[...]
    if cfg.w_bits:
      qp = _levels(cfg.w_bits, True)[1]
      per_group = jnp.abs(w).reshape(-1, g, c).mean(axis=(0, 2))
      self.w_step = StepSize(jnp.maximum(2 * per_group / np.sqrt(qp), 1e-4))   # [G] (LSQ init)
    self.a_step = StepSize(jnp.ones((), jnp.float32))
    self.calibrating = False

  def __call__(self, x):
    cfg = self.cfg
    if cfg.a_bits:
      if self.calibrating:
        qp = _levels(cfg.a_bits, False)[1]
        self.a_step[...] = jnp.maximum(2 * jnp.abs(x).mean() / np.sqrt(qp), 1e-4)
      x = lsq_quantize(x, jnp.abs(self.a_step[...]) + 1e-8, cfg.a_bits, False)
    w = self.kernel[...]
    if cfg.w_bits:
      c = cfg.channels
      step = jnp.repeat(jnp.abs(self.w_step[...]) + 1e-8, c)                      # [G*C]
      w = lsq_quantize(w, step, cfg.w_bits, True)
    return grouped_conv3x3(x, w, cfg.groups) + self.bias[...]                     # [B, H, W, G*C]


class PalQuantNet(nnx.Module):
  """stem (float) -> 3 x [PalQuantConv, ReLU, cyclic shuffle] -> pool -> linear (float)."""

  def __init__(self, cfg: PalQuantConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    self.stem = nnx.Param(init.he_normal()(rngs.params(), (3, 3, 1, cfg.channels), jnp.float32))
    self.blocks = nnx.List([PalQuantConv(cfg, rngs=rngs) for _ in range(3)])
    self.head = nnx.Linear(cfg.groups * cfg.channels, cfg.num_classes, rngs=rngs, **init.dense_defaults())

  def __call__(self, x):
    if x.ndim != 4 or x.shape[-1] != 1:
      raise ShapeError(f"x must be [batch, H, W, 1], got {x.shape}")
    h = jax.nn.relu(grouped_conv3x3(x, self.stem[...], 1))
    h = jnp.tile(h, (1, 1, 1, self.cfg.groups))            # every group starts from the stem
    for i, blk in enumerate(self.blocks):
      h = cyclic_shuffle(jax.nn.relu(blk(h)), self.cfg.groups)
      if i == 1:
        h = nnx.max_pool(h, (2, 2), (2, 2))
    return self.head(h.mean(axis=(1, 2)))

  def calibrate(self, x):
    for b in self.blocks:
      b.calibrating = True
    try:
      self(x)
    finally:
      for b in self.blocks:
        b.calibrating = False


def load_digits_split(seed: int = 0, test_fraction: float = 0.2):
  """scikit-learn digits as ``[n, 8, 8, 1]`` float32 in [0, 1], fixed stratified split."""
  from sklearn.datasets import load_digits
  from sklearn.model_selection import train_test_split
  d = load_digits()
  x = (d.images / 16.0).astype(np.float32)[..., None]
  return train_test_split(x, d.target.astype(np.int32), test_size=test_fraction,
                          random_state=seed, stratify=d.target)


def train_digits(cfg: PalQuantConfig, *, seed: int = 0, epochs: int = 30, batch: int = 64,
                 lr: float = 3e-3, optimizer: OptimizerConfig | None = None, data=None) -> dict:
  """Trains ``PalQuantNet`` on digits; returns test accuracy and bit-op cost per image.

  The optimizer is Adam at ``lr`` cosine-decayed to 0 over the run's steps, or ``optimizer`` (a
  ``jaxsys.core.optim.OptimizerConfig``; given, ``lr`` stays at its default).
  """
  check_nested(dict(optimizer=optimizer, lr=lr), "lr", defaults=train_digits)
  xtr, xte, ytr, yte = data if data is not None else load_digits_split(0)
  tx = (optimizer or OptimizerConfig("adam", lr, "cosine", decay_steps=epochs * (len(xtr) // batch))).build()
  net = PalQuantNet(cfg, rngs=nnx.Rngs(seed))
  nnx.jit(lambda m, x: m.calibrate(x))(net, jnp.asarray(xtr[:256]))
  graphdef, params, rest = nnx.split(net, nnx.Param, ...)
  opt = tx.init(params)

  def loss_fn(model, xb, yb):  # xb [batch, 8, 8, 1], yb int[batch]
    return optax.softmax_cross_entropy_with_integer_labels(model(xb), yb).mean()

  step = make_train_step(loss_fn, tx, graphdef=graphdef)

  @jax.jit
  def predict(p, xb):
    return jnp.argmax(nnx.merge(graphdef, p, rest)(xb), -1)

  rng = np.random.default_rng(seed)
  per_epoch = len(xtr) // batch
  perm = None

  def draw(s, params, rest):  # s = 1 ..: a new permutation at each epoch's first step
    nonlocal perm
    i = (s - 1) % per_epoch
    if i == 0:
      perm = rng.permutation(len(xtr))
    idx = perm[i * batch:(i + 1) * batch]
    return jnp.asarray(xtr[idx]), jnp.asarray(ytr[idx])

  run = run_steps(step, params, opt, rest, draw, steps=epochs * per_epoch, carry_rest=False,
                  record=lambda s: s == epochs * per_epoch)
  acc = float(np.mean(np.asarray(predict(run.params, jnp.asarray(xte))) == yte))
  return {"test_acc": acc, "final_loss": run.loss, "bitops": bitops(cfg)}


def bitops(cfg: PalQuantConfig, hw: int = 8) -> float:
  """Multiply bit-operations of the quantized convs per image: MACs * w_bits * a_bits."""
  c, g = cfg.channels, cfg.groups
  sizes = [hw * hw, hw * hw, (hw // 2) ** 2]
  macs = sum(s * 9 * c * c * g for s in sizes)
  return float(macs * (cfg.w_bits or 32) * (cfg.a_bits or 32))
