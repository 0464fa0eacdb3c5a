"""Every Pallas-Triton kernel, compiled offline for sm_90a (H100) with the ``triton`` wheel.

The invariant at each case: either the kernel refuses the case with ``NotImplementedError``
before anything is traced (so ``impl="auto"`` runs the XLA twin), or every kernel it lowers to
compiles within an H100's budgets: shared memory <= 227 KiB per block and no register spills
(``pallas_kernels.offline``). The cases are the configurations the dispatchers pick by default,
in float32 and bfloat16, at head_dim 64 / 80 / 128 (96 pads to 128 like 80) and GQA groups 1, 3,
4 and 8 (9/3 heads is SmolLM2's, 32/8 a Llama's).

At JAX's default matmul precision (f32 dots run as TF32 on the tensor cores): the suite sets
``jax_default_matmul_precision="highest"`` for its numerics, and there f32 dots lower to full-f32
multiply-adds, under which the f32 dk/dv kernel spills (4 KB at d=64) -- a user who asks for
highest precision in f32 trades registers for it.
"""

import functools

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels import offline

pytestmark = pytest.mark.skipif(offline.available() is not None, reason=str(offline.available()))

S = jax.ShapeDtypeStruct
DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16}
GROUPS = {1: (8, 8), 3: (9, 3), 4: (32, 8), 8: (8, 1)}


@pytest.fixture(autouse=True)
def _default_precision():
  with jax.default_matmul_precision("default"):
    yield


def _fits_or_refuses(fn, *args):
  """The test's invariant; returns the reports (empty when the kernel refused the case)."""
  try:
    reports = offline.compile_all(fn, *args)
  except NotImplementedError:
    return []
  assert reports, "nothing lowered to Triton"
  problems = [p for r in reports for p in r.problems()]
  assert not problems, problems
  return reports


# ----------------------------------------------------------------------------- flash attention


def _flash(mask_name: str):
  from jaxsys.ops import masks as M
  from jaxsys.ops.attn import common
  from jaxsys.ops.attn import pallas as P
  import numpy as np
  mask = {"causal": M.Causal(),
          "block-sparse 64": M.BlockSparse(np.tril(np.ones((1, 8, 8), bool)), 64, 64)}[mask_name]

  def fwd_bwd(q, k, v):
    loss = lambda q, k, v: P.pallas_attention(common.validate(q, k, v, mask=mask),
                                              backend="triton")[0].astype(jnp.float32).sum()
    return jax.grad(loss, (0, 1, 2))(q, k, v)
  return fwd_bwd


@pytest.mark.parametrize("mask", ["causal", "block-sparse 64"])
@pytest.mark.parametrize("head_dim", [64, 80, 128])
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_flash_attention_forward_and_backward(dtype, head_dim, mask):
  """The three kernels (forward, dq, dk/dv) at the tiles ``BlockSizes.for_mask`` picks: the
  table's largest for a causal mask, 64 x 64 for a 64-token layout."""
  h, hk = 8, 2
  q = S((1, 512, h, head_dim), DTYPES[dtype])
  k = S((1, 512, hk, head_dim), DTYPES[dtype])
  reports = _fits_or_refuses(_flash(mask), q, k, k)
  assert {r.name for r in reports} == {"flash_attention_fwd", "flash_attention_bwd_dq",
                                        "flash_attention_bwd_dkdv"}


def test_flash_attention_refuses_what_the_table_does_not_cover():
  """head_dim 256 has no verified tile, and explicit 128 x 128 f32 tiles at d=128 need 384 KiB:
  both are refused before tracing, so ``auto`` falls back."""
  from jaxsys.ops import masks as M
  from jaxsys.ops.attn import common
  from jaxsys.ops.attn import pallas as P
  x = jnp.zeros((1, 256, 2, 256), jnp.bfloat16)
  with pytest.raises(NotImplementedError, match="head_dim=256"):
    P.pallas_attention(common.validate(x, x, x, mask=M.Causal()), backend="triton")
  y = jnp.zeros((1, 256, 2, 128), jnp.float32)
  with pytest.raises(NotImplementedError, match="shared memory"):
    P.pallas_attention(common.validate(y, y, y, mask=M.Causal()), P.BlockSizes(128, 128),
                       backend="triton")


# ----------------------------------------------------------------------------- LServe kernels


@pytest.mark.parametrize("group", sorted(GROUPS))
@pytest.mark.parametrize("head_dim", [64, 80, 128])
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_paged_decode(dtype, head_dim, group):
  from jaxsys.ops.paged_attention import paged_decode_pallas
  h, hk = GROUPS[group]
  n, page, kk = 64, 16, 16
  args = (S((1, h, head_dim), jnp.float32), S((n, hk, page, head_dim), DTYPES[dtype]),
          S((n, hk, page, head_dim), DTYPES[dtype]), S((1, hk, kk), jnp.int32),
          S((1, hk, kk), jnp.int32), S((1,), jnp.int32))
  fn = functools.partial(paged_decode_pallas, scale=0.125, sink=16, window=32)
  reports = _fits_or_refuses(fn, *args)
  assert bool(reports) == (head_dim != 80)  # only the non-power-of-two head_dim is refused


@pytest.mark.parametrize("group", sorted(GROUPS))
@pytest.mark.parametrize("head_dim", [64, 80, 128])
def test_page_scores(head_dim, group):
  from pallas_kernels.page_select import page_scores_pallas
  h, hk = GROUPS[group]
  n, nl, m = 64, 4, 16
  args = (S((1, h, head_dim), jnp.float32), S((n, hk, nl, head_dim), jnp.float32),
          S((n, hk, nl, head_dim), jnp.float32), S((1, m), jnp.int32), S((1,), jnp.int32))
  fn = functools.partial(page_scores_pallas, page_size=64, logical_page_size=16)
  reports = _fits_or_refuses(fn, *args)
  assert bool(reports) == (head_dim != 80)


# ----------------------------------------------------------------------------- graph kernels


@pytest.mark.parametrize("tile,head_dim", [(64, 64), (64, 128), (128, 64), (128, 128)])
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_graph_tile_attention(dtype, tile, head_dim):
  """``TileBlocks.for_tile``'s launches; 128 x 128 tiles at head_dim 128 are refused."""
  from pallas_kernels.graph_attention import tile_attention
  x = S((4, tile, 4, head_dim), DTYPES[dtype])

  def fwd_bwd(q, k, v, bits):
    loss = lambda q, k, v: tile_attention(q, k, v, bits, scale=0.1, backend="triton")[0].astype(
        jnp.float32).sum()
    return jax.grad(loss, (0, 1, 2))(q, k, v)
  reports = _fits_or_refuses(fwd_bwd, x, x, x, S((4, tile, tile), jnp.bool_))
  assert bool(reports) == ((tile, head_dim) != (128, 128))


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_quantized_aggregate(bits):
  from pallas_kernels.quantized_aggregate import AggregateBlock, aggregate_group_kernel
  n, e, rows, words = 256, 1024, 512, 16
  args = (S((n,), jnp.int32), S((n,), jnp.int32), S((e,), jnp.int32), S((e,), jnp.float32),
          S((rows, words), jnp.uint32), S((rows,), jnp.float32))
  fn = functools.partial(aggregate_group_kernel, bits=bits, signed=True, block=AggregateBlock(),
                         interpret=False, backend="triton")
  assert _fits_or_refuses(fn, *args)
