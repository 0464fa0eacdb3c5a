"""A procedural detection data set: shapes at random scales, colours and occlusions, with boxes.

Deterministic by seed with no downloads: image ``i`` of split seed ``s`` is drawn from
``np.random.default_rng([s, i])``, so any slice can be regenerated alone. Each image has a
textured, noisy background and ``min_objects..max_objects`` shapes of :data:`CLASSES` (filled
square/rectangle, disk/ellipse, triangle, plus-shaped cross, ring) with random size, aspect,
colour and position, painted in order so later shapes occlude earlier ones. A shape's box is
the bounding box of its *visible* pixels; a shape whose placement would leave an earlier one
with less than ``min_visible`` of its pixels is not drawn, so every drawn shape is labelled. Disk vs
ring and square vs cross differ only in structure, and crowded scenes put several objects side by
side: a one-to-many detector without NMS returns duplicates here.

Usage::

  cfg = ShapesConfig()                       # 64 x 64, 5 classes, 1-6 objects
  data = make_shapes(cfg, seed=0, start=0, count=256)
  data.images   # float32[256, 64, 64, 3] in [0, 1]
  data.boxes    # float32[256, max_objects, 4] (x1, y1, x2, y2) pixels, zero padding
  data.labels   # int32[256, max_objects]; data.valid: bool[256, max_objects]
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import numpy as np

from jaxsys.core.errors import ConfigError, check_min, check_positive, check_range

__all__ = ["CLASSES", "make_shapes", "Shapes", "ShapesConfig"]

CLASSES = ("rectangle", "ellipse", "triangle", "cross", "ring")


@dataclasses.dataclass(frozen=True)
class ShapesConfig:
  image_size: int = 64
  num_classes: int = 5  # the first num_classes of CLASSES
  min_objects: int = 1
  max_objects: int = 6
  min_size: int = 8  # object side in pixels
  max_size: int = 28
  min_visible: float = 0.5  # fraction of an object's pixels that must stay visible
  noise: float = 0.06  # std of per-pixel Gaussian noise

  def __post_init__(self):
    check_positive(self, "image_size", "num_classes", "min_objects", "max_objects", "min_size",
                   integer=True)
    check_range("num_classes", self.num_classes, 1, len(CLASSES))
    check_min(self, self.min_objects, "max_objects")
    check_min(self, self.min_size, "max_size")
    if self.max_size > self.image_size:
      raise ConfigError(f"max_size={self.max_size} must be <= image_size={self.image_size}")
    check_range("min_visible", self.min_visible, 0, 1)
    check_min(self, 0, "noise")


class Shapes(NamedTuple):
  images: np.ndarray  # float32[n, H, W, 3]
  boxes: np.ndarray   # float32[n, G, 4]
  labels: np.ndarray  # int32[n, G]
  valid: np.ndarray   # bool[n, G]

  def __len__(self):
    return len(self.images)

  def slice(self, start: int, stop: int) -> "Shapes":
    return Shapes(*(x[start:stop] for x in self))


def _mask(cls: int, xx, yy, cx, cy, w, h):
  """Boolean pixel mask of one shape centred at (cx, cy) with extent w x h."""
  u, v = (xx - cx) / (w / 2), (yy - cy) / (h / 2)  # [-1, 1] inside the extent
  if cls == 0:
    return (np.abs(u) <= 1) & (np.abs(v) <= 1)
  if cls == 1:
    return u * u + v * v <= 1
  if cls == 2:  # apex at the top, base at the bottom
    return (v <= 1) & (np.abs(u) <= (v + 1) / 2)
  if cls == 3:
    arm = 0.34
    return ((np.abs(u) <= 1) & (np.abs(v) <= arm)) | ((np.abs(v) <= 1) & (np.abs(u) <= arm))
  r2 = u * u + v * v
  return (r2 <= 1) & (r2 >= 0.5 ** 2)


def _image(cfg: ShapesConfig, rng: np.random.Generator):
  s = cfg.image_size
  yy, xx = np.mgrid[0:s, 0:s].astype(np.float32) + 0.5
  # background: a random colour gradient plus stripes, so edges alone do not find objects
  base = rng.uniform(0.0, 0.6, 3)
  grad = rng.uniform(-0.25, 0.25, (2, 3))
  img = base + (xx[..., None] / s - 0.5) * grad[0] + (yy[..., None] / s - 0.5) * grad[1]
  freq, phase = rng.uniform(0.1, 0.5), rng.uniform(0, 2 * np.pi)
  img = img + 0.05 * np.sin(freq * (xx + yy) + phase)[..., None]
  n = int(rng.integers(cfg.min_objects, cfg.max_objects + 1))
  owner = np.full((s, s), -1, np.int32)
  objs: dict[int, tuple[int, int]] = {}
  for k in range(n):
    cls = int(rng.integers(cfg.num_classes))
    size = rng.uniform(cfg.min_size, cfg.max_size)
    aspect = np.exp(rng.uniform(-0.4, 0.4))
    w, h = size * np.sqrt(aspect), size / np.sqrt(aspect)
    w, h = min(w, s), min(h, s)
    cx, cy = rng.uniform(w / 2, s - w / 2), rng.uniform(h / 2, s - h / 2)
    m = _mask(cls, xx, yy, cx, cy, w, h)
    colour = rng.uniform(0, 1, 3)
    if m.any() and np.abs(colour - img[m].mean(0)).max() < 0.25:
      colour = 1 - colour  # keep objects distinguishable from the local background
    new_owner = np.where(m, k, owner)
    # a placement that would hide too much of an earlier shape is skipped (every painted
    # shape stays labelled)
    if not m.any() or any((new_owner == j).sum() < cfg.min_visible * t for j, (_, t) in objs.items()):
      continue
    img[m] = colour
    owner = new_owner
    objs[k] = (cls, int(m.sum()))
  boxes, labels = [], []
  for k, (cls, _) in objs.items():
    ys, xs = np.nonzero(owner == k)
    boxes.append([xs.min(), ys.min(), xs.max() + 1, ys.max() + 1])
    labels.append(cls)
  img = img + rng.normal(0, cfg.noise, img.shape)
  return np.clip(img, 0, 1).astype(np.float32), boxes, labels


def make_shapes(cfg: ShapesConfig = ShapesConfig(), *, seed: int, start: int = 0,
                count: int) -> Shapes:
  """Images ``start .. start + count - 1`` of split ``seed`` (each its own RNG stream)."""
  if count < 1 or start < 0:
    raise ConfigError(f"count={count} must be >= 1 and start={start} >= 0")
  g = cfg.max_objects
  images = np.zeros((count, cfg.image_size, cfg.image_size, 3), np.float32)
  boxes = np.zeros((count, g, 4), np.float32)
  labels = np.zeros((count, g), np.int32)
  valid = np.zeros((count, g), bool)
  for i in range(count):
    img, b, lab = _image(cfg, np.random.default_rng([seed, start + i]))
    images[i] = img
    if b:
      boxes[i, :len(b)], labels[i, :len(b)], valid[i, :len(b)] = b, lab, True
  return Shapes(images, boxes, labels, valid)
