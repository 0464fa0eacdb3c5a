"""Sequence-parallel attention equals single-device attention: output and gradients.

Every strategy on the 8-device mesh shapes (ring, ulysses) in {(8,1), (1,8), (2,4), (4,2)},
causal and non-causal, GQA 8:2 and MQA, packed segments and bf16 inputs.
"""

import os
import sys

import jax.numpy as jnp
import pytest

sys.path.insert(0, os.path.dirname(__file__))

from jaxsys.ops import attention, masks  # noqa: E402
from _sp_helpers import IMPL, max_err, packed_segments, sp_vs_reference  # noqa: E402

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


def test_decoder_training_step_under_sp_matches_unsharded(devices):
  """A full decoder loss + gradients with hybrid SP (zigzag data done once) == unsharded."""
  import functools

  import jax
  import numpy as np
  import optax
  from flax import nnx

  from jaxsys.core.mesh import make_mesh
  from jaxsys.models.decoder import Decoder, DecoderConfig
  from jaxsys.parallel import sp_attention_fn
  from jaxsys.parallel.zigzag import shifted_lm_batch

  cfg = DecoderConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1,
                      num_heads=8, num_kv_heads=2)
  mesh = make_mesh({"ring": 2, "ulysses": 4})
  tokens = jax.random.randint(jax.random.PRNGKey(3), (1, 33), 0, cfg.vocab_size)
  seg = jnp.asarray(np.repeat([[0, 1]], [20, 13], axis=1), jnp.int32)

  def loss_of(model, batch):
    logits = model(batch["inputs"], positions=batch["positions"], segment_ids=batch["segment_ids"])
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
    return jnp.sum(ce * batch["loss_mask"]) / jnp.sum(batch["loss_mask"])

  def loss_and_grads(attention_fn, batch):
    model = Decoder(cfg, rngs=nnx.Rngs(0), attention_fn=attention_fn)
    graphdef, params = nnx.split(model)
    fn = jax.jit(jax.value_and_grad(lambda p: loss_of(nnx.merge(graphdef, p), batch)))
    with jax.set_mesh(mesh):
      return fn(params)

  sp = sp_attention_fn(mesh, "hybrid", impl=IMPL)  # zigzag-ordered tokens (data side)
  ref = functools.partial(attention, impl="reference")
  l_sp, g_sp = loss_and_grads(sp, shifted_lm_batch(tokens, 2, segment_ids=seg))
  l_ref, g_ref = loss_and_grads(ref, shifted_lm_batch(tokens, 1, segment_ids=seg))
  assert abs(float(l_sp) - float(l_ref)) < 1e-5
  errs = jax.tree.leaves(jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))), g_sp, g_ref))
  assert max(errs) < 1e-5, max(errs)
