"""Pallas paged-decode and page-score kernels: interpret mode vs the XLA twins; GPU lowering."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import offline

from jaxsys.core.errors import ConfigError
from jaxsys.ops.paged_attention import paged_decode_pallas, paged_decode_xla
from jaxsys.serving.page_select import page_scores_xla
from pallas_kernels.page_select import PageSelectBlocks, page_scores_pallas
from pallas_kernels.paged_attention import PagedDecodeBlocks


def _decode_inputs(seed=0, b=2, h=8, hk=2, d=16, page=8, n=12, kk=5):
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.standard_normal((b, h, d)), jnp.float32)
  kp = jnp.asarray(rng.standard_normal((n, hk, page, d)), jnp.float32)
  vp = jnp.asarray(rng.standard_normal((n, hk, page, d)), jnp.float32)
  idx = jnp.asarray(rng.integers(0, n, (b, hk, kk)), jnp.int32)
  num = jnp.asarray(rng.permutation(6)[:kk][None, None].repeat(b, 0).repeat(hk, 1), jnp.int32)
  num = num.at[0, 1, 2].set(-1)  # an empty slot
  lengths = jnp.asarray([41, 23], jnp.int32)
  return q, kp, vp, idx, num, lengths


@pytest.mark.parametrize("splits,stream", [(1, False), (2, True), (3, False)])
def test_paged_decode_interpret_matches_xla(splits, stream):
  q, kp, vp, idx, num, lengths = _decode_inputs()
  kw = dict(sink=4, window=12) if stream else dict(sink=None, window=None)
  ref, ref_lse = paged_decode_xla(q, kp, vp, idx, num, lengths, scale=0.25, num_splits=1, **kw)
  out, lse = paged_decode_pallas(q, kp, vp, idx, num, lengths, scale=0.25,
                                 blocks=PagedDecodeBlocks(num_splits=splits), interpret=True, **kw)
  np.testing.assert_allclose(out, ref, atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(lse, ref_lse, atol=1e-5, rtol=1e-5)


def _select_inputs(seed=1, b=2, h=8, hk=2, d=16, n=10, nl=4, m=6):
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.standard_normal((b, h, d)), jnp.float32)
  a = rng.standard_normal((2, n, hk, nl, d)).astype(np.float32)
  kmin, kmax = jnp.asarray(a.min(0)), jnp.asarray(a.max(0))
  bt = jnp.asarray(rng.permutation(n)[:b * m].reshape(b, m) if b * m <= n else rng.integers(0, n, (b, m)), jnp.int32)
  return q, kmin, kmax, bt, jnp.asarray([50, 17], jnp.int32)


def test_page_scores_interpret_matches_xla():
  q, kmin, kmax, bt, lengths = _select_inputs()
  ref = page_scores_xla(q, kmin, kmax, bt, lengths, page_size=16, logical_page_size=4)
  out = page_scores_pallas(q, kmin, kmax, bt, lengths, page_size=16, logical_page_size=4, interpret=True)
  np.testing.assert_allclose(out, ref, atol=1e-5, rtol=1e-5)
  assert np.isneginf(np.asarray(out)[1, :, 2:]).all()  # length 17 -> pages >= 2 empty


def test_block_configs_validate():
  with pytest.raises(ConfigError, match="num_splits"):
    PagedDecodeBlocks(num_splits=0)
  with pytest.raises(ConfigError, match="num_warps"):
    PageSelectBlocks(num_warps=3)


def _export_cuda(fn, *args):
  return offline.export_for("cuda", fn, *args)


@pytest.mark.parametrize("blocks", [PagedDecodeBlocks(), PagedDecodeBlocks(num_splits=4, num_warps=8, num_stages=3)])
def test_paged_decode_lowers_for_cuda(blocks):
  q, kp, vp, idx, num, lengths = _decode_inputs(b=1, h=8, hk=2, d=64, page=16, n=16, kk=8)
  fn = lambda *a: paged_decode_pallas(*a, scale=0.125, sink=16, window=32, blocks=blocks)
  exp = _export_cuda(fn, q, kp, vp, idx, num, lengths)
  assert "lserve_paged_decode" in exp.mlir_module()


@pytest.mark.parametrize("blocks", [PageSelectBlocks(), PageSelectBlocks(num_warps=2, num_stages=2)])
def test_page_scores_lowers_for_cuda(blocks):
  q, kmin, kmax, bt, lengths = _select_inputs(d=64, n=16, nl=4, m=8)
  fn = lambda *a: page_scores_pallas(*a, page_size=64, logical_page_size=16, blocks=blocks)
  exp = _export_cuda(fn, q, kmin, kmax, bt, lengths)
  assert "lserve_page_scores" in exp.mlir_module()


# ----------------------------------------------------------------------------- Mosaic (TPU)


def _export_tpu(fn, *args):
  return offline.export_for("tpu", fn, *args)


def test_page_scores_mosaic_interpret_matches_xla():
  q, kmin, kmax, bt, lengths = _select_inputs()
  ref = page_scores_xla(q, kmin, kmax, bt, lengths, page_size=16, logical_page_size=4)
  out = page_scores_pallas(q, kmin, kmax, bt, lengths, page_size=16, logical_page_size=4,
                           interpret=True, backend="mosaic")
  np.testing.assert_allclose(out, ref, atol=1e-5, rtol=1e-5)
  assert np.isneginf(np.asarray(out)[1, :, 2:]).all()


@pytest.mark.parametrize("nl,page_size", [(4, 64), (8, 128)])  # the block is one page's stats
def test_page_scores_lowers_for_tpu(nl, page_size):
  q, kmin, kmax, bt, lengths = _select_inputs(d=64, n=16, nl=nl, m=8)
  fn = lambda *a: page_scores_pallas(*a, page_size=page_size, logical_page_size=16,
                                     backend="mosaic")
  text = _export_tpu(fn, q, kmin, kmax, bt, lengths).mlir_module()
  assert "tpu_custom_call" in text and "lserve_page_scores" in text


def test_page_scores_mosaic_refuses_a_table_beyond_smem():
  from pallas_kernels import page_select
  q, kmin, kmax, _, lengths = _select_inputs()
  bt = jnp.zeros((2, page_select.TPU_SMEM_BUDGET_BYTES // 8 + 1), jnp.int32)
  with pytest.raises(NotImplementedError, match="SMEM"):
    page_scores_pallas(q, kmin, kmax, bt, lengths, page_size=16, logical_page_size=4,
                       backend="mosaic")


def _merged(o, m, l, g):
  """The split-K merge of ``paged_decode_pallas``: ``(out [b, h, d], lse [b, h])``."""
  from jaxsys.ops.merge import merge_lse, normalize_partial
  out, lse = merge_lse(*normalize_partial(o, m, l), axis=2)
  b, hk = out.shape[:2]
  return out[:, :, :g].reshape(b, hk * g, -1), lse[:, :, :g].reshape(b, hk * g)


@pytest.mark.parametrize("splits,stream", [(2, True), (3, False)])
def test_paged_decode_mosaic_interpret_matches_xla(splits, stream):
  from pallas_kernels.paged_attention import paged_decode_partials
  q, kp, vp, idx, num, lengths = _decode_inputs()
  kw = dict(sink=4, window=12) if stream else dict(sink=None, window=None)
  ref, ref_lse = paged_decode_xla(q, kp, vp, idx, num, lengths, scale=0.25, num_splits=1, **kw)
  o, m, l = paged_decode_partials(q, kp, vp, idx, num, lengths, scale=0.25, interpret=True,
                                  blocks=PagedDecodeBlocks(num_splits=splits), backend="mosaic",
                                  **kw)
  assert o.shape[3] % 8 == 0 and m.shape == o.shape[:4]  # group padded to whole sublane tiles
  out, lse = _merged(o, m, l, q.shape[1] // kp.shape[1])
  np.testing.assert_allclose(out, ref, atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(lse, ref_lse, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("blocks", [PagedDecodeBlocks(), PagedDecodeBlocks(num_splits=4)])
def test_paged_decode_lowers_for_tpu(blocks):
  from pallas_kernels.paged_attention import paged_decode_partials
  q, kp, vp, idx, num, lengths = _decode_inputs(b=1, h=8, hk=2, d=128, page=16, n=16, kk=8)
  fn = lambda *a: paged_decode_partials(*a, scale=0.125, sink=16, window=32, blocks=blocks,
                                        backend="mosaic")
  text = _export_tpu(fn, q, kp.astype(jnp.bfloat16), vp.astype(jnp.bfloat16), idx, num,
                     lengths).mlir_module()
  assert "tpu_custom_call" in text and "lserve_paged_decode" in text


def test_paged_decode_mosaic_refuses_tables_beyond_smem():
  from pallas_kernels import paged_attention as kernel
  q, kp, vp, _, _, lengths = _decode_inputs()
  kk = kernel.TPU_SMEM_BUDGET_BYTES // (4 * 2 * 2 * 2) + 1
  tab = jnp.zeros((2, 2, kk), jnp.int32)
  with pytest.raises(NotImplementedError, match="SMEM"):
    kernel.paged_decode_partials(q, kp, vp, tab, tab, lengths, scale=0.25, backend="mosaic")


# ----------------------------------------------------------------------------- the project's shapes


def test_page_scores_pads_a_gqa_group_of_three():
  """SmolLM2's 9 query / 3 kv heads: the Triton path pads the group to 4 with copies of a query
  head (interpret mode, vs the XLA twin) and lowers for CUDA, where the unpadded group failed."""
  q, kmin, kmax, bt, lengths = _select_inputs(h=9, hk=3, d=64, n=16, nl=4, m=8)
  ref = page_scores_xla(q, kmin, kmax, bt, lengths, page_size=64, logical_page_size=16)
  out = page_scores_pallas(q, kmin, kmax, bt, lengths, page_size=64, logical_page_size=16,
                           interpret=True, backend="triton")
  np.testing.assert_allclose(out, ref, atol=1e-5, rtol=1e-5)
  fn = lambda *a: page_scores_pallas(*a, page_size=64, logical_page_size=16, backend="triton")
  assert "lserve_page_scores" in _export_cuda(fn, q, kmin, kmax, bt, lengths).mlir_module()


@pytest.mark.parametrize("kernel", ["select", "decode"])
def test_triton_refuses_a_head_dim_that_is_not_a_power_of_two(kernel):
  """head_dim 80: NotImplementedError before tracing (``impl="auto"`` then runs the XLA twin);
  interpret mode still runs it."""
  if kernel == "select":
    q, kmin, kmax, bt, lengths = _select_inputs(d=80)
    call = lambda **kw: page_scores_pallas(q, kmin, kmax, bt, lengths, page_size=16,
                                           logical_page_size=4, backend="triton", **kw)
  else:
    q, kp, vp, idx, num, lengths = _decode_inputs(d=80)
    call = lambda **kw: paged_decode_pallas(q, kp, vp, idx, num, lengths, scale=0.1, sink=None,
                                            window=None, **kw)
  with pytest.raises(NotImplementedError, match="head_dim=80"):
    jax.jit(lambda: call())()  # the compiled path (backend triton on any host)
  jax.block_until_ready(call(interpret=True))  # interpret mode runs any size
