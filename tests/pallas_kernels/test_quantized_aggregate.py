"""Pallas quantized aggregation: interpret mode vs the XLA twin; Triton lowering for CUDA."""

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import offline

from jaxsys.core.errors import ConfigError
from jaxsys.ops import quantized_aggregate
from jaxsys.quant.packing import pack_features
from pallas_kernels.quantized_aggregate import AggregateBlock, aggregate_group_kernel


def make_case(signed, bits_choice, n=20, f=21, e=48, seed=0):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(n, f)).astype(np.float32)
  x = x if signed else np.abs(x)
  bits = rng.choice(bits_choice, n)
  qmax = np.maximum(2.0 ** (bits - 1) - 1, 1) if signed else 2.0 ** bits - 1
  pk = pack_features(x, bits, np.abs(x).max(1) / qmax, signed=signed)
  return pk, rng.integers(0, n, e), rng.integers(0, n, e)


@pytest.mark.parametrize("signed,bits,aggregation,block", [
    (True, [3, 8], "gcn", AggregateBlock()),
    (False, [1, 5], "sum", AggregateBlock(block_nodes=16, num_warps=2)),
])
def test_interpret_matches_xla_twin(signed, bits, aggregation, block):
  pk, s, r = make_case(signed, bits)
  ref = quantized_aggregate(pk, (s, r), aggregation=aggregation, impl="xla")
  out = quantized_aggregate(pk, (s, r), aggregation=aggregation, impl="pallas_interpret",
                            block=block)
  np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("block", [AggregateBlock(), AggregateBlock(block_nodes=32, num_warps=8)])
@pytest.mark.parametrize("bits", [3, 8])
def test_lowers_for_cuda(block, bits):
  fn = lambda *a: aggregate_group_kernel(*a, bits=bits, signed=True, block=block, interpret=False)
  args = (jnp.zeros(64, jnp.int32), jnp.zeros(64, jnp.int32), jnp.zeros(128, jnp.int32),
          jnp.zeros(128, jnp.float32), jnp.zeros((32, 8), jnp.uint32), jnp.zeros(32, jnp.float32))
  exp = offline.export_for("cuda", fn, *args)
  assert "quantized_aggregate_b" in exp.mlir_module()


def test_block_validation():
  with pytest.raises(ConfigError, match="block_nodes"):
    AggregateBlock(block_nodes=12)
  with pytest.raises(ConfigError, match="num_warps"):
    AggregateBlock(num_warps=3)


# ----------------------------------------------------------------------------- Mosaic (TPU)


@pytest.mark.parametrize("signed,bits,aggregation,block", [
    (True, [3, 8], "gcn", AggregateBlock()),
    (False, [1, 5], "sum", AggregateBlock(block_nodes=16)),
])
def test_mosaic_path_interpret_matches_xla_twin(signed, bits, aggregation, block):
  from jaxsys.ops.quantized_agg import _sum_groups, _xla_group, plan_aggregation
  from pallas_kernels.quantized_aggregate import group_aggregate
  pk, s, r = make_case(signed, bits)
  plan = plan_aggregation(pk, (s, r), aggregation)
  ref = _sum_groups(pk, plan, lambda w, sc, ge, b: _xla_group(
      w, sc, ge, b, pk.num_features, pk.signed, pk.num_nodes))
  out = _sum_groups(pk, plan, lambda w, sc, ge, b: group_aggregate(
      w, sc, ge, bits=b, num_features=pk.num_features, signed=pk.signed,
      num_nodes=pk.num_nodes, block=block, interpret=True, backend="mosaic"))
  np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)


def _kernel_args(nodes=64, edges=128, rows=32, words=8):
  return (jnp.zeros(nodes, jnp.int32), jnp.zeros(nodes, jnp.int32), jnp.zeros(edges, jnp.int32),
          jnp.zeros(edges, jnp.float32), jnp.zeros((rows, words), jnp.uint32),
          jnp.zeros(rows, jnp.float32))


@pytest.mark.parametrize("block", [AggregateBlock(), AggregateBlock(block_nodes=32)])
@pytest.mark.parametrize("bits", [3, 8])
def test_lowers_for_tpu(block, bits):
  fn = lambda *a: aggregate_group_kernel(*a, bits=bits, signed=True, block=block,
                                         interpret=False, backend="mosaic")
  text = offline.export_for("tpu", fn, *_kernel_args()).mlir_module()
  assert "tpu_custom_call" in text and f"quantized_aggregate_b{bits}" in text


def test_mosaic_refuses_a_graph_beyond_its_on_chip_budget():
  from pallas_kernels import quantized_aggregate as kernel
  edges = kernel.TPU_SMEM_BUDGET_BYTES // 8
  with pytest.raises(NotImplementedError, match="SMEM"):
    aggregate_group_kernel(*_kernel_args(edges=edges), bits=4, signed=False,
                           block=AggregateBlock(), interpret=True, backend="mosaic")
  rows = kernel.TPU_VMEM_BUDGET_BYTES // (2 * 128 * 4) + 8
  with pytest.raises(NotImplementedError, match="VMEM"):
    aggregate_group_kernel(*_kernel_args(rows=rows), bits=4, signed=False,
                           block=AggregateBlock(), interpret=True, backend="mosaic")
