"""Voxel grids (DVGO): trilinear interpolation, density activation, the coarse occupancy mask.

A grid is ``[X, Y, Z, C]`` values on the ``X x Y x Z`` lattice spanning the box
``bounds = ((x0, y0, z0), (x1, y1, z1))`` corner to corner (voxel ``(0, 0, 0)`` sits at the
lower corner, ``(X-1, Y-1, Z-1)`` at the upper one). Points outside the box read zero.

Density is raw (pre-activation), as in DVGO: for a step of ``interval`` voxels,
``alpha = 1 - exp(-softplus(density + shift) * interval)``, with
``shift = log(1 / (1 - alpha_init) - 1)`` so a zero grid starts at ``alpha_init`` per voxel.

Usage::

  box = Box((-1, -1, -1), (1, 1, 1))
  grid = VoxelGrid(box, (32, 32, 32), channels=12, rngs=rngs)
  feat = grid(points)                          # [..., 3] -> [..., 12]
  mask = occupancy_mask(alpha_grid, thres=1e-3) # bool [X, Y, Z], dilated by a 3^3 max-pool
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxsys.core.errors import ConfigError, ShapeError
from jaxsys.core import init

__all__ = [
    "Box", "check_points", "density_shift", "density_to_alpha", "lattice_points", "nearest",
    "occupancy_mask", "trilinear", "VoxelGrid",
]


@dataclasses.dataclass(frozen=True)
class Box:
  """An axis-aligned box ``lo < hi`` in world coordinates."""
  lo: tuple[float, float, float]
  hi: tuple[float, float, float]

  def __post_init__(self):
    lo, hi = tuple(float(v) for v in self.lo), tuple(float(v) for v in self.hi)
    if len(lo) != 3 or len(hi) != 3:
      raise ConfigError(f"Box lo={self.lo} and hi={self.hi} must have 3 coordinates each")
    if not all(a < b for a, b in zip(lo, hi)):
      raise ConfigError(f"Box lo={lo} must be < hi={hi} on every axis")
    object.__setattr__(self, "lo", lo)
    object.__setattr__(self, "hi", hi)

  def voxel_size(self, resolution) -> np.ndarray:
    """World size of one voxel step per axis ``[3]`` (numpy) for a ``resolution`` lattice."""
    return (np.asarray(self.hi) - np.asarray(self.lo)) / (np.asarray(resolution) - 1)


def check_points(points, name: str = "points"):
  if points.ndim < 1 or points.shape[-1] != 3:
    raise ShapeError(f"{name} must be [..., 3] world coordinates, got shape {tuple(points.shape)}")


def trilinear(grid, points, box: Box):
  """Trilinear interpolation of ``grid [X, Y, Z, C]`` at ``points [..., 3]`` -> ``[..., C]``."""
  if grid.ndim != 4:
    raise ShapeError(f"grid must be [X, Y, Z, C], got shape {tuple(grid.shape)}")
  check_points(points)
  res = jnp.asarray(grid.shape[:3], jnp.float32)
  u = (points - jnp.asarray(box.lo)) / (jnp.asarray(box.hi) - jnp.asarray(box.lo)) * (res - 1)
  inside = jnp.all((u >= 0) & (u <= res - 1), axis=-1)                 # [...]
  u = jnp.clip(u, 0, res - 1)
  i0 = jnp.clip(jnp.floor(u), 0, res - 2).astype(jnp.int32)            # [..., 3]
  f = u - i0                                                            # [..., 3] in [0, 1]
  out = 0
  for dx in (0, 1):
    for dy in (0, 1):
      for dz in (0, 1):
        w = ((f[..., 0] if dx else 1 - f[..., 0]) * (f[..., 1] if dy else 1 - f[..., 1])
             * (f[..., 2] if dz else 1 - f[..., 2]))
        out = out + w[..., None] * grid[i0[..., 0] + dx, i0[..., 1] + dy, i0[..., 2] + dz]
  return jnp.where(inside[..., None], out, 0)


def density_shift(alpha_init: float) -> float:
  """DVGO's bias: a zero density gives ``alpha_init`` per voxel step."""
  if not 0 < alpha_init < 1:
    raise ConfigError(f"alpha_init={alpha_init!r} must be in (0, 1)")
  return math.log(1 / (1 - alpha_init) - 1)


def density_to_alpha(density, shift: float, interval: float):
  """``1 - exp(-softplus(density + shift) * interval)`` (DVGO Eq. 3 with post-activation)."""
  return 1 - jnp.exp(-jax.nn.softplus(density + shift) * interval)


def occupancy_mask(alpha, thres: float):
  """Occupied voxels of an ``alpha [X, Y, Z]`` grid: a 3^3 max-pool (dilation) then ``> thres``
  (DVGO's coarse mask cache: a sample is kept if a neighbouring voxel may be occupied)."""
  if alpha.ndim != 3:
    raise ShapeError(f"alpha must be [X, Y, Z], got shape {tuple(alpha.shape)}")
  pooled = jax.lax.reduce_window(alpha, -jnp.inf, jax.lax.max, (3, 3, 3), (1, 1, 1), "SAME")
  return pooled > thres


def nearest(mask, points, box: Box):
  """Nearest-voxel lookup of a bool ``mask [X, Y, Z]`` at ``points [..., 3]`` (False outside)."""
  check_points(points)
  res = jnp.asarray(mask.shape, jnp.float32)
  u = (points - jnp.asarray(box.lo)) / (jnp.asarray(box.hi) - jnp.asarray(box.lo)) * (res - 1)
  inside = jnp.all((u >= -0.5) & (u <= res - 0.5), axis=-1)
  i = jnp.clip(jnp.round(u), 0, res - 1).astype(jnp.int32)
  return inside & mask[i[..., 0], i[..., 1], i[..., 2]]


def lattice_points(box: Box, resolution) -> jax.Array:
  """World coordinates of every lattice point ``[X, Y, Z, 3]``."""
  axes = [jnp.linspace(lo, hi, n) for lo, hi, n in zip(box.lo, box.hi, resolution)]
  return jnp.stack(jnp.meshgrid(*axes, indexing="ij"), -1)


class VoxelGrid(nnx.Module):
  """A learnable dense grid ``[X, Y, Z, channels]`` read by trilinear interpolation."""

  def __init__(self, box: Box, resolution: tuple[int, int, int], channels: int, *,
               init_std: float = 0.0, rngs: nnx.Rngs | None = None):
    if len(resolution) != 3 or min(resolution) < 2:
      raise ConfigError(f"resolution={resolution} must be 3 sizes >= 2")
    if channels < 1:
      raise ConfigError(f"channels={channels} must be >= 1")
    self.box, self.resolution, self.channels = box, tuple(resolution), channels
    shape = tuple(resolution) + (channels,)
    if init_std and rngs is not None:
      value = init.normal(init_std)(rngs.params(), shape)
    else:
      value = init.zeros(None, shape)
    self.grid = nnx.Param(value)

  def __call__(self, points):
    return trilinear(self.grid[...], points, self.box)
