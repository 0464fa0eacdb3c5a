"""Sequence-parallel attention equals single-device attention: output and gradients.

Every strategy on the 8-device mesh shapes (ring, ulysses) in {(8,1), (1,8), (2,4), (4,2)},
causal and non-causal, GQA 8:2 and MQA, packed segments and bf16 inputs; and every mesh kind
(``jax.make_mesh``'s default Explicit axes, Auto axes, ``jaxsys.core.make_mesh``).
"""

import functools
import os
import sys

import jax.numpy as jnp
import pytest

sys.path.insert(0, os.path.dirname(__file__))

from jaxsys.ops import attention, masks  # noqa: E402
from _sp_helpers import (IMPL, build_mesh, inputs, max_err, mesh_context, out_and_grads,  # noqa: E402
                         packed_segments, sp_vs_reference)

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


# strategy, mesh axes, inside jax.set_mesh, seq (13: padded, then sliced back). Every kind runs
# the first; Explicit axes (where jaxsys programs take two paths) run all three.
KIND_CASES = [("hybrid", {"ring": 2, "ulysses": 2}, False, 16),
              ("zigzag", {"ring": 4}, True, 13),
              ("allgather", {"ring": 1, "ulysses": 1}, True, 16)]


@functools.cache
def _kind_case_reference(s):
  """Inputs (first ``s`` tokens), segments and single-device output + gradients."""
  seg = packed_segments(1, s)
  t = [x[:, :s] for x in inputs(s=16, h=4, hk=2, d=4)]
  ref = lambda q, k, v: attention(q, k, v, mask=CAUSAL, segment_ids=seg, impl="reference")  # noqa: E731
  return t, seg, out_and_grads(ref, *t)


def test_strategies_on_every_mesh_kind(devices, mesh_kind):
  """Explicit axes reject a global gather of sharded tokens (the zigzag restore) and an uneven
  slice (the pad); each case is forward + gradients against the single-device reference."""
  from jaxsys.parallel import sequence_parallel_attention
  for strategy, axes, inside, s in KIND_CASES if mesh_kind == "explicit" else KIND_CASES[:1]:
    t, seg, want = _kind_case_reference(s)
    mesh = build_mesh(mesh_kind, axes)
    sp = lambda q, k, v: sequence_parallel_attention(  # noqa: E731
        q, k, v, mesh=mesh, strategy=strategy, mask=CAUSAL, segment_ids=seg, pad=True, impl=IMPL)
    with mesh_context(mesh, inside):
      got = out_and_grads(sp, *t)
    errs = max_err(got, want)
    assert max(errs) < 1e-5, (strategy, inside, errs)


def test_bf16_inputs(devices):
  got, want = sp_vs_reference("hybrid", (2, 4), mask=CAUSAL, segment_ids=SEG, dtype=jnp.bfloat16)
  assert got[0].dtype == jnp.bfloat16 and got[1][0].dtype == jnp.bfloat16
  errs = max_err(got, want)
  assert max(errs) < 4e-2, errs


@pytest.mark.parametrize("strategy", ["ulysses", "allgather", "ring", "hybrid"])
@pytest.mark.parametrize("dtype", [jnp.bool_, jnp.float32])
def test_dense_mask_is_refused(devices, strategy, dtype):
  """A dense boolean or additive ``mask=`` array is refused by every strategy, never dropped."""
  from jaxsys.parallel import sequence_parallel_attention
  q, k, v, _ = inputs(s=16)
  dense = jnp.asarray(masks.Local(4).dense(16, 16))[None]          # [1, 1, 16, 16]
  dense = dense if dtype == jnp.bool_ else jnp.where(dense, 0.0, -jnp.inf)
  mesh = build_mesh("explicit", {"ring": 2, "ulysses": 4})
  with pytest.raises(NotImplementedError, match=r"mask= as a lazy .*not a dense array"):
    sequence_parallel_attention(q, k, v, mesh=mesh, strategy=strategy, mask=dense)


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
  from jaxsys.models.llm.decoder import Decoder, DecoderConfig
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


def test_decoder_step_under_sp_on_an_explicit_mesh(devices):
  """A decoder loss + gradients with hybrid SP on ``jax.make_mesh``'s Explicit axes, inside the
  mesh context (resharded inputs, explicitly typed activations) == unsharded. Auto axes: the
  test above; Explicit axes without a context run the Auto twin (the strategies test)."""
  import jax
  import optax
  from flax import nnx

  from jaxsys.models.llm.decoder import Decoder, DecoderConfig
  from jaxsys.parallel import sp_attention_fn
  from jaxsys.parallel.zigzag import shifted_lm_batch

  cfg = DecoderConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=1,
                      num_heads=4, num_kv_heads=2)
  tokens = jax.random.randint(jax.random.PRNGKey(3), (1, 17), 0, cfg.vocab_size)
  mesh = build_mesh("explicit", {"ring": 2, "ulysses": 2})

  def loss_and_grads(attention_fn, batch, inside):
    graphdef, params = nnx.split(Decoder(cfg, rngs=nnx.Rngs(0), attention_fn=attention_fn))

    def loss(p):
      logits = nnx.merge(graphdef, p)(batch["inputs"], positions=batch["positions"])
      return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()

    with mesh_context(mesh, inside):
      return jax.jit(jax.value_and_grad(loss))(params)

  l_ref, g_ref = loss_and_grads(None, shifted_lm_batch(tokens, 1), False)
  l_sp, g_sp = loss_and_grads(sp_attention_fn(mesh, "hybrid", impl=IMPL),
                              shifted_lm_batch(tokens, 2), True)
  assert abs(float(l_sp) - float(l_ref)) < 1e-5
  errs = jax.tree.leaves(jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))), g_sp, g_ref))
  assert max(errs) < 1e-5, max(errs)
