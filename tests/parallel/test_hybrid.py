"""2D (ring x ulysses) attention: plan resolution, mesh/axis errors, communication accounting."""

import jax.numpy as jnp
import pytest

from jaxsys.core.errors import ConfigError, ShapeError
from jaxsys.core.mesh import make_mesh
from jaxsys.parallel import api, sequence_parallel_attention
from jaxsys.parallel.hybrid import hybrid_comm_elements


def test_plans_on_a_2d_mesh(devices):
  mesh = make_mesh({"ring": 2, "ulysses": 4})
  hy = api.make_plan(mesh, "hybrid")
  assert (hy.ring_axes, hy.ulysses_axes, hy.ring_size, hy.ulysses_size) == (("ring",), ("ulysses",), 2, 4)
  assert hy.layout == "zigzag" and hy.chunk_multiple() == 16
  zz = api.make_plan(mesh, "zigzag")
  assert zz.ring_axes == ("ring", "ulysses") and zz.ring_size == 8
  uly = api.make_plan(mesh, "ulysses")
  assert uly.ulysses_axes == ("ring", "ulysses") and uly.ulysses_size == 8


def test_custom_axis_names(devices):
  mesh = make_mesh({"data": 2, "cp": 2, "sp": 2})
  plan = api.make_plan(mesh, "hybrid", ring_axis="cp", ulysses_axis="sp")
  assert plan.batch_axis == "data" and plan.seq_axes == ("cp", "sp")


def test_mesh_missing_an_axis(devices):
  q = jnp.zeros((1, 16, 8, 4))
  with pytest.raises(ConfigError, match=r"needs mesh axes \('ring', 'ulysses'\).*missing \['ulysses'\]"):
    sequence_parallel_attention(q, q, q, mesh=make_mesh({"ring": 8}), strategy="hybrid")
  with pytest.raises(ConfigError, match="needs a sequence-parallel mesh axis"):
    sequence_parallel_attention(q, q, q, mesh=make_mesh({"data": 8}), strategy="ring")
  with pytest.raises(ConfigError, match="strategy='spiral' must be one of"):
    sequence_parallel_attention(q, q, q, mesh=make_mesh({"ring": 8}), strategy="spiral")


def test_length_not_divisible_without_padding(devices):
  mesh = make_mesh({"ring": 2, "ulysses": 4})
  q = jnp.zeros((1, 24, 8, 4))
  msg = r"seq_len=24 must be divisible by 16 = 2 \* ring degree \(2\) \* ulysses degree \(4\).*pad=True"
  with pytest.raises(ShapeError, match=msg):
    sequence_parallel_attention(q, q, q, mesh=mesh, strategy="hybrid")


def test_self_attention_only(devices):
  mesh = make_mesh({"ring": 8})
  with pytest.raises(ShapeError, match="self-attention"):
    sequence_parallel_attention(jnp.zeros((1, 16, 8, 4)), jnp.zeros((1, 32, 8, 4)),
                                jnp.zeros((1, 32, 8, 4)), mesh=mesh, strategy="ring")


def test_hybrid_ring_traffic_shrinks_with_ulysses_degree():
  b, s, h, hk, d = 1, 1024, 8, 8, 16
  pure_ring = hybrid_comm_elements(b, s, h, hk, d, 8, 1)
  hybrid = hybrid_comm_elements(b, s, h, hk, d, 2, 4)
  assert pure_ring["all-to-all"] == 0
  assert hybrid["collective-permute"] * 4 < pure_ring["collective-permute"]
  assert sum(hybrid.values()) < sum(pure_ring.values())
