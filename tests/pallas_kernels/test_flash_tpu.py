"""The Mosaic (TPU) flash-attention kernels stream the visited K/V blocks: they lower for ``tpu`` at
32K (causal, and a 64-token 10% block-sparse layout), forward and backward, with a VMEM estimate
under the ``vmem_limit_bytes`` each call sets, no block spanning the sequence, and tables within
SMEM; past a budget the wrapper refuses and ``impl="auto"`` runs the XLA twin."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsys.ops import attention, masks as M
from jaxsys.ops.attn import common, pallas as P
from pallas_kernels import flash_attention as fa, flash_tpu, offline

_KERNELS = ("flash_attention_fwd", "flash_attention_bwd_dq", "flash_attention_bwd_dkdv")
_SEQ, _H, _HK, _D = 32768, 8, 2, 128


def _sparse_10pct(n=_SEQ // 64, seed=0):
  """~10% of 64-token blocks visible, plus the diagonal (every row sees something)."""
  lay = np.random.default_rng(seed).random((1, n, n)) < 0.1
  return M.BlockSparse(lay | np.eye(n, dtype=bool)[None], 64, 64)


def _loss(mask):
  def loss(q, k, v):
    out, _ = P.pallas_attention(common.validate(q, k, v, mask=mask), backend="mosaic")
    return out.astype(jnp.float32).sum()
  return jax.grad(loss, (0, 1, 2))


def _shapes():
  q = jax.ShapeDtypeStruct((1, _SEQ, _H, _D), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((1, _SEQ, _HK, _D), jnp.bfloat16)
  return q, k, k


@pytest.mark.parametrize("name,mask", [("causal", M.Causal()), ("sparse64_10pct", _sparse_10pct())])
def test_lowers_for_tpu_at_32k_with_a_vmem_limit_above_the_estimate(name, mask):
  text = offline.export_for("tpu", _loss(mask), *_shapes()).mlir_module()
  for kernel in _KERNELS:
    assert kernel in text, kernel
  # each tpu_custom_call carries its scoped VMEM limit (CustomCallBackendConfig.to_json)
  limits = [int(x) for x in re.findall(r"scoped_memory_configs.{0,80}?size\\22: (\d+)", text)]
  assert len(limits) == 3, limits
  bs = fa.BlockSizes.for_mask(mask, q_len=_SEQ, kv_len=_SEQ, backend="mosaic")
  bq, bk = bs.block_q, bs.block_k
  estimates = [flash_tpu.vmem_bytes(k, bq, bk, _D, _D, 2) for k in ("fwd", "dq", "dkdv")]
  for limit, est in zip(sorted(limits), sorted(estimates)):
    assert est <= limit <= 4 * max(est, 1 << 20) and est <= flash_tpu.TPU_VMEM_BUDGET_BYTES


def _pallas_calls(jaxpr):
  """Every pallas_call equation, inside pjit / custom_vjp bodies too."""
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "pallas_call":
      yield eqn
      continue
    for v in eqn.params.values():
      inner = getattr(v, "jaxpr", v)
      if hasattr(inner, "eqns"):
        yield from _pallas_calls(inner)


def test_no_block_spans_the_sequence():
  """Every block the Mosaic kernels move is a tile, never a whole K/V (or Q) row: VMEM is
  independent of length (the Triton kernels hold whole rows)."""
  seq = 2048
  q = jax.ShapeDtypeStruct((1, seq, 4, 64), jnp.float32)
  k = jax.ShapeDtypeStruct((1, seq, 2, 64), jnp.float32)
  jaxpr = jax.make_jaxpr(_loss(M.Causal()))(q, k, k)
  calls = list(_pallas_calls(jaxpr.jaxpr))
  assert len(calls) == 3
  for eqn in calls:
    for bm in eqn.params["grid_mapping"].block_mappings:
      dims = [d.block_size for d in bm.block_shape if hasattr(d, "block_size")]  # not Squeezed
      assert dims and max(dims) <= 128, bm.block_shape


def test_causal_32k_table_fits_smem():
  """Packed rows ``[count, block << 2 | class]`` (no bits columns without BlockSparse layouts):
  a causal 32K table at 128-token tiles is 256 x 257 int32 words."""
  nq = _SEQ // 128
  idx = np.tile(np.arange(nq), (1, nq, 1))
  cls = np.broadcast_to(np.tril(np.ones((nq, nq), np.int64)) + 1, (1, nq, nq))
  tab = flash_tpu.pack_tables(idx, cls, np.arange(1, nq + 1)[None], np.zeros((1, nq, nq)))
  assert tab.shape == (1, nq, nq + 1) and tab.nbytes <= flash_tpu.TPU_SMEM_BUDGET_BYTES
  assert tab[0, 5, 0] == 6 and tab[0, 5, 3] >> 2 == 2 and tab[0, 5, 3] & 3 == 2


def test_budgets_refuse_and_auto_falls_back(monkeypatch):
  """A table beyond SMEM or tiles beyond VMEM: NotImplementedError before tracing; on a TPU
  backend, impl="auto" then returns the XLA twin's result."""
  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.standard_normal((1, 256, 2, 64)), jnp.float32)
  k = jnp.asarray(rng.standard_normal((1, 256, 1, 64)), jnp.float32)
  args = common.validate(q, k, k, mask=M.Causal())
  monkeypatch.setattr(flash_tpu, "TPU_SMEM_BUDGET_BYTES", 16)
  with pytest.raises(NotImplementedError, match="SMEM"):
    P.pallas_attention(args, backend="mosaic")
  monkeypatch.setattr(flash_tpu, "TPU_SMEM_BUDGET_BYTES", 1 << 20)
  monkeypatch.setattr(flash_tpu, "TPU_VMEM_BUDGET_BYTES", 1024)
  with pytest.raises(NotImplementedError, match="VMEM"):
    P.pallas_attention(args, backend="mosaic")
  ref = attention(q, k, k, mask=M.Causal(), impl="xla")
  monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
  np.testing.assert_allclose(attention(q, k, k, mask=M.Causal(), impl="auto"), ref, atol=1e-6)
