"""A procedural 3-D scene, exactly ray traced, for radiance-field experiments (no downloads).

The scene is a few spheres and boxes inside ``[-1, 1]^3`` on a white background, shaded with
Lambertian + Phong terms from one directional light (the specular term makes colour depend on
the view direction, which the colour MLP must learn). Primary rays are intersected
analytically (sphere quadratic, box slabs), so every pixel is exact.

Cameras sit on the upper hemisphere of radius ``radius`` (seeded azimuth and elevation) and look
at the origin; rays follow ``jaxsys.nerf.rays.camera_rays`` (pinhole, -z forward).

Usage::

  scene = make_scene(seed=0)
  train, test = render_dataset(scene, num_views=72, num_test=8, size=48, seed=0)
  train.images  # [N, 48, 48, 3] in [0, 1];  train.rays_o / rays_d [N, 48, 48, 3]
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxsys.core.errors import ConfigError, InputError

__all__ = [
    "Cuboid", "hemisphere_cameras", "look_at", "make_scene", "render_dataset", "render_views", "Scene",
    "Sphere", "trace", "Views",
]


@dataclasses.dataclass(frozen=True)
class Sphere:
  center: tuple[float, float, float]
  radius: float
  color: tuple[float, float, float]


@dataclasses.dataclass(frozen=True)
class Cuboid:
  lo: tuple[float, float, float]
  hi: tuple[float, float, float]
  color: tuple[float, float, float]


@dataclasses.dataclass(frozen=True)
class Scene:
  spheres: tuple[Sphere, ...]
  cuboids: tuple[Cuboid, ...]
  light: tuple[float, float, float] = (0.4, 0.3, 0.85)   # direction towards the light
  ambient: float = 0.25
  specular: float = 0.35
  shininess: float = 24.0
  background: tuple[float, float, float] = (1.0, 1.0, 1.0)


@dataclasses.dataclass(frozen=True)
class Views:
  images: np.ndarray  # [N, H, W, 3] float32
  rays_o: np.ndarray  # [N, H, W, 3]
  rays_d: np.ndarray  # [N, H, W, 3] unit
  c2w: np.ndarray     # [N, 4, 4]
  focal: float

  def __len__(self):
    return self.images.shape[0]


def make_scene(seed: int = 0) -> Scene:
  """Three spheres and two boxes with seeded jitter of position, size and colour."""
  rng = np.random.default_rng(seed)
  jit = lambda s: rng.uniform(-s, s, 3)  # noqa: E731
  col = lambda base: tuple(np.clip(np.asarray(base) + rng.uniform(-0.1, 0.1, 3), 0, 1))  # noqa: E731
  spheres = (
      Sphere(tuple(np.array([0.35, 0.3, -0.35]) + jit(0.05)), 0.4 + rng.uniform(-0.03, 0.03), col([0.85, 0.2, 0.15])),
      Sphere(tuple(np.array([-0.45, 0.35, -0.45]) + jit(0.05)), 0.3 + rng.uniform(-0.03, 0.03), col([0.15, 0.45, 0.85])),
      Sphere(tuple(np.array([-0.1, -0.5, -0.4]) + jit(0.05)), 0.32 + rng.uniform(-0.03, 0.03), col([0.95, 0.8, 0.15])),
  )
  cuboids = (
      Cuboid((-0.8, -0.8, -0.8), (0.8, 0.8, -0.7), col([0.55, 0.55, 0.5])),   # the floor slab
      Cuboid(tuple(np.array([0.2, -0.6, -0.7]) + jit(0.03) * [1, 1, 0]),
             tuple(np.array([0.6, -0.2, -0.1]) + jit(0.03) * [1, 1, 0]), col([0.2, 0.7, 0.3])),
  )
  return Scene(spheres=spheres, cuboids=cuboids)


def _hit_sphere(o, d, s: Sphere):
  oc = o - np.asarray(s.center)
  b = np.sum(oc * d, -1)
  c = np.sum(oc * oc, -1) - s.radius**2
  disc = b * b - c
  t = -b - np.sqrt(np.maximum(disc, 0))
  ok = (disc > 0) & (t > 1e-6)
  normal = oc + t[..., None] * d
  return np.where(ok, t, np.inf), normal / np.linalg.norm(normal, axis=-1, keepdims=True)


def _hit_cuboid(o, d, c: Cuboid):
  safe = np.where(np.abs(d) < 1e-12, 1e-12, d)
  ta, tb = (np.asarray(c.lo) - o) / safe, (np.asarray(c.hi) - o) / safe
  tmin, tmax = np.minimum(ta, tb), np.maximum(ta, tb)
  t_near, t_far = tmin.max(-1), tmax.min(-1)
  ok = (t_far > t_near) & (t_near > 1e-6)
  axis = tmin.argmax(-1)                               # the slab entered last gives the face
  normal = np.zeros_like(d)
  np.put_along_axis(normal, axis[..., None], -np.sign(np.take_along_axis(d, axis[..., None], -1)), -1)
  return np.where(ok, t_near, np.inf), normal


def trace(scene: Scene, rays_o, rays_d) -> np.ndarray:
  """Exact colour of each ray ``[..., 3]``: nearest hit, Lambert + Phong, else the background."""
  o, d = np.asarray(rays_o, np.float64), np.asarray(rays_d, np.float64)
  if o.shape != d.shape or o.shape[-1] != 3:
    raise InputError(f"rays_o {o.shape} and rays_d {d.shape} must be equal [..., 3]")
  best = np.full(o.shape[:-1], np.inf)
  normal = np.zeros_like(o)
  color = np.zeros_like(o)
  for obj in scene.spheres + scene.cuboids:
    t, n = _hit_sphere(o, d, obj) if isinstance(obj, Sphere) else _hit_cuboid(o, d, obj)
    closer = t < best
    best = np.where(closer, t, best)
    normal = np.where(closer[..., None], n, normal)
    color = np.where(closer[..., None], np.asarray(obj.color), color)
  light = np.asarray(scene.light) / np.linalg.norm(scene.light)
  lam = np.clip(np.sum(normal * light, -1), 0, None)
  refl = 2 * np.sum(normal * light, -1, keepdims=True) * normal - light
  spec = np.clip(np.sum(refl * -d, -1), 0, None) ** scene.shininess * (lam > 0)
  shaded = color * (scene.ambient + (1 - scene.ambient) * lam[..., None]) + scene.specular * spec[..., None]
  hit = np.isfinite(best)[..., None]
  return np.clip(np.where(hit, shaded, np.asarray(scene.background)), 0, 1).astype(np.float32)


def look_at(eye, target=(0.0, 0.0, 0.0), up=(0.0, 0.0, 1.0)) -> np.ndarray:
  """Camera-to-world ``[4, 4]`` for a camera at ``eye`` looking at ``target`` (-z forward)."""
  eye = np.asarray(eye, np.float64)
  fwd = np.asarray(target) - eye
  fwd /= np.linalg.norm(fwd)
  right = np.cross(fwd, up)
  right /= np.linalg.norm(right)
  true_up = np.cross(right, fwd)
  m = np.eye(4)
  m[:3, 0], m[:3, 1], m[:3, 2], m[:3, 3] = right, true_up, -fwd, eye
  return m


def hemisphere_cameras(num: int, *, radius: float = 3.6, seed: int = 0,
                       elevation=(15.0, 70.0)) -> np.ndarray:
  """``[num, 4, 4]`` seeded cameras on the upper hemisphere looking at the origin."""
  rng = np.random.default_rng(seed)
  az = rng.uniform(0, 2 * np.pi, num)
  el = np.deg2rad(rng.uniform(*elevation, num))
  eyes = radius * np.stack([np.cos(el) * np.cos(az), np.cos(el) * np.sin(az), np.sin(el)], -1)
  return np.stack([look_at(e) for e in eyes])


def render_views(scene: Scene, c2w: np.ndarray, *, size: int, fov_deg: float = 40.0) -> Views:
  """Exact images of ``scene`` from cameras ``c2w [N, 4, 4]`` at ``size x size`` pixels."""
  import jax
  import jax.numpy as jnp

  from jaxsys.nerf.rays import camera_rays
  focal = 0.5 * size / np.tan(np.deg2rad(fov_deg) / 2)
  rays = jax.vmap(lambda m: camera_rays(m, size, size, focal))(jnp.asarray(c2w, jnp.float32))
  rays_o, rays_d = (np.asarray(r) for r in rays)
  return Views(images=trace(scene, rays_o, rays_d), rays_o=rays_o, rays_d=rays_d,
               c2w=np.asarray(c2w, np.float32), focal=float(focal))


def render_dataset(scene: Scene, *, num_views: int = 72, num_test: int = 8, size: int = 48,
                   seed: int = 0) -> tuple[Views, Views]:
  """``(train, test)`` views: ``num_views`` seeded hemisphere cameras, the last ``num_test``
  held out."""
  if not 1 <= num_test < num_views:
    raise ConfigError(f"num_test={num_test} must be in [1, num_views={num_views})")
  if size < 4:
    raise ConfigError(f"size={size} must be >= 4")
  cams = hemisphere_cameras(num_views, seed=seed)
  views = render_views(scene, cams, size=size)
  split = lambda sl: Views(views.images[sl], views.rays_o[sl], views.rays_d[sl], views.c2w[sl], views.focal)  # noqa: E731
  return split(slice(0, num_views - num_test)), split(slice(num_views - num_test, num_views))
