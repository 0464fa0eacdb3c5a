"""COCO-style AP equals pycocotools on random predictions; duplicate rate; bad input."""

import numpy as np
import pytest

from jaxsys.core.errors import InputError
from jaxsys.eval.detection import coco_ap, duplicate_rate, from_batch, pycocotools_ap


def _random_case(seed, images=25, classes=3):
  rng = np.random.default_rng(seed)
  preds, gts = [], []
  for _ in range(images):
    m = int(rng.integers(0, 6))
    xy = rng.uniform(0, 50, (m, 2))
    gb = np.concatenate([xy, xy + rng.uniform(3, 25, (m, 2))], 1)
    gl = rng.integers(0, classes, m)
    n = int(rng.integers(0, 15))
    src = gb[rng.integers(0, m, n)] if m else rng.uniform(0, 50, (n, 4))
    pb = src + rng.normal(0, 3, (n, 4))
    pb[:, 2:] = np.maximum(pb[:, 2:], pb[:, :2] + 0.5)
    preds.append((pb, rng.uniform(size=n), rng.integers(0, classes, n)))
    gts.append((gb, gl))
  return preds, gts


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_ap_equals_pycocotools(seed):
  pytest.importorskip("pycocotools")
  preds, gts = _random_case(seed)
  ours, ref = coco_ap(preds, gts, num_classes=3), pycocotools_ap(preds, gts, num_classes=3)
  for k in ("AP", "AP50", "AP75"):
    assert abs(ours[k] - ref[k]) < 1e-3, (k, ours, ref)
  assert ours["AP50"] > 0.01  # the case is not trivially zero


def test_max_dets_cut_matches_pycocotools():
  pytest.importorskip("pycocotools")
  preds, gts = _random_case(5, images=6)
  ours = coco_ap(preds, gts, num_classes=3, max_dets=3)
  ref = pycocotools_ap(preds, gts, num_classes=3, max_dets=3)
  assert abs(ours["AP"] - ref["AP"]) < 1e-3


def test_perfect_and_duplicates():
  gb = np.array([[0, 0, 10, 10], [20, 20, 30, 30]], float)
  gts = [(gb, np.array([0, 1]))]
  perfect = [(gb, np.array([0.9, 0.8]), np.array([0, 1]))]
  assert coco_ap(perfect, gts, num_classes=2)["AP"] == pytest.approx(1.0)
  assert duplicate_rate(perfect, gts) == 0.0
  dup = [(np.concatenate([gb, gb + 1]), np.array([0.9, 0.8, 0.7, 0.6]), np.array([0, 1, 0, 1]))]
  assert duplicate_rate(dup, gts) == pytest.approx(0.5)
  assert coco_ap(dup, gts, num_classes=2)["AP"] < 1.0


def test_from_batch_and_bad_input():
  boxes = np.zeros((2, 3, 4))
  boxes[0, 0] = [1, 1, 4, 4]
  valid = np.array([[True, False, False], [False, False, False]])
  g = from_batch(boxes, None, np.zeros((2, 3), int), valid)
  assert len(g) == 2 and g[0][0].shape == (1, 4) and g[1][0].shape == (0, 4)
  # an image with no ground truth and no predictions is fine
  assert coco_ap([(np.zeros((0, 4)), np.zeros(0), np.zeros(0, int))] * 2, g, num_classes=1)["AP"] == 0.0
  with pytest.raises(InputError, match="x2 < x1"):
    coco_ap([(np.array([[5, 5, 1, 9]]), np.ones(1), np.zeros(1, int))], [g[0]], num_classes=1)
  with pytest.raises(InputError, match="gts has 2"):
    coco_ap([], g, num_classes=1)
