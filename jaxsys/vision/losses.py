"""Detection losses: sigmoid focal, GIoU, IoU, L1, and the two branch criteria of DATE.

Elementwise losses return unreduced values; the criteria normalise as mmdet does (by the number
of positives over the whole batch, at least 1), so a data-parallel step over the global batch
equals the single-device one.

* :func:`one_to_one_loss` (POTO branch): focal (alpha 0.25, gamma 2, weight 2) over all points,
  L1 on normalised cxcywh boxes (weight 5) and GIoU (weight 2) on the matched points.
* :func:`one_to_many_loss` (FCOS branch): focal (weight 1), IoU loss weighted by the
  centerness target (weight 1), centerness binary cross-entropy (weight 1).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from jaxsys.vision.assign import Targets
from jaxsys.vision.boxes import giou, iou, xyxy_to_cxcywh

__all__ = ["giou_loss", "iou_loss", "l1_loss", "one_to_many_loss", "one_to_one_loss", "sigmoid_focal_loss"]


def sigmoid_focal_loss(logits, targets, *, alpha: float = 0.25, gamma: float = 2.0):
  """Focal loss (Lin et al. 2017, eq. 5) per element: ``logits``/``targets`` (0/1) ``[..., C]``.

  FL = -alpha_t (1 - p_t)^gamma log(p_t), computed from ``log_sigmoid`` for stability."""
  p = jax.nn.sigmoid(logits)
  ce = optax.sigmoid_binary_cross_entropy(logits, targets)
  p_t = p * targets + (1 - p) * (1 - targets)
  alpha_t = alpha * targets + (1 - alpha) * (1 - targets)
  return alpha_t * (1 - p_t) ** gamma * ce


def giou_loss(pred, target):
  """``1 - GIoU`` of aligned ``[..., 4]`` xyxy boxes."""
  return 1.0 - giou(pred, target)


def iou_loss(pred, target, eps: float = 1e-6):
  """``-log(IoU)`` of aligned boxes (UnitBox; mmdet's IoULoss default used by FCOS)."""
  return -jnp.log(jnp.maximum(iou(pred, target), eps))


def l1_loss(pred, target):
  return jnp.abs(pred - target)


def _num_pos(pos):
  return jnp.maximum(jnp.sum(pos.astype(jnp.float32)), 1.0)


def _focal(cls_logits, t: Targets, num_classes: int):
  onehot = jax.nn.one_hot(t.labels, num_classes + 1)[..., :num_classes]  # background -> all 0
  return jnp.sum(sigmoid_focal_loss(cls_logits, onehot)) / _num_pos(t.pos)


def one_to_one_loss(cls_logits, boxes, t: Targets, *, num_classes: int, image_size,
                    weights=(2.0, 5.0, 2.0)) -> dict:
  """POTO branch losses. ``cls_logits [B, N, C]``, ``boxes [B, N, 4]`` pixels xyxy."""
  w_cls, w_l1, w_giou = weights
  h, w = (image_size, image_size) if isinstance(image_size, int) else image_size
  scale = jnp.asarray([w, h, w, h], jnp.float32)
  pos = t.pos.astype(jnp.float32)
  n = _num_pos(t.pos)
  l1 = jnp.sum(l1_loss(xyxy_to_cxcywh(boxes / scale), xyxy_to_cxcywh(t.boxes / scale)).sum(-1) * pos)
  gl = jnp.sum(giou_loss(boxes, t.boxes) * pos)
  return {"o2o_cls": w_cls * _focal(cls_logits, t, num_classes),
          "o2o_l1": w_l1 * l1 / n, "o2o_giou": w_giou * gl / n}


def one_to_many_loss(cls_logits, boxes, ctr_logits, t: Targets, *, num_classes: int,
                     weights=(1.0, 1.0, 1.0)) -> dict:
  """FCOS branch losses. ``ctr_logits [B, N]``; the IoU loss is weighted by the centerness
  target and normalised by its sum (FCOS)."""
  w_cls, w_iou, w_ctr = weights
  pos = t.pos.astype(jnp.float32)
  ctr_w = t.centerness * pos
  il = jnp.sum(iou_loss(boxes, jnp.where(t.pos[..., None], t.boxes, boxes)) * ctr_w)
  bce = jnp.sum(optax.sigmoid_binary_cross_entropy(ctr_logits, t.centerness) * pos)
  return {"o2m_cls": w_cls * _focal(cls_logits, t, num_classes),
          "o2m_iou": w_iou * il / jnp.maximum(jnp.sum(ctr_w), 1e-6),
          "o2m_ctr": w_ctr * bce / _num_pos(t.pos)}
