"""Flash-attention forward as a Triton-language kernel, called from JAX through ``jax_triton``:
the GPU route that outlives Pallas' Triton backend.

Why this route. JAX 0.11's Pallas changelog deprecates the Triton backend ("To keep using Pallas
on GPU, please migrate to the Mosaic GPU backend. To keep using Triton, switch to the official
Triton bindings and jax_triton"). Of the two, this one keeps what the project already verifies:
the kernel is Triton, so the ``triton`` wheel compiles it for ``sm_90a`` on a CPU host and
``ptxas -v`` checks its shared memory and spills (:func:`compile_sm90`, the same report as
``offline.py``), and Triton's own interpreter runs it on CPU for the correctness tests
(:func:`interpret`, torch CPU tensors). A Mosaic GPU kernel (tokamax's ``pallas_mosaic_gpu``)
would need an H100 for every one of those checks. The Pallas-Triton kernels
(``flash_attention.py``) stay the ``"pallas"`` implementation, and carry the backward, until this
route passes the device suite (``python -m experiments.device``).

Scope: the forward of dense or causal attention (query position ``q_offset + i`` sees keys
``<= `` it), bf16 / f16 inputs, head_dim a power of two in 16..128, GQA by ``h // group``;
lengths are padded to the tiles by the caller. FlashAttention-2's online softmax (Dao 2023,
Alg. 1) over ``[BLOCK_M, HEAD_DIM]`` query tiles; a causal program stops at its diagonal.

Layout: q / o ``[b, h, Tq, d]``, k / v ``[b, hk, Tk, d]`` contiguous; lse ``[b, h, Tq]`` f32.
"""

from __future__ import annotations

import dataclasses

import numpy as np

__all__ = ["TILES", "TritonFlashTiles", "compile_sm90", "flash_forward", "interpret", "kernel"]


@dataclasses.dataclass(frozen=True)
class TritonFlashTiles:
  """Tile and launch parameters; :data:`TILES` holds the verified ones."""
  block_m: int = 128
  block_n: int = 64
  num_warps: int = 8
  num_stages: int = 2


#: Per padded head_dim (bf16 / f16 inputs): compiled for sm_90a with no spills and shared memory
#: within 227 KiB, dense and causal (``tests/pallas_kernels/test_triton_flash.py`` re-checks every
#: row). Measured with triton 3.9: d <= 64 at 128 x 64, 8 warps: 32 KiB, <= 223 registers; at
#: d = 128 that tile spills 20 B in the causal kernel (255 registers), and 128 x 128 spills
#: 1,328 B, so d = 128 runs 128 x 32 (48 KiB, 255 registers, no spills).
TILES = {16: TritonFlashTiles(), 32: TritonFlashTiles(), 64: TritonFlashTiles(),
         128: TritonFlashTiles(block_m=128, block_n=32, num_warps=8, num_stages=2)}

_KERNEL = None


def kernel():
  """The ``@triton.jit`` function (built on first use: ``triton`` is an optional dependency)."""
  global _KERNEL
  if _KERNEL is None:
    _KERNEL = _build()
  return _KERNEL


def _build():
  import triton  # noqa: PLC0415
  import triton.language as tl  # noqa: PLC0415

  @triton.jit
  def flash_fwd(Q, K, V, O, L, SCALE: tl.constexpr, H: tl.constexpr, GROUP: tl.constexpr,
                TQ: tl.constexpr, TK: tl.constexpr, KV_LEN: tl.constexpr, Q_OFFSET: tl.constexpr,
                CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr):
    start_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    hk = (bh % H) // GROUP
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)            # query rows of this program
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + (bh * TQ + offs_m[:, None]) * HEAD_DIM + offs_d[None, :])     # [BM, D]
    kv_base = (b * (H // GROUP) + hk) * TK
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    hi = TK
    if CAUSAL:  # keys past the last query of this tile are never visible
      hi = tl.minimum(TK, (start_m + 1) * BLOCK_M + Q_OFFSET)
    for start_n in range(0, hi, BLOCK_N):
      cols = start_n + offs_n
      k = tl.load(K + (kv_base + cols[:, None]) * HEAD_DIM + offs_d[None, :])     # [BN, D]
      v = tl.load(V + (kv_base + cols[:, None]) * HEAD_DIM + offs_d[None, :])
      s = tl.dot(q, tl.trans(k)) * SCALE                                          # [BM, BN] f32
      visible = cols[None, :] < KV_LEN
      if CAUSAL:
        visible = visible & (cols[None, :] <= offs_m[:, None] + Q_OFFSET)
      s = tl.where(visible, s, float("-inf"))
      m_new = tl.maximum(m_i, tl.max(s, 1))
      m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)                       # empty rows stay finite
      p = tl.exp(s - m_safe[:, None])
      alpha = tl.exp(m_i - m_safe)
      l_i = l_i * alpha + tl.sum(p, 1)
      acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
      m_i = m_new
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    tl.store(O + (bh * TQ + offs_m[:, None]) * HEAD_DIM + offs_d[None, :], (acc / l_safe[:, None]).to(O.dtype.element_ty))
    tl.store(L + bh * TQ + offs_m, tl.where(l_i > 0, m_i + tl.log(l_safe), float("-inf")))

  return flash_fwd


def _constexprs(shape_q, shape_k, *, scale, kv_len, q_offset, causal, tiles: TritonFlashTiles) -> dict:
  b, h, tq, d = shape_q
  hk, tk = shape_k[1], shape_k[2]
  if tq % tiles.block_m or tk % tiles.block_n:
    raise ValueError(f"lengths Tq={tq}, Tk={tk} must be padded to the tiles {tiles.block_m} x {tiles.block_n}")
  return dict(SCALE=float(scale), H=h, GROUP=h // hk, TQ=tq, TK=tk, KV_LEN=int(kv_len),
              Q_OFFSET=int(q_offset), CAUSAL=bool(causal), HEAD_DIM=d, BLOCK_M=tiles.block_m,
              BLOCK_N=tiles.block_n)


def flash_forward(q, k, v, *, scale: float, kv_len: int, q_offset: int = 0, causal: bool,
                  tiles: TritonFlashTiles):
  """``(o [b, h, Tq, d], lse [b, h, Tq] f32)`` on a GPU through ``jax_triton.triton_call``
  (inputs padded to the tiles; see the module docstring)."""
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415
  import jax_triton as jt  # noqa: PLC0415
  b, h, tq, _ = q.shape
  meta = _constexprs(q.shape, k.shape, scale=scale, kv_len=kv_len, q_offset=q_offset,
                     causal=causal, tiles=tiles)
  return jt.triton_call(
      q, k, v, kernel=kernel(), grid=(tq // tiles.block_m, b * h),
      out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((b, h, tq), jnp.float32)],
      num_warps=tiles.num_warps, num_stages=tiles.num_stages, **meta)


def interpret(q, k, v, *, scale: float, kv_len: int, q_offset: int = 0, causal: bool,
              tiles: TritonFlashTiles):
  """The same kernel run by Triton's interpreter on CPU (numpy in, numpy out; needs torch):
  what the tests compare against the XLA twin. The process must have ``TRITON_INTERPRET=1`` in
  its environment before ``triton`` is imported (the interpreter replaces ``triton.jit``, the
  language's own helpers included); the tests run it in a subprocess."""
  import os  # noqa: PLC0415

  import torch  # noqa: PLC0415
  if os.environ.get("TRITON_INTERPRET") != "1":
    raise RuntimeError("interpret() needs TRITON_INTERPRET=1 set before triton is imported")
  meta = _constexprs(q.shape, k.shape, scale=scale, kv_len=kv_len, q_offset=q_offset,
                     causal=causal, tiles=tiles)
  t = lambda x: torch.from_numpy(np.ascontiguousarray(x))  # noqa: E731
  qt, kt, vt = t(q), t(k), t(v)
  o = torch.empty_like(qt)
  lse = torch.empty(q.shape[:3], dtype=torch.float32)
  grid = (q.shape[2] // tiles.block_m, q.shape[0] * q.shape[1])
  kernel()[grid](qt, kt, vt, o, lse, **meta)
  return o.numpy(), lse.numpy()


def compile_sm90(dtype: str, shape_q, shape_k, *, causal: bool, tiles: TritonFlashTiles,
                 kv_len: int | None = None):
  """Compiles the kernel for ``sm_90a`` with the ``triton`` wheel (no GPU) and returns
  ``offline.KernelReport`` (shared memory, registers, spills from ``ptxas -v``)."""
  from triton.compiler import ASTSource  # noqa: PLC0415

  from pallas_kernels import offline  # noqa: PLC0415
  fn = kernel()
  ptr = {"bfloat16": "*bf16", "float16": "*fp16"}[dtype]
  meta = _constexprs(shape_q, shape_k, scale=1.0, kv_len=kv_len or shape_k[2], q_offset=0,
                     causal=causal, tiles=tiles)
  signature = {"Q": ptr, "K": ptr, "V": ptr, "O": ptr, "L": "*fp32", **{k: "constexpr" for k in meta}}
  src = ASTSource(fn, signature, constexprs=meta)
  return offline.compile_source(src, "flash_fwd_jax_triton", tiles.num_warps, tiles.num_stages)
