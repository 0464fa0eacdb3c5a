"""Packed mixed-bit format: exact round trip for every bitwidth, ragged groups, errors."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxsys.core.errors import ConfigError, InputError
from jaxsys.quant import a2q
from jaxsys.quant.packing import (code_range, dequantize, pack_codes, pack_features, pack_rows,
                                  unpack_codes, unpack_rows, words_per_row)


@pytest.mark.parametrize("signed", [False, True])
@pytest.mark.parametrize("bits", range(1, 9))
def test_pack_rows_exact_every_bitwidth(bits, signed):
  rng = np.random.default_rng(bits)
  lo, hi = code_range(bits, signed)
  for f in (1, 33, 70):
    codes = rng.integers(lo, hi, endpoint=True, size=(5, f))
    codes[0, :] = hi  # extremes
    codes[1, :] = lo
    w = pack_rows(jnp.asarray(codes), bits, signed)
    assert w.dtype == jnp.uint32 and w.shape == (5, words_per_row(f, bits))
    np.testing.assert_array_equal(unpack_rows(w, bits, f, signed), codes)


@pytest.mark.parametrize("signed", [False, True])
def test_ragged_groups_round_trip(signed):
  rng = np.random.default_rng(0)
  n, f = 61, 45
  # Ragged: bitwidth 2 has one node, 5 none, others random sizes.
  bits = rng.choice([1, 3, 4, 6, 7, 8], size=n)
  bits[7] = 2
  codes = np.stack([rng.integers(*code_range(int(b), signed), endpoint=True, size=f) for b in bits])
  scales = rng.uniform(0.1, 1.0, n).astype(np.float32)
  pk = pack_codes(codes, bits, scales, signed=signed)
  assert 5 not in pk.bits and 2 in pk.bits
  assert [int(i.size) for i in pk.node_ids] == [int((bits == b).sum()) for b in pk.bits]
  np.testing.assert_array_equal(unpack_codes(pk), codes)
  np.testing.assert_allclose(dequantize(pk), codes * scales[:, None], rtol=1e-6)
  assert pk.payload_bytes < pk.float32_bytes
  np.testing.assert_allclose(pk.average_bits(), bits.mean())


def test_pack_features_equals_a2q_forward():
  rng = np.random.default_rng(3)
  x = rng.uniform(0, 1, (20, 13)).astype(np.float32)
  bits = rng.integers(1, 9, 20)
  scales = (x.max(1) / (2.0 ** bits - 1)).astype(np.float32)
  pk = pack_features(x, bits, scales, signed=False)
  ref = a2q.a2q_quantize(jnp.asarray(x), jnp.asarray(scales)[:, None],
                         jnp.asarray(bits, jnp.float32)[:, None], False)
  np.testing.assert_allclose(dequantize(pk), ref, rtol=1e-6, atol=1e-7)


def test_bad_input():
  codes = np.zeros((3, 4), np.int32)
  with pytest.raises(ConfigError, match=r"\[1, 8\]"):
    pack_codes(codes, np.array([1, 9, 2]), np.ones(3), signed=False)
  with pytest.raises(ConfigError, match=r"\[1, 8\]"):
    pack_codes(codes, np.array([0, 1, 2]), np.ones(3), signed=False)
  with pytest.raises(InputError, match="codes of 2-bit rows"):
    pack_codes(np.full((3, 4), 4), np.array([2, 2, 2]), np.ones(3), signed=False)
  with pytest.raises(InputError, match="codes of 3-bit rows"):
    pack_codes(np.full((3, 4), -4), np.array([3, 3, 3]), np.ones(3), signed=True)
