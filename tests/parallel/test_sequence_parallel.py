"""Sequence-parallel attention equals single-device attention: output and gradients.

Every strategy on the 8-device mesh shapes (ring, ulysses) in {(8,1), (1,8), (2,4), (4,2)},
causal and non-causal, GQA 8:2 and MQA, packed segments and bf16 inputs.
"""

import os
import sys

import jax.numpy as jnp
import pytest

sys.path.insert(0, os.path.dirname(__file__))

from jaxsys.ops import masks  # noqa: E402
from _sp_helpers import max_err, packed_segments, sp_vs_reference  # noqa: E402

CAUSAL, FULL = masks.Causal(), None
SEG = packed_segments(1, 32)

CASES = [
    # strategy, (ring, ulysses), mask, kv_heads, segments
    ("hybrid", (2, 4), CAUSAL, 2, SEG),
    ("hybrid", (4, 2), FULL, 1, None),
    ("hybrid", (8, 1), CAUSAL, 1, SEG),
    ("hybrid", (1, 8), CAUSAL, 2, None),
    ("zigzag", (8, 1), CAUSAL, 2, SEG),
    ("zigzag", (2, 4), FULL, 2, None),
    ("ring", (8, 1), CAUSAL, 2, None),
    ("ring", (4, 2), FULL, 1, SEG),
    ("ulysses", (1, 8), CAUSAL, 1, SEG),
    ("ulysses", (2, 4), FULL, 2, None),
    ("allgather", (2, 4), CAUSAL, 2, SEG),
]


@pytest.mark.parametrize("strategy,shape,mask,hk,seg", CASES,
                         ids=[f"{c[0]}-{c[1][0]}x{c[1][1]}-{'causal' if c[2] else 'full'}-"
                              f"kv{c[3]}-{'seg' if c[4] is not None else 'noseg'}" for c in CASES])
def test_matches_single_device_f32(devices, strategy, shape, mask, hk, seg):
  got, want = sp_vs_reference(strategy, shape, mask=mask, segment_ids=seg, hk=hk)
  errs = max_err(got, want)
  assert max(errs) < 1e-5, dict(zip(["out", "dq", "dk", "dv"], errs))


def test_bf16_inputs(devices):
  got, want = sp_vs_reference("hybrid", (2, 4), mask=CAUSAL, segment_ids=SEG, dtype=jnp.bfloat16)
  assert got[0].dtype == jnp.bfloat16 and got[1][0].dtype == jnp.bfloat16
  errs = max_err(got, want)
  assert max(errs) < 4e-2, errs


def test_padding_unaligned_length(devices):
  """s=27 is not a multiple of 2*2*4; pad=True pads (a separate segment) and slices back."""
  got, want = sp_vs_reference("hybrid", (2, 4), mask=CAUSAL, s=27, pad=True)
  assert got[0].shape == (1, 27, 8, 8)
  assert max(max_err(got, want)) < 1e-5
