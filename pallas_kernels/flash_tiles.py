"""Triton launch configurations of the flash-attention kernel, per (dtype, head_dim), and its
shared-memory budget.

One table, :data:`TRITON_TILES`, gives the largest tile and the launch parameters
(``num_warps``, ``num_stages``) that the forward, dq and dk/dv kernels all compile to within an
H100's budgets: shared memory <= 227 KiB per block and no register spills, measured by compiling
each kernel offline for sm_90a (``pallas_kernels/offline.py``; the case table is
``tests/pallas_kernels/test_sm90_compile.py``). Keyed by the input's bytes per element and the
padded head dim (the wrapper pads head_dim to a power of two >= 16: 80 and 96 run as 128).
Measured at 4 warps / 2 stages with 128 x 128 tiles, every case spilled (bf16 d=64 dk/dv: 2,884 B;
f32 d=128 forward: 320 KiB of shared memory); the table's rows, on 2026-12-06 (triton 3.9):

=========  ========  ==========  =====  ======  =================================  =========
dtype      head_dim  tile q x k  warps  stages  shared memory fwd / dq / dkdv      registers
=========  ========  ==========  =====  ======  =================================  =========
bf16/f16   <= 64     128 x 64    8      2       48 / 64 / 82 KiB                   <= 202
bf16/f16   128       128 x 64    8      2       96 / 128 / 146 KiB                 <= 248
f32        <= 64     64 x 64     8      2       80 / 96 / 81 KiB                   <= 254
f32        128       32 x 32     4      2       53 / 80 / 96 KiB                   <= 167
=========  ========  ==========  =====  ======  =================================  =========

A mask's structure may ask for smaller tiles (``BlockSizes.for_mask``: a 64-token layout runs in
64 x 64 tiles); those keep the row's warps when the tile is at least half the row's area, else 4.
Head dims above 128 have no verified row: :func:`triton_tile` raises ``NotImplementedError`` and
``impl="auto"`` runs the XLA twin. Explicit ``BlockSizes`` outside the table are checked against
the shared-memory estimate (:func:`smem_bytes`) only.
"""

from __future__ import annotations

import dataclasses

__all__ = ["H100_SMEM_BYTES", "TRITON_TILES", "TritonTile", "check_smem", "launch", "smem_bytes",
           "triton_tile"]

#: Dynamic shared memory one block may use on sm_90 (227 KiB).
H100_SMEM_BYTES = 227 * 1024


@dataclasses.dataclass(frozen=True)
class TritonTile:
  """The largest tile and the launch parameters of one (dtype, head_dim) row."""
  block_q: int
  block_k: int
  num_warps: int
  num_stages: int


#: (bytes per element, padded head_dim) -> tile; head dims 16 and 32 use the 64 row.
TRITON_TILES: dict[tuple[int, int], TritonTile] = {
    (2, 64): TritonTile(128, 64, 8, 2),
    (2, 128): TritonTile(128, 64, 8, 2),
    (4, 64): TritonTile(64, 64, 8, 2),
    (4, 128): TritonTile(32, 32, 4, 2),
}


def triton_tile(itemsize: int, head_dim: int) -> TritonTile:
  """The table row of ``itemsize`` (bytes per element of q/k/v) and ``head_dim`` (padded)."""
  key = (int(itemsize), max(64, int(head_dim)))
  if key not in TRITON_TILES:
    raise NotImplementedError(
        f"flash attention on Triton has no verified tile for {itemsize}-byte inputs at "
        f"head_dim={head_dim} (verified: {sorted(TRITON_TILES)}); the XLA twin runs it")
  return TRITON_TILES[key]


def launch(block_q: int, block_k: int, itemsize: int, head_dim: int) -> tuple[int, int]:
  """``(num_warps, num_stages)`` for a ``block_q x block_k`` tile: the row's, or 4 warps for a
  tile under half the row's area (small tiles do not fill 8 warps)."""
  row = triton_tile(itemsize, head_dim)
  warps = row.num_warps if 2 * block_q * block_k >= row.block_q * row.block_k else 4
  return warps, row.num_stages


def smem_bytes(block_q: int, block_k: int, head_dim: int, head_dim_v: int, itemsize: int,
               num_stages: int) -> int:
  """Shared memory of the largest of the three kernels (forward, dq, dk/dv): the streamed operand
  tiles once per pipeline stage plus the resident tiles, in the input dtype, and dk/dv's float32
  lse and delta rows per stage.

  * forward: ``stages * bk * (d + dv)`` (K, V) + ``bq * d`` (Q);
  * dq: ``stages * bk * (d + dv)`` (K, V) + ``bq * (d + dv)`` (Q, dO);
  * dk/dv: ``stages * bq * (d + dv)`` (Q, dO) + ``bk * (d + dv)`` (K, V) + ``stages * bq * 8``.

  Against the offline sm_90a compile: exact for the largest kernel at 128 x 128 (bf16 d=64: 98
  KiB; f32 d=128: 384 KiB) and at every row of the table but one, where it is 16 KiB above
  (bf16 d=128 dk/dv, 162 estimated vs 146 compiled): an upper bound, as a refusal needs."""
  per_stage = block_k * (head_dim + head_dim_v)
  fwd = num_stages * per_stage + block_q * head_dim
  dq = num_stages * per_stage + block_q * (head_dim + head_dim_v)
  dkdv = (num_stages * block_q + block_k) * (head_dim + head_dim_v)
  return itemsize * max(fwd, dq, dkdv) + num_stages * block_q * 8


def check_smem(block_q: int, block_k: int, head_dim: int, head_dim_v: int, itemsize: int,
               num_stages: int, limit: int = H100_SMEM_BYTES) -> None:
  """``NotImplementedError`` (so ``auto`` falls back) when :func:`smem_bytes` exceeds ``limit``."""
  need = smem_bytes(block_q, block_k, head_dim, head_dim_v, itemsize, num_stages)
  if need > limit:
    raise NotImplementedError(
        f"flash attention tiles {block_q} x {block_k} at head_dim={head_dim}, {itemsize}-byte "
        f"inputs, {num_stages} stages need ~{need // 1024} KiB of shared memory > {limit // 1024} "
        "KiB (H100); use smaller BlockSizes or the XLA twin")
