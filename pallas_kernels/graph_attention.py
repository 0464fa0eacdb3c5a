"""Pallas kernel: masked dense attention on the tiles of a reordered graph (ECR dense blocks).

XLA twin: ``jaxsys.ops.graph_attn._tile_partials_xla`` (used by
``jaxsys.ops.graph_attn.tile_graph_attention(..., impl="xla")``).

Input tiles are gathered by the caller: ``qt, kt, vt [T, B, H, D]`` (query block ``rows[t]``,
key block ``cols[t]``) and the adjacency bits ``[T, B, B]``. One program per (tile, head)
computes ``S = Q K^T * scale`` masked by the bits, and returns the tile-normalised output and
its float32 log-sum-exp (``-inf`` on rows with no visible key); the caller merges tiles of the
same query block with the log-sum-exp rule. Keys are visited ``block_k`` at a time with an online
softmax (FlashAttention-2, Dao 2023). The backward recomputes ``P = exp(S - lse)`` per tile:
``dV = P^T dO``, ``dS = P (dO V^T - delta + dlse)``, ``dQ = dS K scale``, ``dK = dS^T Q scale``
with ``delta = rowsum(dO * O)``.

Triton ("triton") wants power-of-two sizes: ``B``, ``D`` and ``block_k`` must be powers of two
(B >= 16 for ``tl.dot``). Mosaic ("mosaic", TPU) takes the full ``(B, D)`` tiles and ``(B, B)``
bits as blocks (a block's last two dims equal to the array's are always allowed); a key
sub-block must be the whole tile or a multiple of 128 lanes, since the bits are sliced along
their lane dim. On Mosaic the bits travel as int32 so the mask shares the 32-bit layout of the
logits. Row statistics (lse, dlse, m, l) are ``[B, 1]`` columns on both backends, so the lse
arrays are ``[T, H, B, 1]`` inside the calls (``[T, H, B]`` at their interface).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.errors import ConfigError, ShapeError

from pallas_kernels.backend import BACKENDS, resolve_backend, triton_params  # noqa: F401  (re-exported)

__all__ = ["BACKENDS", "resolve_backend", "tile_attention", "tile_attention_bwd_call", "tile_attention_fwd_call", "TileBlocks"]


@dataclasses.dataclass(frozen=True)
class TileBlocks:
  """Key sub-block of a tile (None: the whole tile) and Triton launch parameters."""
  block_k: int | None = None
  num_warps: int = 4
  num_stages: int = 1

  def __post_init__(self):
    if self.block_k is not None and (self.block_k <= 0 or self.block_k & (self.block_k - 1)):
      raise ConfigError(f"block_k={self.block_k} must be a positive power of two")
    if self.num_warps <= 0 or self.num_warps & (self.num_warps - 1):
      raise ConfigError(f"num_warps={self.num_warps} must be a positive power of two")
    if self.num_stages <= 0:
      raise ConfigError(f"num_stages={self.num_stages} must be positive")

  @classmethod
  def for_tile(cls, b: int, d: int) -> "TileBlocks":
    """The verified Triton launch for ``b x b`` tiles of head dim ``d`` (``TRITON_TILES``:
    forward and backward compiled offline for sm_90a within 227 KiB of shared memory and without
    spills); ``NotImplementedError`` beyond the table (``impl="auto"`` falls back to XLA)."""
    for (tb, td), cfg in sorted(TRITON_TILES.items()):
      if b <= tb and d <= td:
        return cfg
    raise NotImplementedError(
        f"graph tile attention on Triton has no verified launch for {b} x {b} tiles at head_dim "
        f"{d} (verified: {sorted(TRITON_TILES)}; at 128 x 128 the backward needs >= 290 KiB of "
        "shared memory); the XLA twin runs it")

  def resolve(self, b: int, backend: str = "triton") -> int:
    bk = self.block_k or b
    if b % bk:
      raise ConfigError(f"block_k={bk} must divide the tile size {b}")
    if backend == "mosaic" and bk != b and bk % 128:
      raise ConfigError(f"block_k={bk} must be the whole tile ({b}) or a multiple of 128 on "
                        "Mosaic (the bits are sliced along their lane dim)")
    return bk


#: (tile size B, head dim D) -> the launch that fits an H100 at every smaller (B, D), from the
#: offline sm_90a compile (pallas_kernels/offline.py) on 2026-12-06: forward / backward shared
#: memory and registers. At the default launch (whole-tile keys, 4 warps) B=128 D=64 spilled
#: 1.8 KB in the backward and B=128 D=128 needed 392 KiB.
TRITON_TILES = {
    (64, 64): TileBlocks(None, 4, 1),     # f32: 52 / 100 KiB, 90 / 195 registers
    (64, 128): TileBlocks(None, 8, 1),    # f32: 100 / 196 KiB, 90 / 186 registers
    (128, 64): TileBlocks(32, 8, 1),      # f32: 52 / 152 KiB, 127 / 146 registers
}


def _loop(n, body, init):
  """``fori_loop(0, n, body, init)``; one step is traced with a static 0, so the slices it
  takes are static (Mosaic cannot slice lanes at a dynamic offset that is not 128-aligned)."""
  return body(0, init) if n == 1 else jax.lax.fori_loop(0, n, body, init)


def _key_slice(j, block_k):
  start = j * block_k if isinstance(j, int) else pl.multiple_of(j * block_k, block_k)
  return pl.ds(start, block_k)


def _dot_t(a, b):  # a [m, d] . b[n, d]^T -> [m, n]
  return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def _fwd_kernel(q_ref, k_ref, v_ref, bits_ref, o_ref, lse_ref, *, scale, block_k):
  b, d = q_ref.shape
  q = q_ref[...].astype(jnp.float32)

  def body(j, carry):
    m, l, acc = carry                                   # [B, 1], [B, 1], [B, D]
    ks = _key_slice(j, block_k)
    k = k_ref[ks, :].astype(jnp.float32)
    v = v_ref[ks, :].astype(jnp.float32)
    vis = bits_ref[:, ks] != 0
    s = jnp.where(vis, _dot_t(q, k) * scale, -jnp.inf)  # [B, block_k]
    m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    p = jnp.where(vis, jnp.exp(s - m_safe), 0.0)
    alpha = jnp.where(m == -jnp.inf, 0.0, jnp.exp(m - m_safe))
    l = alpha * l + jnp.sum(p, axis=1, keepdims=True)
    acc = alpha * acc + jnp.dot(p, v, preferred_element_type=jnp.float32)
    return m_new, l, acc

  init = (jnp.full((b, 1), -jnp.inf, jnp.float32), jnp.zeros((b, 1), jnp.float32),
          jnp.zeros((b, d), jnp.float32))
  m, l, acc = _loop(b // block_k, body, init)
  safe_l = jnp.where(l > 0, l, 1.0)
  o_ref[...] = (acc / safe_l).astype(o_ref.dtype)
  lse_ref[...] = jnp.where(l > 0, m + jnp.log(safe_l), -jnp.inf)


def _bwd_kernel(q_ref, k_ref, v_ref, bits_ref, o_ref, lse_ref, do_ref, dlse_ref,
                dq_ref, dk_ref, dv_ref, *, scale, block_k):
  b, d = q_ref.shape
  q = q_ref[...].astype(jnp.float32)
  do = do_ref[...].astype(jnp.float32)
  lse = lse_ref[...]                                    # [B, 1]
  lse_safe = jnp.where(lse == -jnp.inf, 0.0, lse)
  delta = jnp.sum(do * o_ref[...].astype(jnp.float32), axis=1, keepdims=True) - dlse_ref[...]

  def body(j, dq):
    ks = _key_slice(j, block_k)
    k = k_ref[ks, :].astype(jnp.float32)
    v = v_ref[ks, :].astype(jnp.float32)
    vis = bits_ref[:, ks] != 0
    p = jnp.where(vis, jnp.exp(_dot_t(q, k) * scale - lse_safe), 0.0)  # [B, bk]
    dv_ref[ks, :] = jax.lax.dot_general(p, do, (((0,), (0,)), ((), ())),
                                        preferred_element_type=jnp.float32).astype(dv_ref.dtype)
    ds = p * (_dot_t(do, v) - delta) * scale
    dk_ref[ks, :] = jax.lax.dot_general(ds, q, (((0,), (0,)), ((), ())),
                                        preferred_element_type=jnp.float32).astype(dk_ref.dtype)
    return dq + jnp.dot(ds, k, preferred_element_type=jnp.float32)

  dq = _loop(b // block_k, body, jnp.zeros((b, d), jnp.float32))
  dq_ref[...] = dq.astype(dq_ref.dtype)


def _specs(t, h, b, d):
  tile = pl.BlockSpec((None, None, b, d), lambda i, j: (i, j, 0, 0))  # [T, H, B, D]
  bits = pl.BlockSpec((None, b, b), lambda i, j: (i, 0, 0))
  row = pl.BlockSpec((None, None, b, 1), lambda i, j: (i, j, 0, 0))  # [T, H, B, 1]
  return tile, bits, row


def _params(blocks, backend):
  if backend == "mosaic":
    from jax.experimental.pallas import tpu as pltpu
    return pltpu.CompilerParams(dimension_semantics=("parallel", "parallel"))
  return triton_params(blocks.num_warps, blocks.num_stages)


def _bits(bits, backend):
  return bits.astype(jnp.int32 if backend == "mosaic" else jnp.int8)


def tile_attention_fwd_call(qh, kh, vh, bits, *, scale, blocks: TileBlocks, interpret: bool,
                            backend: str | None = None):
  """Raw forward pallas_call on head-major tiles ``[T, H, B, D]``, bits ``[T, B, B]`` ->
  ``(o [T, H, B, D], lse [T, H, B] float32)``."""
  backend = resolve_backend(backend)
  t, h, b, d = qh.shape
  tile, bit_spec, row = _specs(t, h, b, d)
  kernel = functools.partial(_fwd_kernel, scale=scale, block_k=blocks.resolve(b, backend))
  o, lse = pl.pallas_call(
      kernel, grid=(t, h), in_specs=[tile, tile, tile, bit_spec], out_specs=[tile, row],
      out_shape=[jax.ShapeDtypeStruct(qh.shape, qh.dtype),
                 jax.ShapeDtypeStruct((t, h, b, 1), jnp.float32)],
      interpret=interpret, compiler_params=None if interpret else _params(blocks, backend),
      name="graph_tile_attention_fwd")(qh, kh, vh, _bits(bits, backend))
  return o, lse[..., 0]


def tile_attention_bwd_call(qh, kh, vh, bits, oh, lse, doh, dlse, *, scale, blocks: TileBlocks,
                            interpret: bool, backend: str | None = None):
  """Raw backward pallas_call: ``(dq, dk, dv)`` head-major tiles (lse, dlse ``[T, H, B]``)."""
  backend = resolve_backend(backend)
  t, h, b, d = qh.shape
  tile, bit_spec, row = _specs(t, h, b, d)
  kernel = functools.partial(_bwd_kernel, scale=scale, block_k=blocks.resolve(b, backend))
  return pl.pallas_call(
      kernel, grid=(t, h), in_specs=[tile, tile, tile, bit_spec, tile, row, tile, row],
      out_specs=[tile, tile, tile],
      out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (qh, kh, vh)],
      interpret=interpret, compiler_params=None if interpret else _params(blocks, backend),
      name="graph_tile_attention_bwd")(qh, kh, vh, _bits(bits, backend), oh, lse[..., None],
                                       doh, dlse[..., None])


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def _tile_attention(qh, kh, vh, bits, scale, blocks, interpret, backend):
  return tile_attention_fwd_call(qh, kh, vh, bits, scale=scale, blocks=blocks,
                                 interpret=interpret, backend=backend)


def _tile_attention_fwd(qh, kh, vh, bits, scale, blocks, interpret, backend):
  o, lse = tile_attention_fwd_call(qh, kh, vh, bits, scale=scale, blocks=blocks,
                                   interpret=interpret, backend=backend)
  return (o, lse), (qh, kh, vh, bits, o, lse)


def _tile_attention_bwd(scale, blocks, interpret, backend, res, cts):
  qh, kh, vh, bits, o, lse = res
  do, dlse = cts
  dq, dk, dv = tile_attention_bwd_call(qh, kh, vh, bits, o, lse, do.astype(o.dtype),
                                       dlse.astype(jnp.float32), scale=scale, blocks=blocks,
                                       interpret=interpret, backend=backend)
  return dq, dk, dv, None


_tile_attention.defvjp(_tile_attention_fwd, _tile_attention_bwd)


def tile_attention(qt, kt, vt, bits, *, scale: float, blocks: TileBlocks | None = None,
                   interpret: bool = False, backend: str | None = None):
  """Masked attention per tile: ``qt, kt, vt [T, B, H, D]``, ``bits bool [T, B, B]`` ->
  ``(o [T, B, H, D], lse [T, H, B] float32)``; differentiable (custom VJP).

  ``backend``: "triton", "mosaic" or None (Mosaic on a TPU default backend, else Triton).
  ``blocks``: None takes ``TileBlocks.for_tile`` on compiled Triton (which refuses tiles beyond
  the verified table with ``NotImplementedError``) and ``TileBlocks()`` otherwise.
  """
  backend = resolve_backend(backend)
  if qt.ndim != 4 or kt.shape != qt.shape or vt.shape != qt.shape:
    raise ShapeError(f"qt/kt/vt must share [T, B, H, D], got {qt.shape}, {kt.shape}, {vt.shape}")
  t, b, h, d = qt.shape
  if blocks is None:
    blocks = TileBlocks.for_tile(b, d) if backend == "triton" and not interpret else TileBlocks()
  if bits.shape != (t, b, b):
    raise ShapeError(f"bits must be [T={t}, B={b}, B={b}], got {bits.shape}")
  qh, kh, vh = (jnp.swapaxes(x, 1, 2) for x in (qt, kt, vt))  # [T, H, B, D]
  blocks.resolve(b, backend)  # a bad block_k is a ConfigError before tracing the VJP
  o, lse = _tile_attention(qh, kh, vh, _bits(bits, backend), float(scale), blocks, interpret,
                           backend)
  return jnp.swapaxes(o, 1, 2), lse
