"""Compute tiles follow the mask's structure: a 64-token block-sparse layout (or a sink / short
window) is computed in 64 x 64 tiles, so the visited tiles are exactly the visited layout blocks;
parity with the reference (forward, gradients, lse) on those tiles at a length that is not a
multiple of the tile."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsys.ops import attention
from jaxsys.ops import masks as M
from jaxsys.ops.attn import layout as layout_lib
from jaxsys.ops.attn import xla
from jaxsys.ops.attn.xla import XlaBlockSizes


def test_tiles_follow_the_granularity():
  lay = np.ones((1, 4, 4), bool)
  assert XlaBlockSizes.for_mask(None) == xla.DENSE  # unmasked: tall dense tiles
  assert XlaBlockSizes.for_mask(None, packed=True) == XlaBlockSizes()
  assert XlaBlockSizes.for_mask(M.Causal()) == xla.UNSTRUCTURED  # no finer structure: tall tiles
  assert XlaBlockSizes.for_mask(M.Causal(), packed=True) == XlaBlockSizes()
  assert XlaBlockSizes.for_mask(M.Causal(), q_len=xla.SINGLE_TILE_MAX_Q) == XlaBlockSizes()
  assert XlaBlockSizes.for_mask(M.BlockSparse(lay, 64, 64)) == XlaBlockSizes(64, 64)
  assert XlaBlockSizes.for_mask(M.Causal() & M.BlockSparse(lay, 128, 64)) == XlaBlockSizes(64, 64)
  assert XlaBlockSizes.for_mask(M.BlockSparse(lay, 16, 16)) == XlaBlockSizes(32, 32)
  assert XlaBlockSizes.for_mask(M.BlockSparse(lay, 512, 512)) == XlaBlockSizes()
  assert XlaBlockSizes.for_mask(M.Sink(64) | M.Local(256)) == XlaBlockSizes(64, 64)
  assert XlaBlockSizes.for_mask(M.Local(4096)) == xla.UNSTRUCTURED


def test_visited_tiles_are_the_visited_layout_blocks(monkeypatch):
  seen = []
  real = layout_lib.compile_layout
  monkeypatch.setattr(layout_lib, "compile_layout", lambda *a, **kw: seen.append(real(*a, **kw)) or seen[-1])
  t, blk = 1024, 64
  rng = np.random.default_rng(0)
  lay = rng.random((1, t // blk, t // blk)) < 0.1
  q, k, v = (jnp.asarray(rng.standard_normal((1, t, 2, 16)).astype(np.float32)) for _ in range(3))
  attention(q, k, v, mask=M.BlockSparse(lay, blk, blk), impl="xla")
  (plan,) = seen
  assert (plan.block_q, plan.block_k) == (blk, blk)
  assert int((plan.cls != layout_lib.SKIP).sum()) == int(lay.sum())


@pytest.mark.parametrize("mask_fn", [
    lambda lay: M.BlockSparse(lay, 64, 64),
    lambda lay: M.Causal() & M.BlockSparse(lay, 64, 64),
    lambda lay: M.Sink(64) | M.Local(200),
], ids=["block_sparse", "causal_and_block_sparse", "sink_local"])
def test_fine_tiles_match_the_reference(mask_fn):
  t = 1000  # not a multiple of the 64-token tile
  rng = np.random.default_rng(1)
  lay = rng.random((1, -(-t // 64), -(-t // 64))) < 0.3
  lay[:, np.arange(lay.shape[1]), np.arange(lay.shape[1])] = True
  mask = mask_fn(lay)
  q, k, v = (jnp.asarray(rng.standard_normal((1, t, 4, 16)).astype(np.float32)) for _ in range(3))

  def loss(impl):
    def f(q, k, v):
      o, lse = attention(q, k, v, mask=mask, impl=impl, return_lse=True)
      return jnp.sum(o * o) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0)), (o, lse)
    return jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True)(q, k, v)

  (_, (o, lse)), grads = loss("xla")
  (_, (o_ref, lse_ref)), grads_ref = loss("reference")
  np.testing.assert_allclose(np.asarray(o), np.asarray(o_ref), atol=2e-5)
  np.testing.assert_allclose(np.asarray(lse), np.asarray(lse_ref), atol=2e-5)
  for g, g_ref in zip(grads, grads_ref):
    np.testing.assert_allclose(np.asarray(g), np.asarray(g_ref), atol=2e-4)
