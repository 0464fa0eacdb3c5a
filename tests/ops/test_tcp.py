"""TP / TCP packing against a naive per-ray loop (empty rays, all-valid rays, buckets)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsys.core.errors import InputError, ShapeError
from jaxsys.ops.tcp import check_fits, gather, pack_sizes, scatter, tcp_pack, tp_pack


def naive_tcp(x, valid):
  """Per-ray loop: valid samples of each non-empty ray, in order, padded to the longest."""
  rows = [x[r][valid[r]] for r in range(x.shape[0]) if valid[r].any()]
  T = max((len(r) for r in rows), default=0)
  out = np.zeros((T, len(rows), x.shape[-1]), x.dtype)
  for j, r in enumerate(rows):
    out[:len(r), j] = r
  return out


def _mask(seed, R=9, S=13):
  rng = np.random.default_rng(seed)
  valid = rng.random((R, S)) < 0.4
  valid[2] = False          # an empty ray
  valid[5] = True           # an all-valid ray
  valid[0, :] = False
  return valid


@pytest.mark.parametrize("seed", [0, 1])
def test_tcp_matches_naive_loop(seed):
  valid = _mask(seed)
  x = np.random.default_rng(seed + 10).normal(size=valid.shape + (4,)).astype(np.float32)
  want = naive_tcp(x, valid)
  T, Rp = pack_sizes(valid, "tcp")
  assert (T, Rp) == want.shape[:2] == (13, 7)
  idx = tcp_pack(jnp.asarray(valid), max_len=T, max_rays=Rp)
  np.testing.assert_array_equal(np.asarray(gather(jnp.asarray(x), idx)), want)
  # A larger bucket: same entries, zero padding; scatter restores the valid samples.
  big = tcp_pack(jnp.asarray(valid), max_len=16, max_rays=16)
  packed = np.asarray(gather(jnp.asarray(x), big))
  np.testing.assert_array_equal(packed[:T, :Rp], want)
  assert not packed[T:].any() and not packed[:, Rp:].any()
  back = np.asarray(scatter(jnp.asarray(packed), big, *valid.shape))
  np.testing.assert_array_equal(back, np.where(valid[..., None], x, 0))
  check_fits(valid, big)
  with pytest.raises(InputError, match="bucket is too small"):
    check_fits(valid, tcp_pack(jnp.asarray(valid), max_len=T - 1, max_rays=Rp))


def test_tcp_jits_and_differentiates():
  valid = jnp.asarray(_mask(3))
  x = jnp.asarray(np.random.default_rng(4).normal(size=valid.shape + (2,)), jnp.float32)
  f = jax.jit(lambda v, a: gather(a, tcp_pack(v, max_len=16, max_rays=8)).sum())
  g = jax.grad(lambda a: f(valid, a))(x)
  np.testing.assert_array_equal(np.asarray(g), np.broadcast_to(np.asarray(valid)[..., None], x.shape))


def test_tp_keeps_steps():
  valid = _mask(5)
  x = np.random.default_rng(6).normal(size=valid.shape + (3,)).astype(np.float32)
  T, R = pack_sizes(valid, "tp")
  steps = np.nonzero(valid.any(0))[0]
  assert (T, R) == (steps[-1] - steps[0] + 1, valid.shape[0])
  idx = tp_pack(jnp.asarray(valid), max_len=T)
  got = np.asarray(gather(jnp.asarray(x), idx))
  want = np.where(valid[..., None], x, 0)[:, steps[0]:steps[0] + T].transpose(1, 0, 2)
  np.testing.assert_array_equal(got, want)
  back = np.asarray(scatter(jnp.asarray(got), idx, *valid.shape))
  np.testing.assert_array_equal(back, np.where(valid[..., None], x, 0))


def test_all_empty_and_bad_input():
  valid = np.zeros((4, 6), bool)
  assert pack_sizes(valid, "tcp") == (0, 0)
  idx = tcp_pack(jnp.asarray(valid), max_len=2, max_rays=2)
  assert not np.asarray(idx.valid).any()
  with pytest.raises(ShapeError, match="valid must be bool"):
    tcp_pack(jnp.ones((3,), bool), max_len=2, max_rays=2)
  with pytest.raises(InputError, match="max_len=0"):
    tcp_pack(jnp.asarray(valid), max_len=0, max_rays=2)
  with pytest.raises(InputError, match="mode='x'"):
    pack_sizes(valid, "x")
