"""Rays: pinhole camera rays, ray-box intersection, fixed-step sampling inside the box.

Sampling follows DVGO: each ray enters the scene box at ``t_near`` and takes samples every
``step`` world units from there (``step = stepsize * voxel size``), so sample index ``s`` -- the
spiking network's time step -- runs near -> far. The sample grid has a static ``num_samples``
(enough for the box's diagonal); samples past the exit ``t_far`` are marked not valid.

Usage::

  o, d = camera_rays(c2w, height=48, width=48, focal=60.0)    # [H, W, 3] each
  s = sample_rays(o.reshape(-1, 3), d.reshape(-1, 3), box, step=0.02, num_samples=160)
  s.points  # [R, S, 3]; s.valid [R, S]; s.t [R, S]
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from jaxsys.core.errors import InputError, ShapeError
from jaxsys.nerf.grids import Box

__all__ = [
    "camera_rays", "check_rays", "num_samples_for", "ray_box", "RaySamples", "sample_rays",
    "view_encoding",
]


def camera_rays(c2w, height: int, width: int, focal: float):
  """World-space ray origins and unit directions ``[H, W, 3]`` of a pinhole camera.

  ``c2w [3, 4]`` (or ``[4, 4]``) is camera-to-world; the camera looks down its -z axis with +y up
  (the NeRF / OpenGL convention); pixel centres at ``(i + 0.5, j + 0.5)``.
  """
  if c2w.shape not in ((3, 4), (4, 4)):
    raise ShapeError(f"c2w must be [3, 4] or [4, 4], got shape {tuple(c2w.shape)}")
  j, i = jnp.meshgrid(jnp.arange(height) + 0.5, jnp.arange(width) + 0.5, indexing="ij")
  dirs = jnp.stack([(i - width / 2) / focal, -(j - height / 2) / focal, -jnp.ones_like(i)], -1)
  d = dirs @ c2w[:3, :3].T
  d = d / jnp.linalg.norm(d, axis=-1, keepdims=True)
  return jnp.broadcast_to(c2w[:3, 3], d.shape), d


def ray_box(rays_o, rays_d, box: Box):
  """Slab intersection: ``(t_near, t_far, hit)`` per ray, ``t_near >= 0``."""
  safe = jnp.where(jnp.abs(rays_d) < 1e-9, 1e-9, rays_d)
  ta = (jnp.asarray(box.lo) - rays_o) / safe
  tb = (jnp.asarray(box.hi) - rays_o) / safe
  t_near = jnp.maximum(jnp.max(jnp.minimum(ta, tb), -1), 0.0)
  t_far = jnp.min(jnp.maximum(ta, tb), -1)
  return t_near, t_far, t_far > t_near


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RaySamples:
  points: jax.Array  # [R, S, 3]
  t: jax.Array       # [R, S] distance along the (unit) ray
  valid: jax.Array   # [R, S] inside the box


def check_rays(rays_o, rays_d, viewdirs=None):
  """``rays_o``, ``rays_d`` (and ``viewdirs``) must all be ``[R, 3]`` with the same ``R``."""
  arrays = {"rays_o": rays_o, "rays_d": rays_d}
  if viewdirs is not None:
    arrays["viewdirs"] = viewdirs
  for name, a in arrays.items():
    if a.ndim != 2 or a.shape[-1] != 3:
      raise ShapeError(f"{name} must be [rays, 3], got shape {tuple(a.shape)}")
  sizes = {name: a.shape[0] for name, a in arrays.items()}
  if len(set(sizes.values())) != 1:
    raise InputError(f"ray batch sizes differ: {sizes}")


def num_samples_for(box: Box, step: float) -> int:
  """Samples that cover the box's diagonal at ``step``: the static sample count."""
  diag = math.dist(box.lo, box.hi)
  return int(math.ceil(diag / step)) + 1


def sample_rays(rays_o, rays_d, box: Box, *, step: float, num_samples: int) -> RaySamples:
  """``num_samples`` points every ``step`` from each ray's box entry (``rays_d`` unit length)."""
  check_rays(rays_o, rays_d)
  if not step > 0 or num_samples < 1:
    raise InputError(f"step={step} must be > 0 and num_samples={num_samples} >= 1")
  t_near, t_far, hit = ray_box(rays_o, rays_d, box)
  t = t_near[:, None] + step * jnp.arange(num_samples)[None, :]         # [R, S]
  valid = hit[:, None] & (t < t_far[:, None])
  points = rays_o[:, None, :] + t[..., None] * rays_d[:, None, :]      # [R, S, 3]
  return RaySamples(points=points, t=t, valid=valid)


def view_encoding(viewdirs, num_freqs: int = 4):
  """DVGO's view positional encoding ``[d, sin(2^k d), cos(2^k d)]``: ``[R, 3 + 6 * num_freqs]``."""
  freqs = 2.0 ** jnp.arange(num_freqs)
  x = (viewdirs[..., None] * freqs).reshape(*viewdirs.shape[:-1], -1)
  return jnp.concatenate([viewdirs, jnp.sin(x), jnp.cos(x)], -1)
