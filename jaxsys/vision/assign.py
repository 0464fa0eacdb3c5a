"""Label assignment for dense detectors: FCOS one-to-many targets and POTO one-to-one matching.

Ground truths are padded to a fixed ``G`` per image with a ``valid`` mask (static shapes, one
jit for every batch): ``gt_boxes [B, G, 4]`` (x1, y1, x2, y2 pixels), ``gt_labels int[B, G]``,
``gt_valid bool[B, G]``. Prediction locations are the points of all FPN levels concatenated:
``points [N, 2]`` (x, y) and ``point_strides [N]`` from :func:`anchor_points`. Targets use
``num_classes`` as the background label.

* :func:`fcos_targets` (Tian et al. 2019, sec. 3.1-3.3): every point inside a ground truth's
  centre region (``radius * stride``, clipped to the box) whose largest regression distance is in
  its level's range is a positive for the smallest such box: many points per object.
* :func:`poto_match` (Wang et al. 2021, "End-to-End Object Detection with Fully Convolutional
  Network", eq. 2-3): quality ``Q = 1[centre prior] * p(cls)^(1 - alpha) * IoU^alpha`` between
  each prediction and each ground truth, then a maximum-weight bipartite (Hungarian) matching,
  ``scipy.optimize.linear_sum_assignment`` run on the host inside ``jax.pure_callback``: each
  valid ground truth gets exactly one prediction.

Usage::

  points, strides = anchor_points(64, (4, 8, 16))
  t = fcos_targets(points, strides, ranges, gt_boxes, gt_labels, gt_valid, num_classes=5)
  match = poto_match(cls_logits, pred_boxes, points, strides, gt_boxes, gt_labels, gt_valid)
  t = one_to_one_targets(match, gt_boxes, gt_labels, num_points=N, num_classes=5)
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxsys.core.errors import ConfigError, ShapeError
from jaxsys.vision.boxes import pairwise_iou

__all__ = [
    "anchor_points", "center_region_mask", "fcos_targets", "hungarian_match", "INF", "ltrb",
    "one_to_one_targets", "poto_match", "poto_quality", "regress_ranges_for", "Targets",
]

INF = 1e8


def anchor_points(image_size: int | tuple[int, int], strides) -> tuple[np.ndarray, np.ndarray]:
  """Centres of every feature-map cell of every level, row-major per level, levels in order:
  ``points [N, 2]`` (x, y) at ``(i + 0.5) * stride`` and ``point_strides [N]`` (numpy
  constants, so they fold into a jitted program)."""
  h, w = (image_size, image_size) if isinstance(image_size, int) else image_size
  pts, st = [], []
  for s in strides:
    ys, xs = np.meshgrid((np.arange(-(-h // s)) + 0.5) * s, (np.arange(-(-w // s)) + 0.5) * s,
                         indexing="ij")
    pts.append(np.stack([xs.ravel(), ys.ravel()], -1))
    st.append(np.full(xs.size, s, np.float32))
  return np.concatenate(pts).astype(np.float32), np.concatenate(st)


def regress_ranges_for(point_strides, strides, ranges) -> np.ndarray:
  """Per-point ``[N, 2]`` (lo, hi) regression range from one (lo, hi) per level."""
  lo = np.zeros(point_strides.shape, np.float32)
  hi = np.zeros(point_strides.shape, np.float32)
  ps = np.asarray(point_strides)
  for s, (a, b) in zip(strides, ranges):
    lo[ps == s], hi[ps == s] = a, b
  return np.stack([lo, hi], -1)


def ltrb(points, boxes):
  """Distances from each point to each box's sides: ``[N, G, 4]`` (left, top, right, bottom)."""
  px, py = points[:, None, 0], points[:, None, 1]  # [N, 1]
  return jnp.stack([px - boxes[None, :, 0], py - boxes[None, :, 1],
                    boxes[None, :, 2] - px, boxes[None, :, 3] - py], -1)


def center_region_mask(points, point_strides, boxes, radius: float):
  """``bool[N, G]``: the point lies in the box's centre region (centre +- radius * stride,
  clipped to the box), the sampling region of FCOS and the centre prior of POTO."""
  c = (boxes[:, :2] + boxes[:, 2:]) / 2  # [G, 2]
  r = (radius * point_strides)[:, None, None]  # [N, 1, 1]
  lo = jnp.maximum(c[None] - r, boxes[None, :, :2])  # [N, G, 2]
  hi = jnp.minimum(c[None] + r, boxes[None, :, 2:])
  p = points[:, None, :]
  return jnp.all((p > lo) & (p < hi), -1)


class Targets(NamedTuple):
  """Per-point training targets: ``labels int[B, N]`` (num_classes = background),
  ``boxes [B, N, 4]`` (the assigned ground truth, zeros for background), ``pos bool[B, N]``,
  ``centerness [B, N]`` (FCOS only; zeros for POTO)."""
  labels: jnp.ndarray
  boxes: jnp.ndarray
  pos: jnp.ndarray
  centerness: jnp.ndarray


def _check_gt(gt_boxes, gt_labels, gt_valid):
  if gt_boxes.ndim != 3 or gt_boxes.shape[-1] != 4:
    raise ShapeError(f"gt_boxes must be [batch, max_gt, 4], got shape {gt_boxes.shape}")
  if gt_labels.shape != gt_boxes.shape[:2] or gt_valid.shape != gt_boxes.shape[:2]:
    raise ShapeError(f"gt_labels {gt_labels.shape} and gt_valid {gt_valid.shape} must be "
                     f"[batch, max_gt] = {gt_boxes.shape[:2]}")


def fcos_targets(points, point_strides, regress_ranges, gt_boxes, gt_labels, gt_valid, *,
                 num_classes: int, radius: float | None = 1.5) -> Targets:
  """FCOS one-to-many targets; ``regress_ranges [N, 2]`` per point.

  ``radius``: centre sampling (a point is a candidate inside the box's centre region of
  ``radius`` strides); ``None``: every point strictly inside the box is (FCOS's original rule,
  mmdet's ``center_sampling=False``, which DATE's configs use for their one-to-many branch)."""
  _check_gt(gt_boxes, gt_labels, gt_valid)
  if radius is not None and not radius > 0:
    raise ConfigError(f"radius={radius} must be > 0, or None for every point inside the box")

  def one(boxes, labels, valid):
    d = ltrb(points, boxes)  # [N, G, 4]
    max_d = d.max(-1)
    in_range = (max_d >= regress_ranges[:, :1]) & (max_d <= regress_ranges[:, 1:])
    region = d.min(-1) > 0 if radius is None else center_region_mask(points, point_strides, boxes, radius)
    cand = region & in_range & valid[None]
    area = (boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1])  # [G]
    # the smallest candidate box wins (FCOS's rule for ambiguous points)
    gi = jnp.argmin(jnp.where(cand, area[None], INF), -1)  # [N]
    pos = cand.any(-1)
    tgt = boxes[gi]
    dd = jnp.take_along_axis(d, gi[:, None, None], 1)[:, 0]  # [N, 4]
    lr, tb = dd[:, [0, 2]], dd[:, [1, 3]]
    # centerness* = sqrt(min(l,r)/max(l,r) * min(t,b)/max(t,b))  (FCOS eq. 3)
    ctr = jnp.sqrt(jnp.clip(lr.min(-1) / jnp.maximum(lr.max(-1), 1e-6), 0)
                   * jnp.clip(tb.min(-1) / jnp.maximum(tb.max(-1), 1e-6), 0))
    return Targets(jnp.where(pos, labels[gi], num_classes), jnp.where(pos[:, None], tgt, 0.0),
                   pos, jnp.where(pos, ctr, 0.0))

  return jax.vmap(one)(gt_boxes, gt_labels.astype(jnp.int32), gt_valid.astype(bool))


def poto_quality(cls_logits, pred_boxes, points, point_strides, gt_boxes, gt_labels, gt_valid, *,
                 alpha: float = 0.8, radius: float = 1.5):
  """POTO matching quality ``[B, N, G]`` (zero for invalid ground truths), no gradient.

  ``cls_logits [B, N, C]``, ``pred_boxes [B, N, 4]`` (pixels). Quality =
  ``centre_prior * sigmoid(cls[:, label])^(1 - alpha) * IoU(pred, gt)^alpha``.
  """
  _check_gt(gt_boxes, gt_labels, gt_valid)
  cls_logits, pred_boxes = jax.lax.stop_gradient((cls_logits, pred_boxes))

  def one(logits, boxes, gtb, gtl, valid):
    p = jnp.take(jax.nn.sigmoid(logits), gtl, axis=1)  # [N, G]
    ov = jnp.clip(pairwise_iou(boxes, gtb), 0, 1)  # [N, G]
    prior = center_region_mask(points, point_strides, gtb, radius) & valid[None]
    return prior * p ** (1 - alpha) * ov ** alpha

  return jax.vmap(one)(cls_logits, pred_boxes, gt_boxes, gt_labels.astype(jnp.int32),
                       gt_valid.astype(bool))


def _hungarian_host(quality: np.ndarray, valid: np.ndarray) -> np.ndarray:
  from scipy.optimize import linear_sum_assignment
  b, n, g = quality.shape
  out = np.full((b, g), -1, np.int32)
  for i in range(b):
    cols = np.flatnonzero(valid[i])
    if cols.size == 0:
      continue
    rows, matched = linear_sum_assignment(np.asarray(quality[i][:, cols], np.float64),
                                          maximize=True)
    out[i, cols[matched]] = rows
  return out


def hungarian_match(quality, valid):
  """Maximum-weight one-to-one matching per image: ``int32[B, G]``, the prediction index of each
  valid ground truth (-1 for padding). ``quality [B, N, G]`` with ``N >= G``; runs scipy on the
  host through ``jax.pure_callback``, so it can sit inside a jitted train step."""
  if quality.ndim != 3 or valid.shape != (quality.shape[0], quality.shape[2]):
    raise ShapeError(f"quality must be [batch, points, max_gt] and valid [batch, max_gt], "
                     f"got {quality.shape} and {valid.shape}")
  if quality.shape[1] < quality.shape[2]:
    raise ShapeError(f"one-to-one matching needs points >= max_gt, got {quality.shape[1]} "
                     f"points for {quality.shape[2]} ground truths")
  out = jax.ShapeDtypeStruct(valid.shape, jnp.int32)
  return jax.pure_callback(_hungarian_host, out, quality.astype(jnp.float32),
                           valid.astype(bool), vmap_method="sequential")


def poto_match(cls_logits, pred_boxes, points, point_strides, gt_boxes, gt_labels, gt_valid, *,
               alpha: float = 0.8, radius: float = 1.5):
  """POTO: :func:`poto_quality` then :func:`hungarian_match` -> ``int32[B, G]``."""
  q = poto_quality(cls_logits, pred_boxes, points, point_strides, gt_boxes, gt_labels, gt_valid,
                   alpha=alpha, radius=radius)
  return hungarian_match(q, gt_valid)


def one_to_one_targets(match, gt_boxes, gt_labels, *, num_points: int, num_classes: int) -> Targets:
  """Scatters a matching (``int32[B, G]``, -1 = none) into per-point :class:`Targets`."""
  b, g = match.shape
  rows = jnp.where(match >= 0, match, num_points)  # unmatched -> a dropped extra slot
  bi = jnp.arange(b)[:, None]
  labels = jnp.full((b, num_points + 1), num_classes, jnp.int32).at[bi, rows].set(
      gt_labels.astype(jnp.int32))[:, :num_points]
  boxes = jnp.zeros((b, num_points + 1, 4), gt_boxes.dtype).at[bi, rows].set(gt_boxes)[:, :num_points]
  pos = labels < num_classes
  return Targets(labels, boxes, pos, jnp.zeros(pos.shape, jnp.float32))
