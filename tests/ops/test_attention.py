"""attention(): the blockwise XLA path (and the public dispatcher) against a naive dense reference.

The reference is softmax(QK^T)V computed in f32 at HIGHEST precision (reference.py); forward,
lse and gradients (dq, dk, dv, including the lse cotangent) must match within 1e-5 (f32) and
2e-2 (bf16). Small blocks (16) make every case span several q/kv blocks.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsys.core.bench import compiled_memory
from jaxsys.core.errors import InputError, ShapeError
from jaxsys.ops import attention, masks as M
from jaxsys.ops.attn import common, layout, reference, xla

TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}


def _inputs(b, tq, tk, h, hk, d, dtype=jnp.float32, seed=0):
  ks = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(ks[0], (b, tq, h, d), jnp.float32).astype(dtype)
  k = jax.random.normal(ks[1], (b, tk, hk, d), jnp.float32).astype(dtype)
  v = jax.random.normal(ks[2], (b, tk, hk, d), jnp.float32).astype(dtype)
  ct = jax.random.normal(ks[3], (b, tq, h, d), jnp.float32)
  return q, k, v, ct


def _fn(impl, kw, block=(16, 16)):
  def f(q, k, v):
    args = common.validate(q, k, v, **kw)
    if impl == "reference":
      return reference.attention_reference(args)
    sizes = block if isinstance(block, xla.XlaBlockSizes) else xla.XlaBlockSizes(*block)
    return xla.blockwise_attention(args, sizes)
  return f


def _fwd_bwd(f, ct):
  """One jitted program: ``(out, lse, (dq, dk, dv))`` with cotangents on out and on finite lse."""
  def run(q, k, v):
    (out, lse), vjp = jax.vjp(f, q, k, v)
    dlse = jnp.where(jnp.isfinite(lse), 0.5, 0.0)
    return out, lse, vjp((ct.astype(out.dtype), dlse))
  return lambda *a: fast_compile(run, *a)(*a)


# Tests are compile-bound: skipping LLVM's expensive passes halves compile time on CPU.
_FAST = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def fast_compile(fn, *args):
  return jax.jit(fn).lower(*args).compile(_FAST)


def check_against_reference(q, k, v, ct, kw, block=(16, 16)):
  """Forward, lse and (dq, dk, dv) of the blockwise path vs the dense f32 reference."""
  tol = TOL[q.dtype.type]
  f32 = lambda x: x.astype(jnp.float32)
  o_r, l_r, g_r = _fwd_bwd(_fn("reference", kw), ct)(f32(q), f32(k), f32(v))
  o, l, g = _fwd_bwd(_fn("xla", kw, block), ct)(q, k, v)
  assert o.dtype == q.dtype and l.dtype == jnp.float32
  np.testing.assert_allclose(f32(o), o_r, atol=tol, rtol=tol)
  np.testing.assert_array_equal(np.isfinite(l), np.isfinite(l_r))
  np.testing.assert_allclose(jnp.where(jnp.isfinite(l), l, 0), jnp.where(jnp.isfinite(l_r), l_r, 0),
                             atol=tol, rtol=tol)
  for name, a, b in zip(("dq", "dk", "dv"), g, g_r):
    assert a.dtype == q.dtype
    assert bool(jnp.all(jnp.isfinite(f32(a)))), name
    scale = max(1.0, float(jnp.max(jnp.abs(b))))
    np.testing.assert_allclose(f32(a), b, atol=tol * scale, rtol=tol, err_msg=name)
  return o, l


_LAYOUT = np.random.RandomState(1).rand(4, 3, 4) < 0.45
_R = np.random.RandomState(3)
_DENSE_MASK = jnp.asarray((_R.rand(2, 1, 24, 24) < 0.5) | np.eye(24, dtype=bool))        # [b, 1, q, k]
_ADDITIVE = jnp.asarray(np.where(_R.rand(1, 4, 20, 28) < 0.3, -np.inf, 0.0), jnp.float32)  # [1, h, q, k]
_BIAS = jnp.asarray(_R.randn(1, 1, 20, 28), jnp.float32)
_SEG = np.repeat([0, 1, 2], [60, 70, 30])
# a packed-documents mask written out densely (causal within each of 3 documents): block-structured,
# so ops.attention turns it into a masks.Dense layout whose empty tiles are skipped
_DOC_MASK = jnp.asarray((_SEG[:, None] == _SEG[None, :]) & np.tri(160, dtype=bool))[None, None]
_CASES = {
    # name: (b, tq, tk, h, hk, d, kwargs)
    "full": (2, 40, 40, 2, 2, 16, {}),
    "causal_gqa4": (1, 48, 48, 4, 1, 16, {"mask": M.Causal()}),
    "causal_gqa8_rect": (1, 24, 56, 16, 2, 8, {"mask": M.Causal()}),
    "mqa_local_sink": (2, 45, 45, 4, 1, 8, {"mask": M.Sink(3) | M.Local(9)}),
    "multihead_streaming": (1, 40, 40, 4, 2, 8, {"mask": M.MultiHead(
        [M.Causal(), M.Sink(2) | M.Local(6), M.Full(), M.Local(20) & M.Causal()])}),
    "block_sparse_random": (1, 40, 64, 4, 2, 8, {"mask": M.BlockSparse(_LAYOUT, 16, 16, M.Causal())}),
    "block_sparse_shared_coarse": (2, 64, 64, 2, 1, 8, {"mask": M.BlockSparse(
        np.array([[1, 0], [1, 1]], bool), 32, 32)}),
    "packed_segments": (2, 50, 50, 4, 2, 8, {"mask": M.Causal(), "segment_ids": jnp.array(
        [[0] * 13 + [1] * 20 + [2] * 17, [5] * 40 + [7] * 10])}),
    "decode_traced_offset": (2, 1, 53, 4, 2, 16, {"mask": M.Causal(), "q_offset": jnp.array([20, 52]),
                                                  "kv_lengths": jnp.array([21, 53])}),
    "chunk_static_offset": (1, 7, 53, 2, 1, 8, {"mask": M.Sink(4) | M.Local(12), "q_offset": 30}),
    # dense per-call terms: a boolean mask, an additive mask with a bias, a logit soft cap
    "dense_bool_mask": (2, 24, 24, 4, 2, 8, {"mask": _DENSE_MASK}),
    "additive_mask_bias": (1, 20, 28, 4, 1, 8, {"mask": _ADDITIVE, "bias": _BIAS}),
    "dense_block_structured": (1, 160, 160, 4, 2, 8, {"mask": _DOC_MASK}),
    "soft_cap_causal_gqa": (1, 40, 40, 4, 2, 8, {"mask": M.Causal(), "logits_soft_cap": 1.5}),
    "soft_cap_decode": (2, 1, 53, 4, 2, 16, {"mask": M.Causal(), "q_offset": jnp.array([20, 52]),
                                             "kv_lengths": jnp.array([21, 53]), "logits_soft_cap": 2.0}),
}
DENSE_CASES = ["dense_bool_mask", "additive_mask_bias", "soft_cap_causal_gqa", "soft_cap_decode",
               "dense_block_structured"]


@pytest.mark.parametrize("name", sorted(_CASES))
def test_xla_matches_dense_reference_f32(name):
  b, tq, tk, h, hk, d, kw = _CASES[name]
  check_against_reference(*_inputs(b, tq, tk, h, hk, d), kw)


# Forward and backward on different tiles (``XlaBlockSizes.backward``: its own layout tables and
# dynamic classes) and evenly split q and key tiles (``even_q`` / ``even_k``: 45 queries run as
# 2 x 24 forward and 3 x 16 backward), at lengths that are no multiple of any tile.
_SPLIT = xla.XlaBlockSizes(32, 16, even_q=True, even_k=True,
                           backward=xla.XlaBlockSizes(16, 8, even_q=True, even_k=True))
_SPLIT_CASES = ["full", "causal_gqa8_rect", "mqa_local_sink", "block_sparse_random",
                "packed_segments", "decode_traced_offset", "soft_cap_causal_gqa"]


@pytest.mark.parametrize("name", _SPLIT_CASES)
def test_xla_split_backward_tiles_match_reference(name):
  b, tq, tk, h, hk, d, kw = _CASES[name]
  if name == "full":
    tq = tk = 45
  check_against_reference(*_inputs(b, tq, tk, h, hk, d), kw, block=_SPLIT)


def test_default_dense_tiles_match_reference():
  """The unmasked default (DENSE) at 1100 tokens: 2 x 552 q tiles forward, 3 x 368 backward,
  5 x 224 key tiles."""
  assert xla.DENSE.for_lengths(1100, 1100) == (552, 224)
  assert xla.DENSE.backward.for_lengths(1100, 1100) == (368, 224)
  check_against_reference(*_inputs(1, 1100, 1100, 2, 1, 16), {}, block=xla.DENSE)


def test_default_causal_tiles_match_reference():
  """Causal at 1100 tokens on UNSTRUCTURED tiles: 3 x 368 q tiles, 5 x 224 key tiles (both
  cut across the diagonal)."""
  assert xla.UNSTRUCTURED.for_lengths(1100, 1100) == (368, 224)
  check_against_reference(*_inputs(1, 1100, 1100, 2, 1, 16), {"mask": M.Causal()},
                          block=xla.UNSTRUCTURED)


def test_dense_tiles_and_even_split():
  """Unmasked calls get DENSE (even q tiles, own backward tiles), causal ones UNSTRUCTURED;
  packed and decode calls keep the default; an even split pads at most 7 rows per tile."""
  assert xla.XlaBlockSizes.for_mask(None) is xla.DENSE
  assert xla.DENSE.backward is not None and xla.DENSE.even_q
  assert xla.XlaBlockSizes.for_mask(None, packed=True) == xla.XlaBlockSizes()
  assert xla.XlaBlockSizes.for_mask(None, q_len=xla.SINGLE_TILE_MAX_Q) == xla.XlaBlockSizes()
  assert xla.XlaBlockSizes.for_mask(M.Causal(), q_len=4096) is xla.UNSTRUCTURED
  assert xla.XlaBlockSizes.for_mask(M.Causal(), packed=True, q_len=4096) == xla.XlaBlockSizes()
  even = xla.XlaBlockSizes(1024, 128, even_q=True)
  assert even.for_lengths(1500, 1500) == (752, 128)
  assert even.for_lengths(4096, 100) == (1024, 104)
  assert even.for_lengths(5000, 5000) == (1000, 128)
  assert xla.XlaBlockSizes(1024, 128).for_lengths(1500, 1500) == (1024, 128)
  assert xla.UNSTRUCTURED.for_lengths(262, 262) == (264, 136)  # not 264 x 512 keys
  assert xla.UNSTRUCTURED.for_lengths(4096, 4096) == (512, 256)
  assert xla.XlaBlockSizes(512, 256, even_k=True).for_lengths(518, 518) == (512, 176)


@pytest.mark.parametrize("name", ["causal_gqa4", "packed_segments"])
def test_xla_matches_dense_reference_bf16(name):
  b, tq, tk, h, hk, d, kw = _CASES[name]
  check_against_reference(*_inputs(b, tq, tk, h, hk, d, jnp.bfloat16), kw)


def test_padding_never_leaks():
  """Length 37 with 16-blocks pads 11 zero keys internally. Real logits are made very negative,
  so a padded key (logit 0) would take almost all probability mass if it were visible."""
  q, k, v, ct = _inputs(1, 37, 37, 2, 2, 8)
  q = jnp.abs(q) * 10.0
  k = -jnp.abs(k) * 10.0
  out, lse = check_against_reference(q, k, v, ct, {"mask": M.Causal()})
  assert float(jnp.max(lse)) < -5.0  # every real logit is far below the padded keys' 0


def test_fully_masked_rows_give_zeros():
  q, k, v, ct = _inputs(1, 24, 24, 2, 2, 8)
  seg_q = jnp.array([[0] * 12 + [9] * 12])  # segment 9 has no keys: those rows see nothing
  seg_k = jnp.zeros((1, 24), jnp.int32)
  kw = {"segment_ids": (seg_q, seg_k)}
  out, lse = check_against_reference(q, k, v, ct, kw)
  assert np.all(np.asarray(out[0, 12:]) == 0) and np.all(np.isneginf(lse[0, :, 12:]))


def test_public_api_auto_uses_blockwise_on_cpu():
  q, k, v, _ = _inputs(1, 300, 300, 2, 1, 8)  # > one default 256-block
  run = lambda impl: lambda q, k, v: attention(q, k, v, mask=M.Causal(), impl=impl, return_lse=True)
  out, lse = fast_compile(run("auto"), q, k, v)(q, k, v)
  o_r, l_r = fast_compile(run("reference"), q, k, v)(q, k, v)
  np.testing.assert_allclose(out, o_r, atol=1e-5)
  np.testing.assert_allclose(lse, l_r, atol=1e-5)
  from jaxsys.ops.attn import api
  assert api._load("xla") is xla.blockwise_attention
  with pytest.raises(NotImplementedError, match="GPU or TPU"):
    attention(q, k, v, impl="pallas")


def test_blockwise_visits_only_layout_blocks():
  """Trip counts come from the layout: a causal 4x4 block grid visits 10 of 16 blocks."""
  lay = layout.compile_layout(M.Causal(), heads=1, q_len=64, kv_len=64, block_q=16, block_k=16,
                              q_offset=0)
  idx, cls, cnt = lay.tables
  assert cnt.tolist() == [[1, 2, 3, 4]] and lay.density == 10 / 16
  assert (cls[0, np.arange(4), cnt[0] - 1] == layout.PARTIAL).all()  # diagonal blocks
  assert (cls[0][np.tril(np.ones((4, 4), bool), -1)] == layout.FULL).all()


def test_memory_is_linear_in_length():
  """Compiled plan: blockwise temporaries grow ~linearly, the naive ones quadratically."""
  def temp(fn, t):
    q = jax.ShapeDtypeStruct((1, t, 2, 16), jnp.float32)
    return compiled_memory(jax.jit(fn), q, q, q)["temp_bytes"]
  ours = lambda q, k, v: xla.blockwise_attention(common.validate(q, k, v), xla.XlaBlockSizes(128, 128))[0]
  naive = lambda q, k, v: reference.attention_reference(common.validate(q, k, v))[0]
  r_ours = temp(ours, 2048) / temp(ours, 1024)
  r_naive = temp(naive, 2048) / temp(naive, 1024)
  assert r_ours < 2.6 and r_naive > 3.5, (r_ours, r_naive)


def _naive(q, k, v, mask=None, bias=None, logits_soft_cap=None, **_):
  """softmax(cap(q k^T / sqrt(d)) + bias + additive mask, boolean mask) v, written out (f32)."""
  h, hk = q.shape[2], k.shape[2]
  k, v = jnp.repeat(k, h // hk, axis=2), jnp.repeat(v, h // hk, axis=2)
  s = jnp.einsum("bqhd,bkhd->bhqk", q, k, precision="highest") / np.sqrt(q.shape[-1])
  if logits_soft_cap is not None:
    s = logits_soft_cap * jnp.tanh(s / logits_soft_cap)
  if bias is not None:
    s = s + bias
  if mask is not None:
    s = jnp.where(mask, s, -jnp.inf) if mask.dtype == jnp.bool_ else s + mask
  return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v, precision="highest")


@pytest.mark.parametrize("name", DENSE_CASES[:3] + ["dense_block_structured"])
def test_dense_terms_match_naive_formula(name):
  """The op (auto) against the formula written out, values and gradients (q, k, v and bias)."""
  b, tq, tk, h, hk, d, kw = _CASES[name]
  q, k, v, ct = _inputs(b, tq, tk, h, hk, d)
  if isinstance(kw.get("mask"), M.Mask):
    kw = {**kw, "mask": jnp.asarray(kw["mask"].dense(tq, tk))[None]}  # the lazy mask, written out
  bias = kw.pop("bias", jnp.zeros((1, 1, tq, tk)))
  loss = lambda f: lambda q, k, v, bias: jnp.sum(f(q, k, v, bias=bias, **kw) * ct)  # noqa: E731
  ours = jax.jit(jax.value_and_grad(loss(attention), argnums=(0, 1, 2, 3)))(q, k, v, bias)
  want = jax.jit(jax.value_and_grad(loss(_naive), argnums=(0, 1, 2, 3)))(q, k, v, bias)
  np.testing.assert_allclose(ours[0], want[0], rtol=1e-5, atol=1e-4)
  for a, b_ in zip(ours[1], want[1]):
    np.testing.assert_allclose(a, b_, rtol=1e-4, atol=1e-5)


def test_block_structured_dense_masks_become_layouts():
  """A concrete boolean mask shared by the batch with empty 64 x 64 tiles becomes ``masks.Dense``
  (exact block classes: empty tiles skipped, full ones unmasked); a mostly-visited, per-example or
  traced mask stays dense; the Pallas kernel refuses a Dense mask (auto falls back)."""
  q, k, v, _ = _inputs(1, 160, 160, 4, 2, 8)
  args = common.validate(q, k, v, mask=_DOC_MASK)
  assert isinstance(args.mask, M.Dense) and args.token_mask is None
  lay = layout.compile_layout(args.mask, heads=4, q_len=160, kv_len=160, block_q=32, block_k=32,
                              q_offset=0)
  want = np.asarray(_DOC_MASK[0, 0]).reshape(5, 32, 5, 32)
  np.testing.assert_array_equal(lay.cls[0] != layout.SKIP, want.any(axis=(1, 3)))
  np.testing.assert_array_equal(lay.cls[0] == layout.FULL, want.all(axis=(1, 3)))
  assert lay.density < 0.5
  rand = jnp.asarray(np.random.RandomState(0).rand(1, 1, 160, 160) < 0.5)
  assert common.validate(q, k, v, mask=rand).token_mask is not None             # every tile visited
  q2, k2, v2, _ = _inputs(2, 160, 160, 4, 2, 8)
  assert common.validate(q2, k2, v2, mask=jnp.concatenate([_DOC_MASK] * 2)).token_mask is not None
  def inside(m):
    assert common.validate(q, k, v, mask=m).token_mask is not None  # traced: stays dense
    return m
  jax.jit(inside)(_DOC_MASK)
  with pytest.raises(NotImplementedError, match="dense mask"):
    attention(q, k, v, mask=_DOC_MASK, impl="pallas_interpret")


def test_dense_terms_are_refused_by_specialised_paths():
  """xla_decode refuses a dense mask (auto falls back to xla); bad shapes and caps name themselves."""
  q, k, v, _ = _inputs(1, 2, 16, 2, 1, 8)
  m = jnp.ones((1, 1, 2, 16), bool)
  with pytest.raises(NotImplementedError, match="dense mask or bias"):
    attention(q, k, v, mask=m, kv_lengths=jnp.array([16]), impl="xla_decode")
  np.testing.assert_allclose(attention(q, k, v, mask=m, kv_lengths=jnp.array([16])),
                             attention(q, k, v, kv_lengths=jnp.array([16])), atol=1e-6)
  with pytest.raises(ShapeError, match=r"mask must be a Mask or an array \[batch\|1, heads\|1"):
    attention(q, k, v, mask=jnp.ones((2, 16), bool))
  with pytest.raises(ShapeError, match="bias must be"):
    attention(q, k, v, bias=jnp.ones((1, 3, 2, 16)))
  with pytest.raises(ShapeError, match="logits_soft_cap=0"):
    attention(q, k, v, logits_soft_cap=0)


# ----------------------------------------------------------------------------- bad input


def test_bad_inputs_raise_clear_errors():
  q, k, v, _ = _inputs(1, 16, 16, 4, 2, 8)
  with pytest.raises(ShapeError, match="q must be"):
    attention(q[0], k, v)
  with pytest.raises(ShapeError, match="dtypes differ"):
    attention(q.astype(jnp.bfloat16), k, v)
  with pytest.raises(ShapeError, match="floating"):
    attention(q.astype(jnp.int32), k, v)
  q3 = jnp.ones((1, 16, 3, 8))
  with pytest.raises(ShapeError, match="heads=3 must be a multiple of kv_heads=2"):
    attention(q3, k, v)
  with pytest.raises(ShapeError, match="BlockSparse layout shape"):
    attention(q, k, v, mask=M.BlockSparse(np.ones((1, 3, 3), bool), 8, 8))
  with pytest.raises(InputError, match="k contains NaN"):
    attention(q, k.at[0, 3, 1, 2].set(jnp.nan), v, check=True)
  with pytest.raises(ShapeError, match="kv_lengths"):
    attention(q, k, v, kv_lengths=jnp.array([3, 4]))
  with pytest.raises(ShapeError, match="segment_ids"):
    attention(q, k, v, segment_ids=jnp.zeros((1, 15), jnp.int32))
  with pytest.raises(ValueError, match="impl"):
    attention(q, k, v, impl="cuda")
  with pytest.raises(Exception, match="block_q"):
    xla.XlaBlockSizes(block_q=0)


def test_multihead_mask_is_split_per_kv_head_group():
  """Heads uniform within each kv group run as one call per distinct mask (fewer visited blocks),
  with output, lse and gradients equal to the single naive call."""
  from jaxsys.ops.attn import api
  stream = M.Sink(2) | M.Local(6)
  # 8 query heads over 4 kv heads: kv groups 0 and 2 stream, 1 and 3 are causal (interleaved)
  mask = M.MultiHead([stream, stream, M.Causal(), M.Causal()] * 2)
  q, k, v, ct = _inputs(1, 40, 40, 8, 4, 8)
  groups = api.head_groups(mask, q, k)
  assert [ids.tolist() for _, ids in groups] == [[0, 2], [1, 3]]
  assert api.head_groups(M.MultiHead([stream, M.Causal()] * 4), q, k) is None  # mixed in a group

  def run(impl):
    def f(q, k, v):
      out, lse = attention(q, k, v, mask=mask, impl=impl, return_lse=True)
      return jnp.sum(out * ct) + 0.5 * jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0)), (out, lse)
    return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True))(q, k, v)

  (_, (o, l)), g = run("xla")
  (_, (o_r, l_r)), g_r = run("reference")
  np.testing.assert_allclose(o, o_r, atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(l, l_r, atol=1e-5, rtol=1e-5)
  for a, b in zip(g, g_r):
    np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-4)
