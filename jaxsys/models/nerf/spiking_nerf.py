"""SpikingNeRF (DVGO-based): voxel grids for density and features, a spiking colour MLP whose
time steps are the samples along each ray, with TP or TCP packing of the masked samples.

Pipeline of one ray batch (``render``):

1. samples every ``stepsize`` voxels from each ray's box entry (``jaxsys.nerf.rays``);
2. ``alpha = density_to_alpha(density_grid(x))``, dropped where the coarse occupancy mask is
   off; then alpha <= ``fast_color_thres`` and weight <= ``fast_color_thres`` are dropped
   (SpikingNeRF's masking; the survivors are ``valid [R, S]``);
3. the colour input per sample is ``k0(x)`` (12 channels) + the view encoding (27): 39 dims;
   the survivors are packed time-major ``[T, R', 39]`` by TP or TCP (``jaxsys.nerf.packing``),
   run through the colour MLP (membrane state flows near -> far), sigmoid per step;
4. compositing ``sum_s w_s c_s + T_last * bg`` (``jaxsys.nerf.render``).

The colour MLP (``ColorMLP``) is ``Linear(no bias) -> LIF``, ``[Linear -> LIF] x (depth - 2)``,
``Linear -> 3``; ``neuron="relu"`` is the same network with ReLU (and biases): the ANN baseline.
Its spike counts (valid entries only) feed ``jaxsys.nerf.energy``.

The coarse stage (``CoarseGrids``) is DVGO's: dense density + rgb grids, no MLP; its occupancy
mask (``coarse_mask``) prunes the fine stage's samples.

Usage::

  cfg = SpikingNeRFConfig(resolution=48, neuron="lif")
  model = SpikingNeRF(cfg, mask=coarse_mask(coarse, cfg), rngs=nnx.Rngs(0))
  valid = sample_mask(model, rays_o, rays_d)                 # phase 1 (jitted)
  T, Rp = packing.plan(np.asarray(valid), "tcp")             # host: buckets
  out = render(model, rays_o, rays_d, mode="tcp", max_len=T, max_rays=Rp)
  out.rgb, out.spikes, out.num_points
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxsys.core.optim import OptimizerConfig, check_nested
from jaxsys.core.errors import ConfigError, InputError, check_one_of, check_positive, check_range
from jaxsys.nerf import packing as P
from jaxsys.nerf.grids import (Box, VoxelGrid, density_shift, density_to_alpha, lattice_points,
                               nearest, occupancy_mask)
from jaxsys.nerf.rays import check_rays, num_samples_for, sample_rays, view_encoding
from jaxsys.nerf.render import alpha_weights, composite
from jaxsys.nn.spiking import LIFConfig, SpikingLinear, spike_count
from jaxsys.core import init

__all__ = [
    "coarse_mask", "CoarseGrids", "ColorMLP", "fit", "init_from_coarse", "lattice_alpha", "make_optimizer",
    "MODES", "NEURONS", "OccupancyMask", "render", "render_views", "renderer", "RenderOut", "sample_mask",
    "SpikingNeRF", "SpikingNeRFConfig", "ViewStats",
]

NEURONS = ("lif", "plif", "relu")
MODES = ("tp", "tcp", "dense")


@dataclasses.dataclass(frozen=True)
class SpikingNeRFConfig:
  box: Box = Box((-1.0, -1.0, -1.0), (1.0, 1.0, 1.0))
  resolution: int = 48          # fine grids: resolution^3 lattice
  k0_dim: int = 12
  depth: int = 3                # colour MLP layers (depth - 1 hidden spiking layers)
  width: int = 128
  viewbase_pe: int = 4          # view encoding frequencies: 3 + 6 * 4 = 27 dims
  neuron: str = "lif"           # "lif" | "plif" (learned tau) | "relu" (the ANN baseline)
  tau: float = 2.0
  stepsize: float = 0.5         # in voxels
  alpha_init: float = 1e-2
  fast_color_thres: float = 1e-4
  background: float = 1.0       # white

  def __post_init__(self):
    check_positive(self, "resolution", "k0_dim", "width", "viewbase_pe", integer=True)
    check_positive(self, "stepsize")
    check_one_of("neuron", self.neuron, NEURONS)
    if self.depth < 2:
      raise ConfigError(f"depth={self.depth} must be >= 2")
    check_range("alpha_init", self.alpha_init, 0, 1, lo_open=True, hi_open=True)
    check_range("fast_color_thres", self.fast_color_thres, 0, 1, hi_open=True)

  @property
  def in_dim(self) -> int:
    return self.k0_dim + 3 + 6 * self.viewbase_pe

  @property
  def dims(self) -> tuple[int, ...]:
    """Layer widths of the colour MLP, input first: ``(39, 128, ..., 3)``."""
    return (self.in_dim,) + (self.width,) * (self.depth - 1) + (3,)

  @property
  def spiking(self) -> bool:
    return self.neuron != "relu"

  @property
  def step(self) -> float:
    """World distance between samples: ``stepsize`` voxels of the fine grid."""
    return float(self.stepsize * np.min(np.asarray(self.box.voxel_size((self.resolution,) * 3))))

  @property
  def num_samples(self) -> int:
    return num_samples_for(self.box, self.step)


class ColorMLP(nnx.Module):
  """The colour network over time-major ``[T, R, in_dim]``: returns ``(logits [T, R, 3],
  spikes)``, ``spikes`` the per-LIF-layer spike totals on ``valid`` entries (empty for ReLU)."""

  def __init__(self, cfg: SpikingNeRFConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    d = cfg.dims
    if cfg.spiking:
      lif = LIFConfig(tau=cfg.tau, learn_tau=cfg.neuron == "plif")
      self.hidden = nnx.List([SpikingLinear(a, b, lif, rngs=rngs) for a, b in zip(d[:-2], d[1:-1])])
      self.out = nnx.Linear(d[-2], d[-1], use_bias=False, rngs=rngs, **init.dense_defaults())
    else:
      self.hidden = nnx.List([nnx.Linear(a, b, rngs=rngs, **init.dense_defaults()) for a, b in zip(d[:-2], d[1:-1])])
      self.out = nnx.Linear(d[-2], d[-1], rngs=rngs, **init.dense_defaults())

  def __call__(self, x, valid=None):
    spikes = []
    for layer in self.hidden:
      if self.cfg.spiking:
        x = layer(x)                                   # [T, R, width] 0/1, scan over T
        spikes.append(spike_count(x, valid))
      else:
        x = jax.nn.relu(layer(x))
    return self.out(x), tuple(spikes)


class OccupancyMask(nnx.Variable):
  """The coarse stage's occupancy grid (bool ``[X, Y, Z]``): state, not a parameter."""


class SpikingNeRF(nnx.Module):
  """Fine stage: density + ``k0`` feature grids and the colour MLP (see the module docstring)."""

  def __init__(self, cfg: SpikingNeRFConfig, *, mask=None, rngs: nnx.Rngs):
    self.cfg = cfg
    res = (cfg.resolution,) * 3
    self.density = VoxelGrid(cfg.box, res, 1)
    self.k0 = VoxelGrid(cfg.box, res, cfg.k0_dim)
    self.mlp = ColorMLP(cfg, rngs=rngs)
    self.mask = OccupancyMask(jnp.ones(res, bool) if mask is None else jnp.asarray(mask, bool))
    self.shift = density_shift(cfg.alpha_init)


class CoarseGrids(nnx.Module):
  """DVGO's coarse stage: a density grid and a direct rgb grid (sigmoid), no MLP."""

  def __init__(self, cfg: SpikingNeRFConfig, *, resolution: int = 32, alpha_init: float = 1e-6,
               fast_color_thres: float = 1e-7):
    self.cfg = dataclasses.replace(cfg, resolution=resolution, alpha_init=alpha_init,
                                   fast_color_thres=fast_color_thres)
    res = (resolution,) * 3
    self.density = VoxelGrid(cfg.box, res, 1)
    self.rgb = VoxelGrid(cfg.box, res, 3)
    self.shift = density_shift(alpha_init)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RenderOut:
  rgb: jax.Array             # [R, 3]
  valid: jax.Array           # [R, S] samples that reached the colour network
  weights: jax.Array         # [R, S]
  spikes: tuple              # per LIF layer, total spikes on valid entries
  num_points: jax.Array      # valid samples (colour-network inputs)
  pack_valid: jax.Array      # [T, R'] the packed tensor's valid entries


def _alphas(model, rays_o, rays_d):
  """Samples, masked alphas, weights, T_last and the survivors ``valid [R, S]``."""
  cfg = model.cfg
  s = sample_rays(rays_o, rays_d, cfg.box, step=cfg.step, num_samples=cfg.num_samples)
  alpha = density_to_alpha(model.density(s.points)[..., 0], model.shift, cfg.stepsize)
  keep = s.valid
  if isinstance(model, SpikingNeRF):
    keep = keep & nearest(model.mask[...], s.points, cfg.box)
  thres = cfg.fast_color_thres
  keep = keep & (alpha > thres)
  alpha = jnp.where(keep, alpha, 0.0)
  weights, t_last = alpha_weights(alpha)                                # [R, S], [R]
  keep = keep & (weights > thres)
  return s, jnp.where(keep, weights, 0.0), t_last, keep


def sample_mask(model: SpikingNeRF, rays_o, rays_d):
  """Phase 1: ``valid [R, S]``, the samples that reach the colour network (for bucketing)."""
  check_rays(rays_o, rays_d)
  return jax.lax.stop_gradient(_alphas(model, rays_o, rays_d)[3])


def render(model, rays_o, rays_d, *, mode: str = "tcp", max_len: int | None = None,
           max_rays: int | None = None) -> RenderOut:
  """Renders ``[R]`` rays (``rays_d`` unit; the view direction is ``rays_d``).

  ``mode``: "tcp" / "tp" pack the survivors into ``[max_len, max_rays]`` (from
  ``packing.plan``); "dense" runs the colour network on all ``S`` steps of every ray
  (TP without cropping). ``CoarseGrids`` ignore the mode (no network).
  """
  check_rays(rays_o, rays_d)
  check_one_of("mode", mode, MODES)
  cfg = model.cfg
  s, weights, t_last, valid = _alphas(model, rays_o, rays_d)
  R, S = valid.shape
  if isinstance(model, CoarseGrids):
    rgb = jax.nn.sigmoid(model.rgb(s.points))
    out = composite(weights, rgb, t_last, cfg.background)
    return RenderOut(out, valid, weights, (), jnp.sum(valid), valid.T)
  feat = jnp.concatenate([model.k0(s.points), jnp.broadcast_to(
      view_encoding(rays_d, cfg.viewbase_pe)[:, None, :], (R, S, 3 + 6 * cfg.viewbase_pe))], -1)
  if mode == "dense":
    index = P.PackIndex(step=jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32)[:, None], (S, R)),
                        ray=jnp.arange(R, dtype=jnp.int32), valid=valid.T)
  else:
    if max_len is None:
      raise ConfigError(f"mode={mode!r} needs max_len (and max_rays for tcp) from packing.plan")
    index = P.pack(valid, mode, max_len=max_len, max_rays=max_rays)
  x = P.gather(feat, index)                                             # [T, R', 39]
  logits, spikes = model.mlp(x, index.valid)                            # [T, R', 3]
  rgb = P.scatter(jax.nn.sigmoid(logits), index, R, S)                  # [R, S, 3]
  out = composite(weights, rgb, t_last, cfg.background)
  return RenderOut(out, valid, weights, spikes, jnp.sum(index.valid), index.valid)


def coarse_mask(coarse: CoarseGrids, thres: float = 1e-3):
  """DVGO's mask cache: coarse alpha on its lattice, 3^3 max-pool, ``> thres``."""
  alpha = density_to_alpha(coarse.density.grid[...][..., 0], coarse.shift, 1.0)
  return occupancy_mask(alpha, thres)


def init_from_coarse(model: SpikingNeRF, coarse: CoarseGrids) -> None:
  """Starts the fine density grid from the coarse one (same world-space density).

  ``softplus(raw + shift)`` is density per voxel of its own grid, so the fine grid holds
  ``softplus^-1(softplus(raw_c + shift_c) * voxel_f / voxel_c) - shift_f``. (A shortcut of this
  library's schedule: DVGO starts the fine density at zero; here the fine stage's masking prunes
  from the first step, which keeps the colour network's work small on a CPU.)
  """
  pts = lattice_points(model.cfg.box, (model.cfg.resolution,) * 3)
  raw_c = coarse.density(pts)[..., 0]
  ratio = float(np.min(model.cfg.box.voxel_size((model.cfg.resolution,) * 3))
                / np.min(coarse.cfg.box.voxel_size((coarse.cfg.resolution,) * 3)))
  sigma = jnp.maximum(jax.nn.softplus(raw_c + coarse.shift) * ratio, 1e-30)
  raw_f = jnp.log(jnp.expm1(sigma)) - model.shift                      # softplus^-1
  model.density.grid[...] = raw_f[..., None]


def lattice_alpha(model, resolution: int = 32):
  """Alpha per voxel of a model's density on a ``resolution^3`` lattice (for inspection)."""
  pts = lattice_points(model.cfg.box, (resolution,) * 3)
  return density_to_alpha(model.density(pts)[..., 0], model.shift, 1.0)


# ----------------------------------------------------------------------------- training, rendering

def make_optimizer(steps: int, *, lr_grid: float = 0.1, lr_mlp: float = 1e-3, decay: float = 0.1,
                   grid_optimizer: OptimizerConfig | None = None, mlp_optimizer: OptimizerConfig | None = None):
  """DVGO's optimizer: Adam, ``lr_grid`` for voxel grids and ``lr_mlp`` for the colour MLP,
  each decayed exponentially to ``decay`` x over ``steps``.

  ``grid_optimizer`` / ``mlp_optimizer`` (``jaxsys.core.optim.OptimizerConfig``) replace one
  group's Adam; given, that group's ``lr_grid`` / ``lr_mlp`` stays at its default, and so does
  ``decay`` when both are given (ConfigError otherwise).
  """
  import optax

  args = dict(lr_grid=lr_grid, lr_mlp=lr_mlp, decay=decay, grid_optimizer=grid_optimizer,
              mlp_optimizer=mlp_optimizer)
  # decay is shared: it still shapes the group whose optimizer is not given.
  both = ("decay",) if grid_optimizer is not None and mlp_optimizer is not None else ()
  check_nested(args, "lr_grid", *both, field="grid_optimizer", defaults=make_optimizer)
  check_nested(args, "lr_mlp", field="mlp_optimizer", defaults=make_optimizer)

  def labels(params):
    return jax.tree_util.tree_map_with_path(
        lambda path, _: "mlp" if any(getattr(k, "key", None) == "mlp" for k in path) else "grid",
        params)

  def adam(lr, eps=1e-8):
    return OptimizerConfig("adam", lr, "exponential", decay_steps=max(steps, 1), min_lr_ratio=decay, b2=0.99,
                           eps=eps)

  # betas (0.9, 0.99) as DVGO; a tiny eps for the grids: at alpha_init = 1e-6 the density
  # gradients are ~1e-9 and Adam's default eps (1e-8) would stall the first steps.
  grid = grid_optimizer or adam(lr_grid, eps=1e-15)
  mlp = mlp_optimizer or adam(lr_mlp)
  return optax.multi_transform({"grid": grid.build(), "mlp": mlp.build()}, labels)


def _loss(model, rays_o, rays_d, target, mode, max_len, max_rays):
  out = render(model, rays_o, rays_d, mode=mode, max_len=max_len, max_rays=max_rays)
  return jnp.mean((out.rgb - target) ** 2)


def _flat(views):
  return (np.asarray(views.rays_o, np.float32).reshape(-1, 3),
          np.asarray(views.rays_d, np.float32).reshape(-1, 3),
          np.asarray(views.images, np.float32).reshape(-1, 3))


def _packs(model) -> bool:
  return isinstance(model, SpikingNeRF)


def fit(model, views, *, steps: int, batch_rays: int = 1024, mode: str = "tcp", seed: int = 0,
        lr_grid: float = 0.1, lr_mlp: float = 1e-3, grid_optimizer: OptimizerConfig | None = None,
        mlp_optimizer: OptimizerConfig | None = None, log_every: int = 0) -> list[float]:
  """Trains ``model`` (``SpikingNeRF`` or ``CoarseGrids``) on random ray batches of ``views``
  with MSE (photometric loss); returns the loss per step. Each step's bucket comes from a
  jitted masking pass (``sample_mask``) then ``packing.plan``; the jitted step is compiled
  once per bucket (``jaxsys.train.make_train_step``). The optimizer is :func:`make_optimizer`'s
  (``grid_optimizer`` / ``mlp_optimizer``: a group's ``OptimizerConfig`` instead of its Adam)."""
  from jaxsys.train import make_train_step, run_steps
  check_one_of("mode", mode, MODES)
  if steps < 1 or batch_rays < 1:
    raise InputError(f"steps={steps} and batch_rays={batch_rays} must be >= 1")
  rays_o, rays_d, target = _flat(views)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  tx = make_optimizer(steps, lr_grid=lr_grid, lr_mlp=lr_mlp, grid_optimizer=grid_optimizer,
                      mlp_optimizer=mlp_optimizer)
  opt_state = tx.init(params)
  step = make_train_step(_loss, tx, graphdef=graphdef, static_argnums=(3, 4, 5))
  mask_fn = jax.jit(lambda p, r, o, d: sample_mask(nnx.merge(graphdef, p, r), o, d))
  rng = np.random.default_rng(seed)

  def batch(s, params, rest):  # random rays, packed by a plan of the current occupancy mask
    idx = rng.integers(0, rays_o.shape[0], batch_rays)
    o, d, t = rays_o[idx], rays_d[idx], target[idx]
    max_len = max_rays = None
    if _packs(model) and mode != "dense":
      max_len, max_rays = P.plan(np.asarray(mask_fn(params, rest, o, d)), mode)
    return o, d, t, mode, max_len, max_rays

  run = run_steps(step, params, opt_state, rest, batch, steps=steps,
                  record=lambda s: bool(log_every) and ((s - 1) % log_every == 0 or s == steps))
  params, rest = run.params, run.rest
  losses = [h["loss"] for h in run.history]
  nnx.update(model, params, rest)
  return losses


@dataclasses.dataclass
class ViewStats:
  """What rendering a set of views took: per-image packed shapes and valid-entry density,
  and totals over all images of colour-network points and spikes per LIF layer."""
  images: np.ndarray                      # [N, H, W, 3]
  num_points: int = 0
  spikes: list = dataclasses.field(default_factory=list)
  time_len: list = dataclasses.field(default_factory=list)
  num_rays: list = dataclasses.field(default_factory=list)
  density: list = dataclasses.field(default_factory=list)
  exact_len: list = dataclasses.field(default_factory=list)   # time steps before bucketing


def renderer(model, mode: str):
  """``(mask_fn, render_fn)`` jitted over ``(state, rays_o, rays_d)``; ``render_fn`` takes the
  bucket ``max_len, max_rays`` as static arguments."""
  graphdef, state = nnx.split(model)
  mask_fn = jax.jit(lambda st, o, d: sample_mask(nnx.merge(graphdef, st), o, d))
  render_fn = jax.jit(lambda st, o, d, max_len, max_rays: render(
      nnx.merge(graphdef, st), o, d, mode=mode, max_len=max_len, max_rays=max_rays),
      static_argnums=(3, 4))
  return state, mask_fn, render_fn


def render_views(model, views, *, mode: str = "tcp") -> ViewStats:
  """Renders every view (one image per call) and collects :class:`ViewStats`."""
  state, mask_fn, render_fn = renderer(model, mode)
  n, h, w, _ = views.images.shape
  stats = ViewStats(images=np.zeros((n, h, w, 3), np.float32))
  for i in range(n):
    o = jnp.asarray(views.rays_o[i].reshape(-1, 3))
    d = jnp.asarray(views.rays_d[i].reshape(-1, 3))
    max_len = max_rays = None
    if _packs(model) and mode != "dense":
      valid = np.asarray(mask_fn(state, o, d))
      max_len, max_rays = P.plan(valid, mode)
      stats.exact_len.append(P.pack_sizes(valid, mode)[0])
    out = render_fn(state, o, d, max_len, max_rays)
    stats.images[i] = np.asarray(out.rgb).reshape(h, w, 3)
    stats.num_points += int(out.num_points)
    sp = [float(s) for s in out.spikes]
    stats.spikes = sp if not stats.spikes else [a + b for a, b in zip(stats.spikes, sp)]
    pv = np.asarray(out.pack_valid)
    stats.time_len.append(pv.shape[0])
    stats.num_rays.append(pv.shape[1])
    stats.density.append(float(pv.mean()))
  return stats
