"""Focal / GIoU / IoU / L1 losses against direct formulas."""

import numpy as np
import pytest

from jaxsys.vision import losses as L
from jaxsys.vision.assign import Targets


def test_focal_matches_formula():
  x = np.array([-3.0, -0.5, 0.0, 2.0], np.float32)
  y = np.array([0.0, 1.0, 1.0, 0.0], np.float32)
  p = 1 / (1 + np.exp(-x))
  pt = np.where(y == 1, p, 1 - p)
  at = np.where(y == 1, 0.25, 0.75)
  np.testing.assert_allclose(L.sigmoid_focal_loss(x, y), -at * (1 - pt) ** 2 * np.log(pt), rtol=1e-5)


def test_box_losses():
  a = np.array([[0, 0, 10, 10]], np.float32)
  b = np.array([[5, 0, 15, 10]], np.float32)
  assert float(L.giou_loss(a, a)[0]) == pytest.approx(0.0, abs=1e-6)
  iou = 50 / 150
  assert float(L.giou_loss(a, b)[0]) == pytest.approx(1 - iou, rel=1e-5)  # enclosing box = union
  assert float(L.iou_loss(a, b)[0]) == pytest.approx(-np.log(iou), rel=1e-5)
  np.testing.assert_allclose(L.l1_loss(a, b), [[5, 0, 5, 0]])


def test_one_to_one_loss_normalises_by_positives_and_ignores_background_boxes():
  c, n = 2, 4
  labels = np.array([[0, c, c, c]])
  boxes_t = np.zeros((1, n, 4), np.float32)
  boxes_t[0, 0] = [0, 0, 8, 8]
  t = Targets(labels, boxes_t, labels < c, np.zeros((1, n), np.float32))
  pred = np.tile(np.array([[[0, 0, 8, 8]]], np.float32), (1, n, 1))
  pred[0, 1:] = [100, 100, 101, 101]  # garbage boxes on background points do not count
  logits = np.full((1, n, c), -5.0, np.float32)
  out = L.one_to_one_loss(logits, pred, t, num_classes=c, image_size=16)
  assert float(out["o2o_l1"]) == pytest.approx(0.0, abs=1e-6)
  assert float(out["o2o_giou"]) == pytest.approx(0.0, abs=1e-6)
  fl = L.sigmoid_focal_loss(logits, np.eye(c + 1)[labels][..., :c])
  assert float(out["o2o_cls"]) == pytest.approx(2.0 * float(fl.sum()) / 1.0, rel=1e-5)
