"""Box ops against naive per-pair Python references."""

import jax
import numpy as np
import pytest

from jaxsys.core.errors import InputError, ShapeError
from jaxsys.vision import boxes as B


def _rand_boxes(rng, n):
  xy = rng.uniform(0, 50, (n, 2))
  return np.concatenate([xy, xy + rng.uniform(0, 20, (n, 2))], 1).astype(np.float32)


def _naive_iou_giou(a, b):
  ix = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
  iy = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
  inter = ix * iy
  area = lambda x: (x[2] - x[0]) * (x[3] - x[1])
  union = area(a) + area(b) - inter
  c = (max(a[2], b[2]) - min(a[0], b[0])) * (max(a[3], b[3]) - min(a[1], b[1]))
  iou = inter / union if union > 0 else 0.0
  return iou, iou - (c - union) / c if c > 0 else iou


def test_pairwise_iou_giou_match_naive():
  rng = np.random.default_rng(0)
  a, b = _rand_boxes(rng, 7), _rand_boxes(rng, 5)
  a[0] = b[0]  # identical pair: IoU = GIoU = 1
  iou, giou = np.asarray(B.pairwise_iou(a, b)), np.asarray(B.pairwise_giou(a, b))
  ref = np.array([[_naive_iou_giou(x, y) for y in b] for x in a])
  np.testing.assert_allclose(iou, ref[..., 0], atol=1e-5)
  np.testing.assert_allclose(giou, ref[..., 1], atol=1e-5)
  assert iou[0, 0] == pytest.approx(1.0) and (giou >= -1).all() and (giou <= iou + 1e-6).all()


def test_cxcywh_roundtrip():
  b = _rand_boxes(np.random.default_rng(1), 6)
  np.testing.assert_allclose(B.cxcywh_to_xyxy(B.xyxy_to_cxcywh(b)), b, atol=1e-5)


def _naive_nms(boxes, scores, thr, labels):
  order = sorted(range(len(scores)), key=lambda i: -scores[i])
  keep = []
  for i in order:
    if all(labels[i] != labels[j] or _naive_iou_giou(boxes[i], boxes[j])[0] <= thr for j in keep):
      keep.append(i)
  out = np.zeros(len(scores), bool)
  out[keep] = True
  return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_nms_matches_naive_greedy(seed):
  rng = np.random.default_rng(seed)
  base = _rand_boxes(rng, 6)
  boxes = np.concatenate([base, base + rng.normal(0, 2, base.shape).astype(np.float32)])
  boxes[:, 2:] = np.maximum(boxes[:, 2:], boxes[:, :2] + 1)
  scores = rng.uniform(size=len(boxes)).astype(np.float32)
  labels = rng.integers(0, 2, len(boxes))
  keep = jax.jit(lambda b, s, lab: B.nms(b, s, 0.5, labels=lab))(boxes, scores, labels)
  np.testing.assert_array_equal(np.asarray(keep), _naive_nms(boxes, scores, 0.5, labels))
  agnostic = np.asarray(B.nms(boxes, scores, 0.5))
  np.testing.assert_array_equal(agnostic, _naive_nms(boxes, scores, 0.5, np.zeros(len(boxes))))


def test_nms_valid_mask_drops_candidates():
  boxes = np.array([[0, 0, 10, 10], [0, 0, 10, 10], [20, 20, 30, 30]], np.float32)
  keep = B.nms(boxes, np.array([0.9, 0.8, 0.7]), 0.5, valid=np.array([False, True, True]))
  np.testing.assert_array_equal(np.asarray(keep), [False, True, True])


def test_check_boxes_rejects_degenerate_and_bad_shape():
  B.check_boxes("gt", np.array([[0, 0, 0, 5]]))  # zero width is allowed
  with pytest.raises(InputError, match="x2 < x1"):
    B.check_boxes("gt", np.array([[5, 0, 1, 5]]))
  B.check_boxes("gt", np.array([[5, 0, 1, 5]]), valid=np.array([False]))  # padding is ignored
  with pytest.raises(ShapeError, match=r"\[\.\.\., 4\]"):
    B.check_boxes("gt", np.zeros((3, 5)))
