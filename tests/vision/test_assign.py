"""FCOS targets and POTO matching on hand-made cases."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsys.core.errors import ConfigError, ShapeError
from jaxsys.vision import assign as A

C = 3


def test_anchor_points_layout():
  pts, st = A.anchor_points(16, (4, 8))
  assert pts.shape == (16 + 4, 2) and st.tolist() == [4] * 16 + [8] * 4
  np.testing.assert_array_equal(pts[:5], [[2, 2], [6, 2], [10, 2], [14, 2], [2, 6]])  # row-major
  np.testing.assert_array_equal(pts[16], [4, 4])


def _gt(boxes, labels):
  g = len(boxes) + 1  # one padded slot
  b = np.zeros((1, g, 4), np.float32)
  b[0, :len(boxes)] = np.reshape(boxes, (-1, 4))
  lab = np.zeros((1, g), np.int32)
  lab[0, :len(boxes)] = labels
  valid = np.zeros((1, g), bool)
  valid[0, :len(boxes)] = True
  return b, lab, valid


def _fcos(pts, st, ranges, b, lab, valid, radius=1.5):
  # one compiled program per shape (eager vmap dispatches op by op)
  return jax.jit(lambda *a: A.fcos_targets(pts, st, ranges, *a, num_classes=C, radius=radius))(
      b, lab, valid)


def test_fcos_targets_hand_made():
  # 16 x 16 image, stride 4 only: points at 2, 6, 10, 14 on each axis
  pts, st = A.anchor_points(16, (4,))
  ranges = A.regress_ranges_for(st, (4,), ((-1, 1e8),))
  # big box covers everything; small box (label 2) sits around point (6, 6)
  b, lab, valid = _gt([[0, 0, 16, 16], [4, 4, 8, 8]], [1, 2])
  t = _fcos(pts, st, ranges, b, lab, valid)
  labels = np.asarray(t.labels[0]).reshape(4, 4)
  # centre sampling: big box centre (8, 8) +- 6 -> points 2 < x < 14: 6 and 10 (and 2: 2 > 2 is false)
  want = np.full((4, 4), C)
  want[1:3, 1:3] = 1
  want[1, 1] = 2  # (6, 6) is in both: the smaller box wins
  np.testing.assert_array_equal(labels, want)
  k = 1 * 4 + 1
  np.testing.assert_allclose(t.boxes[0, k], [4, 4, 8, 8])
  assert float(t.centerness[0, k]) == pytest.approx(1.0)  # (6, 6) is the small box's centre
  k = 1 * 4 + 2  # (10, 6) in the big box: l=10 r=6 t=6 b=10
  assert float(t.centerness[0, k]) == pytest.approx(np.sqrt(6 / 10 * 6 / 10), rel=1e-5)
  assert not bool(t.pos[0, 0])


def test_fcos_targets_inside_box_without_centre_sampling():
  # radius=None (DATE's one-to-many branch): every point strictly inside a box is positive
  pts, st = A.anchor_points(16, (4,))
  ranges = A.regress_ranges_for(st, (4,), ((-1, 1e8),))
  b, lab, valid = _gt([[0, 0, 16, 16], [4, 4, 8, 8]], [1, 2])
  labels = np.asarray(_fcos(pts, st, ranges, b, lab, valid, radius=None).labels[0]).reshape(4, 4)
  want = np.ones((4, 4), int)  # all 16 points lie inside the big box (centre sampling kept 4)
  want[1, 1] = 2               # the smaller box still wins where both hold the point
  np.testing.assert_array_equal(labels, want)
  b, lab, valid = _gt([[3, 3, 10, 10]], [0])  # inside: points 6 (x and y); 2 < 3, 10 is on the edge
  pos = np.asarray(_fcos(pts, st, ranges, b, lab, valid, radius=None).pos[0]).reshape(4, 4)
  assert pos.sum() == 1 and pos[1, 1]
  with pytest.raises(ConfigError, match="radius=0"):
    _fcos(pts, st, ranges, b, lab, valid, radius=0)


def test_fcos_regress_range_routes_by_level():
  pts, st = A.anchor_points(16, (4, 8))
  ranges = A.regress_ranges_for(st, (4, 8), ((-1, 5), (5, 1e8)))
  b, lab, valid = _gt([[0, 0, 16, 16]], [0])
  t = _fcos(pts, st, ranges, b, lab, valid)
  pos = np.asarray(t.pos[0])
  assert not pos[:16].any() and pos[16:].all()  # max distance >= 6 > 5: level 2 only


def test_fcos_empty_ground_truth_is_all_background():
  pts, st = A.anchor_points(16, (4,))
  ranges = A.regress_ranges_for(st, (4,), ((-1, 1e8),))
  b, lab, valid = _gt([], [])
  t = _fcos(pts, st, ranges, b, lab, valid)
  assert (np.asarray(t.labels) == C).all() and not np.asarray(t.pos).any()


def _poto_case():
  pts, st = A.anchor_points(16, (4,))
  n = len(pts)
  b, lab, valid = _gt([[0, 0, 8, 8], [8, 8, 16, 16]], [0, 2])
  # every location predicts the first box well, and points 10 (10,10) and 15 (14,14) predict the second
  pred = np.tile(np.array([[0, 0, 8, 8]], np.float32), (n, 1))
  pred[10] = [8, 8, 16, 16]
  pred[15] = [9, 9, 16, 16]
  logits = np.full((1, n, C), -4.0, np.float32)
  logits[0, 5, 0] = 3.0  # point (6, 6) is the most confident for box 0
  logits[0, 10, 2] = 2.0
  logits[0, 15, 2] = 3.0  # more confident, lower IoU (49/64)
  pred[0] = [8, 8, 16, 16]  # a perfect box at (2, 2), but outside box 1's centre prior
  logits[0, 0, 2] = 5.0
  return pts, st, logits, pred[None], b, lab, valid


def test_poto_matches_each_gt_to_exactly_one_prediction():
  pts, st, logits, pred, b, lab, valid = _poto_case()
  match = jax.jit(lambda *a: A.poto_match(*a, alpha=0.8, radius=1.5))(
      logits, pred, pts, st, b, lab, valid)
  np.testing.assert_array_equal(np.asarray(match), [[5, 10, -1]])
  t = A.one_to_one_targets(match, b, lab, num_points=len(pts), num_classes=C)
  assert int(t.pos.sum()) == 2
  assert int(t.labels[0, 5]) == 0 and int(t.labels[0, 10]) == 2
  np.testing.assert_allclose(t.boxes[0, 10], [8, 8, 16, 16])


def test_poto_quality_formula_and_prior():
  pts, st, logits, pred, b, lab, valid = _poto_case()
  q = np.asarray(jax.jit(lambda *a: A.poto_quality(*a, pts, st, b, lab, valid))(logits, pred))
  p = 1 / (1 + np.exp(-2.0))
  assert q[0, 10, 1] == pytest.approx(p ** 0.2 * 1.0 ** 0.8, rel=1e-5)
  assert q[0, 15, 1] == pytest.approx((1 / (1 + np.exp(-3.0))) ** 0.2 * (49 / 64) ** 0.8, rel=1e-5)
  assert q[0, 0, 1] == 0.0  # the centre prior (12 +- 6, clipped to the box) excludes (2, 2)
  assert (q[0, :, 2] == 0).all()  # padded ground truth


def test_hungarian_is_one_to_one_under_contention():
  # two ground truths both prefer prediction 0: the matching must still be a bijection
  q = np.array([[[0.9, 0.8], [0.5, 0.1], [0.0, 0.0]]], np.float32)
  m = np.asarray(A.hungarian_match(jnp.asarray(q), jnp.array([[True, True]])))
  assert sorted(m[0].tolist()) == [0, 1] and m[0].tolist() == [1, 0]  # 0.5 + 0.8 > 0.9 + 0.1
  empty = np.asarray(A.hungarian_match(jnp.asarray(q), jnp.array([[False, False]])))
  assert empty.tolist() == [[-1, -1]]


def test_hungarian_rejects_bad_shapes():
  with pytest.raises(ShapeError, match="points >= max_gt"):
    A.hungarian_match(jnp.zeros((1, 1, 2)), jnp.ones((1, 2), bool))
  with pytest.raises(ShapeError, match="gt_boxes"):
    A.poto_quality(jnp.zeros((1, 4, C)), jnp.zeros((1, 4, 4)), np.zeros((4, 2), np.float32),
                   np.ones(4, np.float32), jnp.zeros((1, 4)), jnp.zeros((1, 1), int),
                   jnp.ones((1, 1), bool))
