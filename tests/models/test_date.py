"""DATE model: shapes, bad input, a jitted train step that lowers the loss, data parallelism."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxsys.core.errors import ConfigError, ShapeError
from jaxsys.core.mesh import make_mesh
from jaxsys.data.shapes import ShapesConfig, make_shapes
from jaxsys.models.date import (DATE, DATEConfig, date_loss, make_date_train_step, make_detect_fn,
                                train_detector)

TINY = dict(image_size=32, widths=(8, 8, 16, 16), fpn_channels=16, head_convs=1, num_classes=3)


@pytest.fixture(scope="module")
def data():
  return make_shapes(ShapesConfig(image_size=32, num_classes=3, max_objects=3, min_size=6,
                                  max_size=16), seed=0, count=16)


def _batch(d, n=8):
  return d.images[:n], d.boxes[:n], d.labels[:n], d.valid[:n]


def test_outputs_and_same_inference_graph():
  dual = DATE(DATEConfig(**TINY), rngs=nnx.Rngs(0))
  single = DATE(DATEConfig(**TINY, dual=False), rngs=nnx.Rngs(0))
  x = jnp.zeros((2, 32, 32, 3))
  out = dual(x)
  n = DATEConfig(**TINY).num_points
  assert out["o2o_cls"].shape == (2, n, 3) and out["o2m_box"].shape == (2, n, 4)
  assert out["o2m_ctr"].shape == (2, n) and "o2m_cls" not in single(x)
  # inference uses the one-to-one branch only: the same program for both models
  hlo = [jax.jit(lambda m, x: m.detect(x)).lower(m, x).as_text() for m in (dual, single)]
  strip = lambda s: [ln for ln in s.splitlines() if "loc(" not in ln and "module @" not in ln]
  assert len(strip(hlo[0])) == len(strip(hlo[1]))
  det = dual.detect(x)
  assert det["boxes"].shape == (2, 100, 4) and det["valid"].dtype == jnp.bool_


def test_bad_input_errors():
  m = DATE(DATEConfig(**TINY), rngs=nnx.Rngs(0))
  with pytest.raises(ShapeError, match=r"images must be float\[batch, 32, 32, 3\]"):
    m(jnp.zeros((32, 32, 3)))
  with pytest.raises(ShapeError, match="images must be"):
    m(jnp.zeros((1, 16, 16, 3)))
  with pytest.raises(ConfigError, match="image_size=30 must be divisible by 16"):
    DATEConfig(image_size=30)
  with pytest.raises(ConfigError, match="with_o2m=True"):
    DATE(DATEConfig(**TINY, dual=False), rngs=nnx.Rngs(0))(jnp.zeros((1, 32, 32, 3)), with_o2m=True)


def test_empty_ground_truth_gives_finite_background_loss(data):
  m = DATE(DATEConfig(**TINY), rngs=nnx.Rngs(0))
  x, b, lab, v = _batch(data, 2)
  loss, parts = jax.jit(lambda x, b, lab, v: date_loss(m, x, b, lab, v))(x, b, lab, np.zeros_like(v))
  assert np.isfinite(float(loss))
  for k in ("o2o_l1", "o2o_giou", "o2m_iou", "o2m_ctr"):
    assert float(parts[k]) == 0.0, k
  assert float(parts["o2o_cls"]) > 0


@pytest.mark.parametrize("dual", [True, False])
def test_jitted_train_step_decreases_loss(data, dual):
  m = DATE(DATEConfig(**TINY, dual=dual), rngs=nnx.Rngs(0))
  tx = optax.adam(3e-3)
  step, _, params, rest = make_date_train_step(m, tx)
  opt = tx.init(params)
  batch = _batch(data)
  losses = []
  for _ in range(12):
    params, opt, loss, parts, rest = step(params, opt, rest, *batch)
    losses.append(float(loss))
  assert losses[-1] < 0.8 * losses[0], losses
  assert ("o2m_cls" in parts) == dual


def test_data_parallel_step_matches_single_device(data, devices):
  mesh = make_mesh({"data": 8})
  m = DATE(DATEConfig(**TINY), rngs=nnx.Rngs(0))
  tx = optax.sgd(1e-2)
  step, _, params, rest = make_date_train_step(m, tx)
  opt = tx.init(params)
  batch = _batch(data)
  ref = step(params, opt, rest, *batch)
  rep, split = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
  sharded = jax.device_put(batch, split)
  assert len(sharded[0].sharding.device_set) == 8
  out = step(*jax.device_put((params, opt, rest), rep), *sharded)
  np.testing.assert_allclose(float(out[2]), float(ref[2]), rtol=1e-4)
  for a, b in zip(jax.tree.leaves(out[0]), jax.tree.leaves(ref[0])):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-3, atol=1e-5)


def test_train_detector_on_mesh_and_detect_fn(data):
  mesh = make_mesh({"data": 8})
  m = DATE(DATEConfig(**TINY), rngs=nnx.Rngs(0))
  seen = []
  params, rest, graphdef, hist = train_detector(
      m, data, steps=4, batch_size=8, warmup_steps=1, mesh=mesh, eval_every=2,
      on_eval=lambda s, p, r: seen.append(s))
  assert seen == [2, 4] and len(hist) == 4 and all(np.isfinite(h["loss"]) for h in hist)
  det = make_detect_fn(graphdef, nms_iou=0.5)(params, rest, data.images[:2])
  assert det["scores"].shape == (2, 100)
  with pytest.raises(ConfigError, match="divisible by the mesh"):
    train_detector(m, data, steps=1, batch_size=4, mesh=mesh)
