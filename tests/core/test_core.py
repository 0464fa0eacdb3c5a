import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxsys.core import bench, errors, mesh, results

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "parallel"))
from _sp_helpers import MESH_KINDS, build_mesh, mesh_context  # noqa: E402


def test_eight_devices(devices):
  assert len(devices) == 8


def test_make_mesh_and_rules():
  m = mesh.make_mesh({"ring": 2, "ulysses": -1})
  assert dict(m.shape) == {"ring": 2, "ulysses": 4}
  assert mesh.logical_to_spec(("batch", "seq", "heads", None), m) == P(None, ("ring", "ulysses"), None, None)
  m2 = mesh.make_mesh({"data": 2, "model": 4})
  assert mesh.logical_to_spec(("batch", "seq", "heads", "kv_heads"), m2) == P("data", None, "model", None)
  one = mesh.make_mesh({"ring": 1}, devices=jax.devices()[:1])
  assert mesh.logical_to_spec(("seq",), one) == P(None)


def test_mesh_errors():
  with pytest.raises(errors.ConfigError, match="need 16 devices"):
    mesh.make_mesh({"ring": 4, "ulysses": 4})
  with pytest.raises(errors.ConfigError, match="at most one -1"):
    mesh.make_mesh({"ring": -1, "ulysses": -1})
  with pytest.raises(errors.ConfigError, match="no rule"):
    mesh.logical_to_spec(("nonsense",))


def test_shard_logically_places_data():
  m = mesh.make_mesh({"data": 8})
  x = jax.jit(lambda a: mesh.shard_logically(a * 2, ("batch", None), m))(jnp.ones((8, 4)))
  assert x.sharding.is_equivalent_to(jax.sharding.NamedSharding(m, P("data", None)), 2)


@pytest.mark.parametrize("kind", MESH_KINDS)
def test_placement_helpers_on_every_mesh_kind(kind):
  m = build_mesh(kind, {"data": 8})
  twin = mesh.program_mesh(m)  # no mesh context: Explicit meshes run on their Auto twin
  assert not mesh.explicit_axes(twin) and twin.devices.tolist() == m.devices.tolist()
  for inside in (False, True):
    with mesh_context(m, inside):
      x = jax.jit(lambda a: mesh.shard_logically(a * 2, ("batch", None), m))(jnp.ones((8, 4)))
      assert x.sharding.is_equivalent_to(NamedSharding(m, P("data", None)), 2)
      assert (mesh.program_mesh(m) is m) == (inside or kind != "explicit")
      # a layout hint never reshards Explicit axes: the array's type decides there
      y = jax.jit(lambda a: mesh.hint(a, P("data", None)))(jnp.ones((8, 4)))
      split = y.sharding.is_equivalent_to(NamedSharding(m, P("data", None)), 2)
      assert split == (inside and kind != "explicit")


def test_decoder_train_step_on_an_explicit_mesh():
  """``jaxsys.train`` with ``mesh=`` a ``jax.make_mesh`` default (Explicit axes), called inside
  the caller's mesh context, == unsharded. (Auto axes: tests/test_train.py.)"""
  import jaxsys.models as M
  from jaxsys import train as T
  from jaxsys.data import synthetic as S
  model_cfg = M.DecoderConfig(vocab_size=128, hidden_size=16, intermediate_size=32, num_layers=1,
                              num_heads=4, num_kv_heads=2)
  cfg = T.TrainConfig(learning_rate=1e-3, warmup_steps=0, total_steps=2, log_every=1)
  batches = lambda s: S.training_batch({"copy": 1.0}, seed=0, step=s, batch_size=4, length=8)  # noqa: E731
  losses = lambda mesh: [r["loss"] for r in T.train(  # noqa: E731
      M.random_model(model_cfg, seed=1), batches, cfg, mesh=mesh, progress=False).history]
  want = losses(None)
  m = build_mesh("explicit", {"data": 2, "model": 2})
  with mesh_context(m, True):
    np.testing.assert_allclose(losses(m), want, rtol=1e-5)


def test_bench_and_memory():
  f = jax.jit(lambda a: (a @ a).sum())
  t = bench.time_fn(f, jnp.ones((64, 64)), iters=3)
  assert len(t.times) >= 3 and t.min <= t.median
  mem = bench.compiled_memory(f, jnp.ones((64, 64)))
  assert mem is None or mem["argument_bytes"] == 64 * 64 * 4
  assert bench.hardware_string().startswith("cpu")


def test_result_writer_and_goals(tmp_path):
  rows = [results.Row("t", "ms", ours=2.0, baseline=8.0, ideal=5.0, goal=">= 0.5 of ideal"),
          results.Row("u", "ms", ours=4.0, baseline=5.0, goal=">= 2"),
          results.Row("acc", "%", ours=81.0, goal=">= 80 (ours)")]
  assert rows[0].ratio == 4.0 and rows[0].met is True
  assert rows[1].met is False
  assert rows[2].met is True
  path = results.write_result("demo", rows, config={"n": 1}, quick=True, out_dir=tmp_path)
  data = json.loads(path.read_text())
  assert data["name"] == "demo" and data["quick"] and len(data["rows"]) == 3
  assert data["rows"][0]["ratio"] == 4.0
  with pytest.raises(errors.ConfigError, match="no rows"):
    results.write_result("empty", [], out_dir=tmp_path)
