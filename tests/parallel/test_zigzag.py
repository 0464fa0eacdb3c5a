"""Zigzag (dual-chunk) layout: round trips, chunk placement, batch helper, errors."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxsys.core.errors import ShapeError
from jaxsys.parallel import zigzag as zz


@pytest.mark.parametrize("ring", [1, 2, 4, 8])
def test_round_trip(ring):
  x = np.arange(3 * 64 * 2).reshape(3, 64, 2)
  y = zz.zigzag_reorder(x, ring)
  assert not (ring > 1 and np.array_equal(x, y))
  np.testing.assert_array_equal(zz.zigzag_restore(y, ring), x)
  np.testing.assert_array_equal(np.asarray(zz.zigzag_restore(jnp.asarray(y), ring)), x)


def test_rank_holds_chunks_r_and_2p_minus_1_minus_r():
  p, s = 4, 32
  c = s // (2 * p)
  y = zz.zigzag_reorder(np.arange(s)[None], p)[0]
  for r in range(p):
    shard = y[r * 2 * c:(r + 1) * 2 * c]
    np.testing.assert_array_equal(shard[:c], np.arange(r * c, (r + 1) * c))
    np.testing.assert_array_equal(shard[c:], np.arange((2 * p - 1 - r) * c, (2 * p - r) * c))
    np.testing.assert_array_equal(zz.chunk_starts("zigzag", r, p, 2 * c, xp=np), [r * c, (2 * p - 1 - r) * c])


def test_batch_fields_follow_tokens():
  s = 16
  batch = {"tokens": np.arange(s)[None] + 100, "labels": np.arange(s)[None] + 200,
           "positions": np.arange(s)[None], "segment_ids": (np.arange(s)[None] >= 5).astype(np.int32),
           "meta": "kept"}
  out = zz.zigzag_batch(batch, 2)
  np.testing.assert_array_equal(out["tokens"] - 100, out["positions"])
  np.testing.assert_array_equal(out["labels"] - 200, out["positions"])
  np.testing.assert_array_equal(out["segment_ids"], (out["positions"] >= 5).astype(np.int32))
  assert out["meta"] == "kept"


def test_indivisible_length_is_a_clear_error():
  with pytest.raises(ShapeError, match=r"seq_len=30 must be divisible by 8 = 2 \* ring degree \(4\)"):
    zz.zigzag_reorder(np.zeros((1, 30)), 4)


def test_pad_never_truncates():
  assert zz.pad_len(27, 16) == 32
  assert zz.pad_seq(np.ones((1, 27)), 32).shape == (1, 32)
  with pytest.raises(ShapeError):
    zz.pad_seq(np.ones((1, 33)), 32)


@pytest.mark.parametrize("ring,uly", [(4, 1), (2, 4), (2, 3)])
def test_in_shard_reorder_equals_the_global_one(devices, ring, uly):
  """Inside shard_map, ppermutes of token pieces give the shards of the global zigzag order
  (one piece per rank when ulysses is even, two when it is odd) and restore inverts them."""
  import jax
  from jax.sharding import PartitionSpec as P

  from jaxsys.core.mesh import make_mesh
  mesh = make_mesh({"ring": ring, "ulysses": uly}, devices[:ring * uly])
  x = np.arange(2 * 2 * ring * uly * 2).reshape(2, -1)  # [b, s]: 2 tokens per piece
  spec = P(None, ("ring", "ulysses"))

  def run(f, t):
    body = lambda t: f(t, ring, ("ring", "ulysses"), ring * uly)  # noqa: E731
    return np.asarray(jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec))(t))

  y = zz.zigzag_reorder(x, ring)
  np.testing.assert_array_equal(run(zz.zigzag_reorder_shard, jnp.asarray(x)), y)
  np.testing.assert_array_equal(run(zz.zigzag_restore_shard, jnp.asarray(y)), x)
