import json

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

from jaxsys.core import bench, errors, mesh, results


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
