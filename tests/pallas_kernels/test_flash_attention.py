"""Block-sparse flash-attention Pallas kernel: interpret mode vs the dense reference (forward and
gradients), and lowering for real hardware (Triton for CUDA, Mosaic for TPU) via jax.export on CPU.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsys.ops import attention, masks as M
from jaxsys.ops.attn import common, layout as layout_lib, pallas as P, reference, xla
from pallas_kernels import flash_attention as fa, offline

TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}
_FAST = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def _inputs(b, tq, tk, h, hk, d, dtype=jnp.float32, seed=0):
  ks = jax.random.split(jax.random.key(seed), 4)
  mk = lambda key, shape: jax.random.normal(key, shape, jnp.float32).astype(dtype)
  return (mk(ks[0], (b, tq, h, d)), mk(ks[1], (b, tk, hk, d)), mk(ks[2], (b, tk, hk, d)),
          jax.random.normal(ks[3], (b, tq, h, d), jnp.float32))


def _fwd_bwd(impl, kw, ct, block=(16, 16), backend="triton"):
  def f(q, k, v):
    args = common.validate(q, k, v, **kw)
    if impl == "reference":
      return reference.attention_reference(args)
    return P.pallas_attention(args, P.BlockSizes(*block), backend=backend, interpret=True)

  def run(q, k, v):
    (out, lse), vjp = jax.vjp(f, q, k, v)
    dlse = jnp.where(jnp.isfinite(lse), 0.5, 0.0)
    return out, lse, vjp((ct.astype(out.dtype), dlse))
  return lambda *a: jax.jit(run).lower(*a).compile(_FAST)(*a)


_LAYOUT = np.random.RandomState(2).rand(4, 2, 4) < 0.5
_CASES = {
    # name: (b, tq, tk, h, hk, d, kwargs, dtype)
    "causal_gqa4_ragged": (1, 37, 37, 4, 1, 16, {"mask": M.Causal()}, jnp.float32),
    "streaming_sparse_rect": (1, 24, 56, 4, 2, 8, {"mask": M.MultiHead(
        [M.Causal(), M.Sink(3) | M.Local(7), M.BlockSparse(_LAYOUT[:1], 16, 16, M.Causal()),
         M.Full()])}, jnp.float32),
    # query segment 9 has no keys: those rows see nothing (zeros, lse -inf, finite grads)
    "segments_mqa_empty_rows": (2, 40, 40, 4, 1, 8, {"mask": M.Causal(), "segment_ids": (
        jnp.array([[0] * 13 + [1] * 20 + [9] * 7, [3] * 30 + [4] * 10]),
        jnp.array([[0] * 13 + [1] * 20 + [2] * 7, [3] * 30 + [4] * 10]))}, jnp.float32),
    "decode_offset_lengths": (2, 1, 45, 2, 2, 16, {"mask": M.Sink(2) | M.Local(9), "q_offset":
        jnp.array([20, 44]), "kv_lengths": jnp.array([21, 45])}, jnp.float32),
    "block_sparse_gqa8_bf16": (1, 32, 64, 8, 1, 16, {"mask": M.BlockSparse(
        np.repeat(_LAYOUT, 2, axis=0), 16, 16)},
                               jnp.bfloat16),
}


@pytest.mark.parametrize("backend", ["triton", "mosaic"])
@pytest.mark.parametrize("name", sorted(_CASES))
def test_interpret_matches_dense_reference(name, backend):
  """Both kernel families (Triton: whole K/V rows per program; Mosaic: visited blocks streamed
  through the grid, flash_tpu.py) against the dense formula, forward and gradients."""
  b, tq, tk, h, hk, d, kw, dtype = _CASES[name]
  q, k, v, ct = _inputs(b, tq, tk, h, hk, d, dtype)
  tol = TOL[dtype]
  f32 = lambda x: x.astype(jnp.float32)
  o_r, l_r, g_r = _fwd_bwd("reference", kw, ct)(f32(q), f32(k), f32(v))
  o, l, g = _fwd_bwd("pallas", kw, ct, backend=backend)(q, k, v)
  assert o.dtype == dtype and l.dtype == jnp.float32
  np.testing.assert_allclose(f32(o), o_r, atol=tol, rtol=tol)
  np.testing.assert_array_equal(np.isfinite(l), np.isfinite(l_r))
  np.testing.assert_allclose(jnp.where(jnp.isfinite(l), l, 0), jnp.where(jnp.isfinite(l_r), l_r, 0),
                             atol=tol, rtol=tol)
  if name == "segments_mqa_empty_rows":
    assert np.all(np.asarray(o[0, 33:]) == 0) and np.all(np.isneginf(l[0, :, 33:]))
  for gname, a, b_ in zip(("dq", "dk", "dv"), g, g_r):
    assert a.dtype == dtype and bool(jnp.all(jnp.isfinite(f32(a)))), gname
    scale = max(1.0, float(jnp.max(jnp.abs(b_))))
    np.testing.assert_allclose(f32(a), b_, atol=tol * scale, rtol=tol, err_msg=gname)


# Per-call terms the kernel does not evaluate: refused before tracing, so ``auto`` (here forced
# to try the interpreted kernel first) serves them on the XLA path, equal to the dense formula.
_REFUSED = {
    "dense_bool_mask": {"mask": jnp.asarray(np.tril(np.ones((16, 16), bool)))[None, None]},
    "additive_mask_bias": {"mask": jnp.zeros((1, 2, 16, 16)), "bias": jnp.ones((1, 1, 16, 16))},
    "soft_cap": {"mask": M.Causal(), "logits_soft_cap": 1.5},
}


@pytest.mark.parametrize("name", sorted(_REFUSED))
def test_kernel_refuses_dense_terms_and_auto_falls_back(name, monkeypatch):
  from jaxsys.ops.attn import api
  q, k, v, _ = _inputs(1, 16, 16, 2, 1, 8)
  kw = _REFUSED[name]
  with pytest.raises(NotImplementedError, match="dense mask, bias or logits_soft_cap"):
    P.pallas_interpreted(common.validate(q, k, v, **kw))
  monkeypatch.setattr(api.ATTENTION, "_auto", lambda: ("pallas_interpret", "xla"))
  f = lambda q: attention(q, k, v, **kw).sum()  # noqa: E731
  g = lambda q: attention(q, k, v, impl="reference", **kw).sum()  # noqa: E731
  np.testing.assert_allclose(jax.grad(f)(q), jax.grad(g)(q), atol=1e-5, rtol=1e-5)


def test_public_dispatch_interpret_and_unaligned_block_sparse():
  q, k, v, _ = _inputs(1, 16, 16, 2, 1, 8)
  out = attention(q, k, v, mask=M.Causal(), impl="pallas_interpret")
  np.testing.assert_allclose(out, attention(q, k, v, mask=M.Causal(), impl="reference"), atol=1e-5)
  # A 4x4 layout cell is smaller than the smallest Triton tile (16): not served by the kernel.
  sparse = M.BlockSparse(np.ones((1, 4, 4), bool), 4, 4)
  with pytest.raises(NotImplementedError, match="BlockSparse"):
    attention(q, k, v, mask=sparse, impl="pallas_interpret")


def test_block_sizes_validated():
  with pytest.raises(ValueError, match="block_q"):
    fa.BlockSizes(block_q=0)
  with pytest.raises(ValueError, match="backend"):
    fa.KernelConfig(heads=2, kv_heads=1, table_heads=1, visits=1, visits_t=1, block_q=16,
                    block_k=16, scale=1.0, q_len=16, kv_len=16, visible_fn=None, backend="cuda")


# ----------------------------------------------------------------------------- tiles from the mask


def _sparse(cell, n=512, seed=3, token_mask=None):
  lay = np.random.RandomState(seed).rand(1, n // cell, n // cell) < 0.4
  lay[:, np.arange(n // cell), np.arange(n // cell)] = True   # every query sees its own block
  return M.BlockSparse(lay, cell, cell, token_mask)


_FOR_MASK = {
    # name: (mask, q_len, kv_len, triton (bq, bk), mosaic (bq, bk))
    "dense": (None, 4096, 4096, (128, 128), (128, 128)),
    "causal": (M.Causal(), 4096, 4096, (128, 128), (128, 128)),
    "sparse64": (_sparse(64), 512, 512, (64, 64), (64, 128)),
    "sparse128": (_sparse(128), 512, 512, (128, 128), (128, 128)),
    "sparse256": (_sparse(256), 512, 512, (128, 128), (128, 128)),
    "sparse32_causal": (_sparse(32, token_mask=M.Causal()), 512, 512, (32, 32), (32, 128)),
    "rect_64x256": (M.BlockSparse(np.ones((1, 8, 2), bool), 64, 256), 512, 512, (64, 64),
                    (64, 128)),
    "local_short_window": (M.Sink(4) | M.Local(100), 4096, 4096, (64, 64), (64, 128)),
    "local_long_window": (M.Local(4096), 4096, 4096, (128, 128), (128, 128)),
    "ragged_lengths": (M.Causal(), 37, 300, (64, 128), (40, 128)),
    "ragged_sparse64": (M.BlockSparse(np.ones((1, 1, 5), bool), 64, 64), 37, 300, (64, 64),
                        (64, 128)),
    "decode": (M.Causal(), 1, 1000, (16, 128), (8, 128)),
    "short_kv": (M.Causal(), 100, 20, (128, 32), (104, 128)),
}


@pytest.mark.parametrize("name", sorted(_FOR_MASK))
def test_block_sizes_for_mask(name):
  mask, tq, tk, tri, mos = _FOR_MASK[name]
  for backend, want in (("triton", tri), ("mosaic", mos)):
    got = fa.BlockSizes.for_mask(mask, q_len=tq, kv_len=tk, backend=backend)
    assert (got.block_q, got.block_k) == want, backend


def test_block_sizes_for_mask_errors():
  with pytest.raises(NotImplementedError, match=r"block_q \[8\].*power of two"):
    fa.BlockSizes.for_mask(_sparse(8, n=64), q_len=64, kv_len=64, backend="triton")
  # Mosaic takes 8-row q tiles but its kv tile is 128 keys, which 96-key columns do not tile.
  with pytest.raises(NotImplementedError, match=r"block_k \[96\] must divide block_k=128"):
    fa.BlockSizes.for_mask(M.BlockSparse(np.ones((1, 4, 4), bool), 64, 96), q_len=256,
                           kv_len=384, backend="mosaic")
  with pytest.raises(NotImplementedError, match="block_q"):  # 12: no multiple of 8 divides it
    fa.BlockSizes.for_mask(M.BlockSparse(np.ones((1, 4, 4), bool), 12, 128), q_len=48,
                           kv_len=512, backend="mosaic")
  with pytest.raises(ValueError, match="backend"):
    fa.BlockSizes.for_mask(None, q_len=8, kv_len=8, backend="cuda")
  with pytest.raises(ValueError, match="q_len=0"):
    fa.BlockSizes.for_mask(None, q_len=0, kv_len=8)


def test_for_mask_skips_every_skipped_layout_block():
  """Triton 64x64 tiles on a 64-token layout visit exactly the layout's visible blocks."""
  mask = _sparse(64)
  bq, bk = P._choose_blocks(None, mask, 512, 512, [mask], "triton")
  lay = layout_lib.compile_layout(mask, heads=2, q_len=512, kv_len=512, block_q=bq, block_k=bk,
                                  q_offset=0)
  assert (bq, bk) == (64, 64) and np.array_equal(lay.cls != 0, mask.layout)


@pytest.mark.parametrize("backend", ["triton", "mosaic"])
def test_interpret_matches_xla_at_64_token_layout(backend):
  """Default tiles (for_mask) at a 64-granular layout: 64x64 on Triton, 64x128 on Mosaic (two
  layout columns per kv tile, read from per-visit bits), forward and gradients vs the XLA twin."""
  mask = _sparse(64, n=256, token_mask=M.Causal()) | M.Sink(3)
  kw = {"mask": mask}
  q, k, v, ct = _inputs(1, 256, 256, 2, 1, 16)

  def run(impl):
    def f(q, k, v):
      args = common.validate(q, k, v, **kw)
      if impl == "xla":
        return xla.blockwise_attention(args)
      return P.pallas_attention(args, backend=backend, interpret=True)

    def g(q, k, v):
      (out, lse), vjp = jax.vjp(f, q, k, v)
      return out, lse, vjp((ct, jnp.zeros_like(lse)))
    return jax.jit(g).lower(q, k, v).compile(_FAST)(q, k, v)

  o_x, l_x, g_x = run("xla")
  o, lse, g = run("pallas")
  np.testing.assert_allclose(o, o_x, atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(lse, l_x, atol=1e-5, rtol=1e-5)
  for gname, a, b_ in zip(("dq", "dk", "dv"), g, g_x):
    np.testing.assert_allclose(a, b_, atol=1e-4, rtol=1e-4, err_msg=gname)


# ----------------------------------------------------------------------------- lowering


_MASK = M.MultiHead([M.Causal(), M.Sink(4) | M.Local(64),
                     M.BlockSparse(np.array([[[1, 0], [1, 1]]], bool), 256, 256), M.Full()])


def _export(backend, block, with_grad, seq=512, mask=_MASK):
  platform = {"triton": "cuda", "mosaic": "tpu"}[backend]
  b, h, hk, d = 2, 4, 2, 64
  q = jax.ShapeDtypeStruct((b, seq, h, d), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((b, seq, hk, d), jnp.bfloat16)
  seg = jax.ShapeDtypeStruct((b, seq), jnp.int32)
  lens = jax.ShapeDtypeStruct((b,), jnp.int32)

  def fwd(q, k, v, seg, lens):
    args = common.validate(q, k, v, mask=mask, segment_ids=seg, kv_lengths=lens)
    bs = P.BlockSizes(*block) if block else None
    return P.pallas_attention(args, bs, backend=backend)

  def fwd_bwd(q, k, v, seg, lens):
    loss = lambda q, k, v: fwd(q, k, v, seg, lens)[0].astype(jnp.float32).sum()
    return jax.grad(loss, (0, 1, 2))(q, k, v)

  return offline.export_for(platform, fwd_bwd if with_grad else fwd, q, k, k, seg, lens).mlir_module()


@pytest.mark.parametrize("backend,block", [("triton", None), ("triton", (64, 32)),
                                           ("mosaic", None), ("mosaic", (128, 256))])
def test_kernel_lowers_for_hardware(backend, block):
  """Forward and backward (dq, dk/dv kernels) lower for CUDA/Triton and TPU/Mosaic."""
  text = _export(backend, block, with_grad=True)
  for name in ("flash_attention_fwd", "flash_attention_bwd_dq", "flash_attention_bwd_dkdv"):
    assert name in text, name


@pytest.mark.parametrize("backend,match", [("triton", "power of 2"), ("mosaic", "divisible by 8 and 128")])
def test_hardware_rejects_100x100_blocks(backend, match):
  """Interpret mode runs a 100x100 tile; the hardware lowerings refuse it."""
  if backend == "triton":  # once: interpret mode cannot see the hardware rule
    _check_interpret_100()
  with pytest.raises(Exception, match=match):
    _export(backend, (100, 100), with_grad=False, seq=600, mask=M.Causal())


def _check_interpret_100():
  q, k, v, _ = _inputs(1, 200, 200, 2, 1, 8)
  f = lambda q, k, v: P.pallas_attention(common.validate(q, k, v, mask=M.Causal()),
                                         P.BlockSizes(100, 100), interpret=True)[0]
  out = jax.jit(f).lower(q, k, v).compile(_FAST)(q, k, v)
  ref = reference.attention_reference(common.validate(q, k, v, mask=M.Causal()))[0]
  np.testing.assert_allclose(out, ref, atol=1e-5)


@pytest.mark.parametrize("backend", ["triton", "mosaic"])
def test_kernel_lowers_at_64_token_layout(backend):
  """Tiles from for_mask at a 64-granular layout (64x64 Triton, 64x128 Mosaic) lower with grads."""
  mask = M.MultiHead([_sparse(64, token_mask=M.Causal()), M.Causal(), _sparse(64, seed=4),
                      M.Sink(4) | M.Local(64)])
  text = _export(backend, None, with_grad=True, seq=512, mask=mask)
  for name in ("flash_attention_fwd", "flash_attention_bwd_dq", "flash_attention_bwd_dkdv"):
    assert name in text, name


def test_triton_params_quiet_only_the_pallas_triton_deprecation(monkeypatch):
  """Every Pallas-Triton kernel's launch parameters come from backend.triton_params, which files
  away JAX 0.11's "Triton backend is deprecated" warning raised inside JAX's Pallas-Triton
  modules, and nothing else."""
  import warnings

  from pallas_kernels import backend
  with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    monkeypatch.setattr(backend, "_QUIETED", False)
    params = backend.triton_params(8, 3)
    assert (params.num_warps, params.num_stages) == (8, 3)
    msg = "The Triton backend is deprecated and will be removed in a future version of JAX."
    warnings.warn_explicit(msg, DeprecationWarning, "lowering.py", 1, module="jax._src.pallas.triton.lowering")
    warnings.warn_explicit(msg, DeprecationWarning, "mine.py", 1, module="mine")
    warnings.warn_explicit("other", DeprecationWarning, "lowering.py", 2, module="jax._src.pallas.triton.lowering")
  assert [str(w.message) for w in seen] == [msg, "other"]
