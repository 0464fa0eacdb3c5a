"""Pallas quantized aggregation: interpret mode vs the XLA twin; Triton lowering for CUDA."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

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
  exp = jax.export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=[
      jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(*args)
  assert "quantized_aggregate_b" in exp.mlir_module()


def test_block_validation():
  with pytest.raises(ConfigError, match="block_nodes"):
    AggregateBlock(block_nodes=12)
  with pytest.raises(ConfigError, match="num_warps"):
    AggregateBlock(num_warps=3)
