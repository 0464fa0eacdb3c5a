"""Box operations for detection: conversions, IoU / GIoU (pairwise and aligned) and NMS.

Boxes are ``[..., 4]`` arrays in absolute ``(x1, y1, x2, y2)`` pixels unless a name says
``cxcywh``. Everything here is vectorised and jit-able; :func:`check_boxes` is the host-side
validation of user input (concrete arrays) that the data and evaluation entry points run.

Usage::

  iou = pairwise_iou(pred, gt)                      # [N, M]
  keep = nms(boxes, scores, iou_threshold=0.6)      # bool[N], class-agnostic
  keep = nms(boxes, scores, 0.6, labels=labels)     # per class
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxsys.core.errors import InputError, ShapeError

__all__ = [
    "box_area", "check_boxes", "cxcywh_to_xyxy", "EPS", "from_batch", "giou", "iou", "nms", "pairwise_giou",
    "pairwise_iou", "xyxy_to_cxcywh",
]

EPS = 1e-7


def check_boxes(name: str, boxes, valid=None) -> None:
  """Raises when ``boxes`` is not ``[..., 4]`` or a (valid) box has ``x2 < x1`` / ``y2 < y1`` /
  non-finite coordinates. Zero-area boxes (``x2 == x1``) are allowed."""
  b = np.asarray(boxes)
  if b.ndim < 1 or b.shape[-1] != 4:
    raise ShapeError(f"{name} must be [..., 4] (x1, y1, x2, y2), got shape {b.shape}")
  m = np.ones(b.shape[:-1], bool) if valid is None else np.asarray(valid, bool)
  sel = b[m]
  if not np.all(np.isfinite(sel)):
    raise InputError(f"{name} has non-finite coordinates")
  bad = (sel[:, 2] < sel[:, 0]) | (sel[:, 3] < sel[:, 1])
  if bad.any():
    raise InputError(f"{name} has {int(bad.sum())} degenerate boxes with x2 < x1 or y2 < y1, "
                     f"e.g. {sel[bad][0].tolist()}")


def cxcywh_to_xyxy(b):
  cx, cy, w, h = jnp.moveaxis(b, -1, 0)
  return jnp.stack([cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2], -1)


def xyxy_to_cxcywh(b):
  x1, y1, x2, y2 = jnp.moveaxis(b, -1, 0)
  return jnp.stack([(x1 + x2) / 2, (y1 + y2) / 2, x2 - x1, y2 - y1], -1)


def box_area(b):
  return jnp.clip(b[..., 2] - b[..., 0], 0) * jnp.clip(b[..., 3] - b[..., 1], 0)


def _iou_terms(a, b):
  """Intersection, union and enclosing-box area of broadcast-compatible ``a`` and ``b``."""
  lt = jnp.maximum(a[..., :2], b[..., :2])
  rb = jnp.minimum(a[..., 2:], b[..., 2:])
  inter = jnp.prod(jnp.clip(rb - lt, 0), -1)
  union = box_area(a) + box_area(b) - inter
  elt = jnp.minimum(a[..., :2], b[..., :2])
  erb = jnp.maximum(a[..., 2:], b[..., 2:])
  enclose = jnp.prod(jnp.clip(erb - elt, 0), -1)
  return inter, union, enclose


def iou(a, b):
  """IoU of aligned boxes (broadcasting): ``[...]``."""
  inter, union, _ = _iou_terms(a, b)
  return inter / jnp.maximum(union, EPS)


def giou(a, b):
  """Generalised IoU (Rezatofighi et al. 2019, eq. 1): IoU - (C - U) / C, C the enclosing box."""
  inter, union, enclose = _iou_terms(a, b)
  return inter / jnp.maximum(union, EPS) - (enclose - union) / jnp.maximum(enclose, EPS)


def pairwise_iou(a, b):
  """``a [..., N, 4]``, ``b [..., M, 4]`` -> IoU ``[..., N, M]``."""
  return iou(a[..., :, None, :], b[..., None, :, :])


def pairwise_giou(a, b):
  return giou(a[..., :, None, :], b[..., None, :, :])


def nms(boxes, scores, iou_threshold: float, *, labels=None, valid=None):
  """Greedy non-maximum suppression; returns ``keep: bool[N]`` in the input order.

  ``boxes [N, 4]``, ``scores [N]``; with ``labels [N]`` boxes of different classes never
  suppress each other; ``valid [N]`` (default all) excludes candidates. Jit-able: the greedy
  pass is a ``lax.fori_loop`` over the score order on the ``[N, N]`` IoU matrix.
  """
  n = boxes.shape[0]
  valid = jnp.ones((n,), bool) if valid is None else valid.astype(bool)
  order = jnp.argsort(-jnp.where(valid, scores, -jnp.inf), stable=True)
  b = boxes[order]
  overlap = pairwise_iou(b, b) > iou_threshold  # [N, N], sorted order
  if labels is not None:
    lab = labels[order]
    overlap &= lab[:, None] == lab[None, :]
  later = jnp.arange(n)[None, :] > jnp.arange(n)[:, None]
  overlap &= later

  def body(i, keep):
    # box i (if still kept) suppresses every later box it overlaps
    return keep & ~(overlap[i] & keep[i])

  keep_sorted = jax.lax.fori_loop(0, n, body, valid[order])
  return jnp.zeros((n,), bool).at[order].set(keep_sorted)


def from_batch(boxes, scores, labels, valid):
  """Padded ``[B, K, ...]`` arrays (+ ``valid [B, K]``) -> a per-image list of tuples; pass
  ``scores=None`` for ground truths."""
  boxes, labels, valid = np.asarray(boxes), np.asarray(labels), np.asarray(valid, bool)
  out = []
  for i in range(len(boxes)):
    m = valid[i]
    if scores is None:
      out.append((boxes[i][m], labels[i][m]))
    else:
      out.append((boxes[i][m], np.asarray(scores)[i][m], labels[i][m]))
  return out
