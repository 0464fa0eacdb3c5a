"""Decode attention over pages (XLA path) against the dense attention reference."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsys.core.errors import ConfigError, ShapeError
from jaxsys.ops import attention, masks
from jaxsys.ops.paged_attention import PAGES_PER_SPLIT, default_num_splits, paged_decode_attention
from jaxsys.serving import page_select
from jaxsys.serving.paged_cache import quantize_int8


def _paged(rng, b=2, h=8, hk=2, d=16, page=8, lengths=(37, 20), extra_pages=3):
  """Random contiguous k/v, the same tokens scattered into a shuffled page pool."""
  t = max(lengths)
  m = -(-t // page)
  n = b * m + extra_pages
  k = rng.standard_normal((b, m * page, hk, d)).astype(np.float32)
  v = rng.standard_normal((b, m * page, hk, d)).astype(np.float32)
  perm = rng.permutation(n)[:b * m].reshape(b, m).astype(np.int32)
  kp = np.zeros((n, hk, page, d), np.float32)
  vp = np.zeros_like(kp)
  for i in range(b):
    for j in range(m):
      kp[perm[i, j]] = k[i, j * page:(j + 1) * page].transpose(1, 0, 2)
      vp[perm[i, j]] = v[i, j * page:(j + 1) * page].transpose(1, 0, 2)
  q = rng.standard_normal((b, h, d)).astype(np.float32)
  return q, k, v, kp, vp, perm, np.asarray(lengths, np.int32)


@functools.partial(jax.jit, static_argnames="mask")
def _dense(q, k, v, lengths, mask=None):
  return attention(jnp.asarray(q)[:, None], jnp.asarray(k), jnp.asarray(v), mask=mask, impl="reference",
                   q_offset=jnp.asarray(lengths) - 1, kv_lengths=jnp.asarray(lengths))[:, 0]


@pytest.mark.parametrize("num_splits", [1, 3])
def test_all_pages_equals_dense(num_splits):
  q, k, v, kp, vp, bt, lengths = _paged(np.random.default_rng(0))
  idx, num = page_select.all_pages(jnp.asarray(bt), jnp.asarray(lengths), kp.shape[1], page_size=kp.shape[2])
  out, lse = paged_decode_attention(q, kp, vp, idx, num, jnp.asarray(lengths), num_splits=num_splits,
                                    return_lse=True)
  ref = _dense(q, k, v, lengths)
  np.testing.assert_allclose(out, ref, atol=1e-5, rtol=1e-5)
  assert lse.shape == (2, 8) and np.all(np.isfinite(lse))


def test_streaming_mask_equals_sink_local():
  q, k, v, kp, vp, bt, lengths = _paged(np.random.default_rng(1), lengths=(45, 30))
  idx, num = page_select.all_pages(jnp.asarray(bt), jnp.asarray(lengths), kp.shape[1], page_size=kp.shape[2])
  out = paged_decode_attention(q, kp, vp, idx, num, jnp.asarray(lengths), sink=4, window=10)
  ref = _dense(q, k, v, lengths, mask=masks.Sink(4) | masks.Local(10))
  np.testing.assert_allclose(out, ref, atol=1e-5, rtol=1e-5)


def test_subset_of_pages_equals_masked_dense():
  rng = np.random.default_rng(2)
  q, k, v, kp, vp, bt, lengths = _paged(rng, b=1, lengths=(40,))
  chosen = np.array([[[0, 2, 4], [1, 4, -1]]], np.int32)  # per kv head; -1 = empty slot
  idx = page_select.physical_pages(jnp.asarray(bt), jnp.asarray(chosen))
  out = paged_decode_attention(q, kp, vp, idx, jnp.asarray(chosen), jnp.asarray(lengths))
  page = kp.shape[2]
  for kvh in range(2):
    keep = np.zeros(k.shape[1], bool)
    for c in chosen[0, kvh]:
      if c >= 0:
        keep[c * page:(c + 1) * page] = True
    keep &= np.arange(k.shape[1]) < lengths[0]
    for hq in range(kvh * 4, kvh * 4 + 4):
      s = (k[0, keep, kvh] @ q[0, hq]) / np.sqrt(q.shape[-1])
      p = np.exp(s - s.max())
      ref = (p / p.sum()) @ v[0, keep, kvh]
      np.testing.assert_allclose(out[0, hq], ref, atol=1e-5, rtol=1e-5)


def test_int8_pages_close_to_float():
  q, k, v, kp, vp, bt, lengths = _paged(np.random.default_rng(3))
  kq, ks = quantize_int8(jnp.asarray(kp))
  vq, vs = quantize_int8(jnp.asarray(vp))
  idx, num = page_select.all_pages(jnp.asarray(bt), jnp.asarray(lengths), kp.shape[1], page_size=kp.shape[2])
  out = paged_decode_attention(q, kq, vq, idx, num, jnp.asarray(lengths), k_scales=ks, v_scales=vs)
  ref = _dense(q, k, v, lengths)
  err = float(jnp.max(jnp.abs(out - ref)))
  assert 0 < err < 3e-2


def test_empty_selection_gives_zeros_and_minus_inf():
  q, k, v, kp, vp, bt, lengths = _paged(np.random.default_rng(4))
  num = -jnp.ones((2, 2, 3), jnp.int32)
  out, lse = paged_decode_attention(q, kp, vp, jnp.zeros_like(num), num, jnp.asarray(lengths), return_lse=True)
  assert np.all(np.asarray(out) == 0) and np.all(np.isneginf(lse))


def test_bad_inputs():
  q, k, v, kp, vp, bt, lengths = _paged(np.random.default_rng(5))
  idx, num = page_select.all_pages(jnp.asarray(bt), jnp.asarray(lengths), 2, page_size=8)
  with pytest.raises(ShapeError, match="heads=7"):
    paged_decode_attention(q[:, :7], kp, vp, idx, num, jnp.asarray(lengths))
  with pytest.raises(ShapeError, match="lengths"):
    paged_decode_attention(q, kp, vp, idx, num, jnp.asarray(lengths)[:1])
  with pytest.raises(ConfigError, match="sink"):
    paged_decode_attention(q, kp, vp, idx, num, jnp.asarray(lengths), window=4)
  with pytest.raises(ShapeError, match="int8"):
    paged_decode_attention(q, kp.astype(jnp.int8), vp.astype(jnp.int8), idx, num, jnp.asarray(lengths))
  with pytest.raises(NotImplementedError, match="GPU"):
    paged_decode_attention(q, kp, vp, idx, num, jnp.asarray(lengths), impl="pallas")


def test_default_num_splits_pads_least():
  assert PAGES_PER_SPLIT == 8
  # 64 selected pages + the newest-page slot: 13 x 5 (no padding) rather than 9 x 8 (7 slots)
  assert default_num_splits(65) == 13
  assert [default_num_splits(k) for k in (1, 5, 8, 9, 256, 1024)] == [1, 1, 1, 3, 32, 128]
  for k in range(1, 300):
    s = default_num_splits(k)
    s0 = -(-k // 8)
    assert s0 <= s <= 2 * s0 and s * -(-k // s) - k <= s0 * -(-k // s0) - k


def test_int8_pages_fall_back_inside_the_dispatcher(monkeypatch):
  """Where "auto" tries the Pallas kernel first (a GPU), int8 pages are refused by the kernel and
  served by "xla" through the dispatcher: callers (LServe's layers) pass ``impl`` on untouched."""
  from jaxsys.ops import paged_attention as pa
  q, k, v, kp, vp, bt, lengths = _paged(np.random.default_rng(3))
  kq, ks = quantize_int8(jnp.asarray(kp))
  vq, vs = quantize_int8(jnp.asarray(vp))
  idx, num = page_select.all_pages(jnp.asarray(bt), jnp.asarray(lengths), kp.shape[1], page_size=kp.shape[2])
  args = (q, kq, vq, idx, num, jnp.asarray(lengths))
  want = paged_decode_attention(*args, k_scales=ks, v_scales=vs, impl="xla")
  monkeypatch.setattr(pa.PAGED_DECODE, "_auto", lambda: ("pallas", "xla"))
  with pytest.raises(NotImplementedError):
    paged_decode_attention(*args, k_scales=ks, v_scales=vs, impl="pallas")
  got = paged_decode_attention(*args, k_scales=ks, v_scales=vs, impl="auto")
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
