"""The procedural shapes detection data: determinism, valid boxes that match visible pixels."""

import numpy as np
import pytest

from jaxsys.core.errors import ConfigError
from jaxsys.data.shapes import ShapesConfig, make_shapes
from jaxsys.vision.boxes import check_boxes


def test_deterministic_and_sliceable():
  a = make_shapes(seed=3, count=6)
  b = make_shapes(seed=3, start=4, count=2)
  np.testing.assert_array_equal(a.images[4:], b.images)
  np.testing.assert_array_equal(a.boxes[4:], b.boxes)
  c = make_shapes(seed=4, count=6)
  assert not np.array_equal(a.images, c.images)


def test_boxes_are_valid_and_cover_objects():
  cfg = ShapesConfig()
  d = make_shapes(cfg, seed=0, count=40)
  assert d.images.shape == (40, 64, 64, 3) and d.images.dtype == np.float32
  assert 0 <= d.images.min() and d.images.max() <= 1
  check_boxes("boxes", d.boxes, d.valid)
  counts = d.valid.sum(1)
  assert counts.min() >= 1 and counts.max() <= cfg.max_objects and counts.mean() > 2
  assert set(np.unique(d.labels[d.valid])) == set(range(cfg.num_classes))
  # the valid slots come first (padding at the end), padding is zero
  assert all(v[:c].all() and not v[c:].any() for v, c in zip(d.valid, counts))
  assert (d.boxes[~d.valid] == 0).all()
  sides = np.minimum(d.boxes[..., 2] - d.boxes[..., 0], d.boxes[..., 3] - d.boxes[..., 1])[d.valid]
  assert sides.min() >= 2 and sides.max() <= cfg.image_size


def test_config_errors():
  with pytest.raises(ConfigError, match="max_size=80 must be <= image_size=64"):
    ShapesConfig(max_size=80)
  with pytest.raises(ConfigError, match="num_classes=9"):
    ShapesConfig(num_classes=9)
  with pytest.raises(ConfigError, match="count=0"):
    make_shapes(seed=0, count=0)
