"""The procedural scene: exact intersections, deterministic by seed, held-out views."""

import numpy as np
import pytest

from jaxsys.core.errors import ConfigError
from jaxsys.data import scenes


def test_trace_hits_and_background():
  s = scenes.Scene(spheres=(scenes.Sphere((0, 0, 0), 0.5, (1, 0, 0)),), cuboids=(),
                   light=(0, 0, 1), specular=0.0, ambient=0.0)
  o = np.array([[0, 0, 3.0], [2, 2, 3.0]])
  d = np.array([[0, 0, -1.0], [0, 0, -1.0]])
  c = scenes.trace(s, o, d)
  np.testing.assert_allclose(c[0], [1, 0, 0], atol=1e-6)   # normal == light: full Lambert
  np.testing.assert_allclose(c[1], [1, 1, 1])              # miss: white background


def test_dataset_deterministic_and_split():
  a_tr, a_te = scenes.render_dataset(scenes.make_scene(1), num_views=6, num_test=2, size=8, seed=3)
  b_tr, _ = scenes.render_dataset(scenes.make_scene(1), num_views=6, num_test=2, size=8, seed=3)
  assert a_tr.images.shape == (4, 8, 8, 3) and len(a_te) == 2
  np.testing.assert_array_equal(a_tr.images, b_tr.images)
  assert (a_tr.images < 0.99).any() and (a_tr.images > 0.99).any()   # objects and background
  np.testing.assert_allclose(np.linalg.norm(a_tr.rays_d, axis=-1), 1, atol=1e-5)
  with pytest.raises(ConfigError, match="num_test=6"):
    scenes.render_dataset(scenes.make_scene(0), num_views=6, num_test=6, size=8)
