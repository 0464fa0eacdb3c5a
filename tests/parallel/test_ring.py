"""Ring attention internals: log-sum-exp merge, zigzag work balance, shard-level use, masks."""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

sys.path.insert(0, os.path.dirname(__file__))
from _sp_helpers import IMPL, inputs  # noqa: E402

from jaxsys.core.mesh import make_mesh  # noqa: E402
from jaxsys.ops import attention, masks  # noqa: E402
from jaxsys.parallel import ring, zigzag  # noqa: E402


def test_merge_equals_attention_over_the_union():
  q, k, v, _ = inputs(s=16, hk=2)
  full, lse = attention(q, k, v, return_lse=True, impl="reference")
  a = attention(q, k[:, :7], v[:, :7], q_offset=0, return_lse=True, impl="reference")
  b = attention(q, k[:, 7:], v[:, 7:], q_offset=0, return_lse=True, impl="reference")
  o, l = ring.merge(a[0].astype(jnp.float32), a[1], b[0].astype(jnp.float32), b[1])
  np.testing.assert_allclose(o, full, atol=1e-6)
  np.testing.assert_allclose(l, lse, atol=1e-6)


def test_merge_with_empty_rows_is_finite():
  o = jnp.ones((1, 2, 1, 3))
  lse = jnp.array([[[-jnp.inf, 0.5]]])
  out, l = ring.merge(o * 0, jnp.full_like(lse, -jnp.inf), o, lse)
  assert np.isfinite(np.asarray(out)).all()
  np.testing.assert_array_equal(np.asarray(out[0, 0]), 0.0)  # a row no key sees outputs zeros
  np.testing.assert_allclose(np.asarray(out[0, 1]), 1.0)
  assert np.isneginf(l[0, 0, 0]) and l[0, 0, 1] == pytest.approx(0.5)


@pytest.mark.parametrize("p", [2, 4, 8])
def test_zigzag_balances_causal_work(p):
  n = 4 * 2  # local tokens
  zig = ring.schedule_work("zigzag", p, n, masks.Causal())
  con = ring.schedule_work("contiguous", p, n, masks.Causal())
  assert zig.max() / zig.mean() == pytest.approx(1.0)
  assert con.max() / con.mean() == pytest.approx(2 * p / (p + 1))
  assert zig.sum() <= con.sum() * 1.01 + n * n  # no extra total work beyond the diagonal split


def test_shard_level_inside_a_model_shard_map(devices):
  """The low-level form runs inside a caller's shard_map on zigzag-ordered shards."""
  p = 4
  mesh = make_mesh({"ring": p}, devices[:p])
  q, k, v, _ = inputs(s=32, hk=2)
  qz, kz, vz = (zigzag.zigzag_reorder(t, p) for t in (q, k, v))

  def body(q, k, v):
    return ring.ring_attention_shard(q, k, v, axis="ring", size=p, layout="zigzag",
                                     mask=masks.Local(5), impl=IMPL)

  out = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(None, "ring"), out_specs=P(None, "ring"),
                              check_vma=False))(qz, kz, vz)
  want = attention(q, k, v, mask=masks.Local(5), impl="reference")
  np.testing.assert_allclose(zigzag.zigzag_restore(out, p), want, atol=1e-5)


def test_ring_rejects_position_dependent_masks():
  with pytest.raises(NotImplementedError, match="translation-invariant"):
    ring.RingSpec(axis="ring", size=2, mask=masks.Sink(4))
