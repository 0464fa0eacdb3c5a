"""Pallas tile kernel (ECR dense blocks): interpret mode vs the XLA twin, and lowering."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import offline

from jaxsys.core.errors import ConfigError, ShapeError
from jaxsys.ops.graph_attn import _tile_partials_xla
from pallas_kernels.graph_attention import (TileBlocks, tile_attention, tile_attention_bwd_call,
                                            tile_attention_fwd_call)

T, B, H, D = 3, 16, 2, 16


def _case():
  q, k, v, w = jax.random.normal(jax.random.PRNGKey(0), (4, T, B, H, D))
  bits = jax.random.bernoulli(jax.random.PRNGKey(1), 0.3, (T, B, B))
  bits = bits.at[0, 3].set(False)  # a row with no visible key: zeros, lse -inf
  return q, k, v, w, bits


@pytest.mark.parametrize("blocks", [TileBlocks(), TileBlocks(block_k=8)])
def test_interpret_matches_xla_twin_forward_and_grad(blocks):
  q, k, v, w, bits = _case()
  scale = 0.25
  o, lse = tile_attention(q, k, v, bits, scale=scale, blocks=blocks, interpret=True)
  o_ref, lse_ref = _tile_partials_xla(q, k, v, bits, scale)
  np.testing.assert_allclose(o, o_ref, atol=2e-5)
  np.testing.assert_allclose(lse, lse_ref, atol=2e-5)
  assert np.all(np.isneginf(lse[0, :, 3])) and np.all(np.asarray(o[0, 3]) == 0)

  def loss(fn):
    def f(q, k, v):
      o, lse = fn(q, k, v)
      return jnp.sum(o * w) + 0.1 * jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))
    return jax.grad(f, (0, 1, 2))(q, k, v)

  got = loss(lambda q, k, v: tile_attention(q, k, v, bits, scale=scale, blocks=blocks, interpret=True))
  want = loss(lambda q, k, v: _tile_partials_xla(q, k, v, bits, scale))
  for a, b in zip(got, want):
    np.testing.assert_allclose(a, b, atol=5e-5)


def test_tile_graph_attention_pallas_interpret_path():
  from jaxsys import graphs as G
  from jaxsys.ops import graph_attn as GA
  ds = G.sbm_graph(60, num_classes=2, num_communities=2, avg_degree=6, seed=0)
  rg = G.reform(ds.senders, ds.receivers, ds.num_nodes, G.ReformConfig(16, 0.0))
  tiles = GA.GraphTiles.from_reformed(rg)
  q, k, v = jax.random.normal(jax.random.PRNGKey(0), (3, ds.num_nodes, 2, 16))
  a = GA.tile_graph_attention(q, k, v, tiles, impl="pallas_interpret")
  b = GA.sparse_graph_attention(q, k, v, ds.senders, ds.receivers)
  np.testing.assert_allclose(a, b, atol=2e-5)


@pytest.mark.parametrize("blocks", [TileBlocks(), TileBlocks(block_k=16, num_warps=8)])
def test_lowers_for_cuda(blocks):
  t, h, b, d = 4, 2, 32, 16
  args = (jnp.zeros((t, h, b, d)),) * 3 + (jnp.zeros((t, b, b), jnp.int8),)
  fwd = lambda *a: tile_attention_fwd_call(*a, scale=0.25, blocks=blocks, interpret=False)
  exp = offline.export_for("cuda", fwd, *args)
  assert "graph_tile_attention_fwd" in exp.mlir_module()
  bargs = args + (jnp.zeros((t, h, b, d)), jnp.zeros((t, h, b)), jnp.zeros((t, h, b, d)),
                  jnp.zeros((t, h, b)))
  bwd = lambda *a: tile_attention_bwd_call(*a, scale=0.25, blocks=blocks, interpret=False)
  exp = offline.export_for("cuda", bwd, *bargs)
  assert "graph_tile_attention_bwd" in exp.mlir_module()


def test_validation():
  with pytest.raises(ConfigError, match="block_k"):
    TileBlocks(block_k=12)
  with pytest.raises(ConfigError, match="divide"):
    TileBlocks(block_k=64).resolve(32)
  q = jnp.zeros((2, 16, 1, 16))
  with pytest.raises(ShapeError, match="bits"):
    tile_attention(q, q, q, jnp.zeros((2, 8, 8), bool), scale=1.0, interpret=True)


# ----------------------------------------------------------------------------- Mosaic (TPU)


def test_mosaic_path_interpret_matches_xla_twin_forward_and_grad():
  q, k, v, w, bits = _case()
  tile = lambda q, k, v: tile_attention(q, k, v, bits, scale=0.25, interpret=True,
                                        backend="mosaic")
  fast = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}

  def run(fn):  # forward and the gradient of a loss on o and lse, in one fast compile
    def f(q, k, v):
      (o, lse), vjp = jax.vjp(fn, q, k, v)
      return o, lse, vjp((w, jnp.where(jnp.isfinite(lse), 0.1, 0.0)))
    return jax.jit(f).lower(q, k, v).compile(fast)(q, k, v)

  o, lse, grads = run(tile)
  o_ref, lse_ref, grads_ref = run(lambda q, k, v: _tile_partials_xla(q, k, v, bits, 0.25))
  np.testing.assert_allclose(o, o_ref, atol=2e-5)
  np.testing.assert_allclose(lse, lse_ref, atol=2e-5)
  assert np.all(np.isneginf(lse[0, :, 3]))
  for a, b in zip(grads, grads_ref):
    np.testing.assert_allclose(a, b, atol=5e-5)


@pytest.mark.parametrize("b,blocks", [(32, TileBlocks()), (256, TileBlocks(block_k=128))])
def test_lowers_for_tpu(b, blocks):
  t, h, d = 2, 2, 64
  args = (jnp.zeros((t, h, b, d), jnp.bfloat16),) * 3 + (jnp.zeros((t, b, b), jnp.int8),)
  call = lambda fn: (lambda *a: fn(*a, scale=0.25, blocks=blocks, interpret=False,
                                   backend="mosaic"))
  text = offline.export_for("tpu", call(tile_attention_fwd_call),
      *args).mlir_module()
  assert "tpu_custom_call" in text and "graph_tile_attention_fwd" in text
  row = jnp.zeros((t, h, b))
  bargs = args + (args[0], row, args[0], row)
  text = offline.export_for("tpu", call(tile_attention_bwd_call),
      *bargs).mlir_module()
  assert "tpu_custom_call" in text and "graph_tile_attention_bwd" in text


def test_mosaic_sub_blocks_must_be_lane_aligned():
  with pytest.raises(ConfigError, match="multiple of 128 on Mosaic"):
    TileBlocks(block_k=16).resolve(32, "mosaic")
  assert TileBlocks(block_k=16).resolve(32) == 16 and TileBlocks().resolve(32, "mosaic") == 32
  with pytest.raises(ConfigError, match="backend"):
    tile_attention(*_case()[:3], _case()[4], scale=1.0, backend="cuda")
