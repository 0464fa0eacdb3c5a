"""Ulysses: all-to-all layout, minimal kv-head replication for GQA/MQA, head errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxsys.core.errors import ShapeError
from jaxsys.core.mesh import make_mesh
from jaxsys.parallel import sequence_parallel_attention, ulysses


@pytest.mark.parametrize("hk,size,want", [(2, 8, 8), (1, 8, 8), (8, 4, 8), (4, 4, 4), (2, 4, 4)])
def test_kv_replication_is_minimal_and_keeps_groups(hk, size, want):
  h = 8
  k = jnp.arange(hk, dtype=jnp.float32)[None, None, :, None] * jnp.ones((1, 2, hk, 1))
  rep = ulysses.replicate_kv_heads(k, size)
  assert rep.shape[2] == want
  per_rank_kv = rep.shape[2] // size
  for r in range(size):
    q_heads = range(r * h // size, (r + 1) * h // size)
    kv_local = np.asarray(rep[0, 0, r * per_rank_kv:(r + 1) * per_rank_kv, 0])
    group = (h // size) // per_rank_kv  # query heads per local kv head on the rank
    for i, qh in enumerate(q_heads):
      assert kv_local[i // group] == qh // (h // hk)  # the kv head this query head reads


def test_all_to_all_round_trip(devices):
  mesh = make_mesh({"ulysses": 8})
  x = jnp.arange(2 * 16 * 8 * 3, dtype=jnp.float32).reshape(2, 16, 8, 3)

  def body(x):
    y = ulysses.seq_to_heads(x, "ulysses")  # [b, s, h/P, d]
    return ulysses.heads_to_seq(y, "ulysses"), y

  back, y = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(None, "ulysses"),
                                  out_specs=(P(None, "ulysses"), P(None, None, "ulysses"))))(x)
  np.testing.assert_array_equal(back, x)
  np.testing.assert_array_equal(y, x)  # gathering seq per head group is a pure relayout


def test_heads_that_cannot_be_split():
  mesh = make_mesh({"ring": 1, "ulysses": 8})
  q = jnp.zeros((1, 16, 6, 4))
  k = jnp.zeros((1, 16, 3, 4))
  with pytest.raises(ShapeError, match=r"heads=6 must be divisible by the ulysses degree \(8\)"):
    sequence_parallel_attention(q, k, k, mesh=mesh, strategy="ulysses")
  q = jnp.zeros((1, 16, 24, 4))
  with pytest.raises(ShapeError, match=r"kv_heads=3 must divide or be divisible"):
    sequence_parallel_attention(q, k, k, mesh=mesh, strategy="hybrid")
