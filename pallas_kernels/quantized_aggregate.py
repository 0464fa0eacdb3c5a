"""Pallas kernel: dequantize-on-load sparse aggregation of one bitwidth group of packed features.

XLA twin: ``jaxsys.ops.quantized_agg._xla_group`` (called through
``jaxsys.ops.quantized_aggregate(..., impl="xla")``).

Each program owns ``block_nodes`` destination rows. For every row it walks that row's incoming
edges (CSR by destination: ``starts[d]..ends[d]``), loads the source's packed uint32 words
(``W`` words instead of ``F`` float32 values), unpacks them with a broadcast shift (the package
is field-major: feature ``k*W + w`` is field k of word w) and accumulates
``weight_e * scale[src] * code`` in float32 registers laid out ``[fields, words]``. The wrapper
reshapes ``[N, fields, words] -> [N, F]``.

The op is an inference path (its inputs are integer codes), so it has no custom_vjp; training
uses the float fake-quantized layers of ``jaxsys.nn.quantized``.

Triton wants power-of-two block shapes: fields and words are padded to powers of two inside
the kernel (masked), and the edge / row arrays are padded to powers of two by the wrapper.

Mosaic (TPU) path: the CSR offsets, edge sources, edge weights and row scales sit whole in SMEM
(scalar reads drive the loops), the packed words sit whole in VMEM as int32 (bit-identical; the
shift is logical) and each edge loads its source's ``[1, W]`` row at a dynamic sublane offset.
Whole-array residency bounds the graph: past ``TPU_SMEM_BUDGET_BYTES`` of offsets/edges or
``TPU_VMEM_BUDGET_BYTES`` of (lane-padded, double-buffered) words the wrapper raises
``NotImplementedError``, and the op falls back to its XLA twin.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from pallas_kernels.errors import ConfigError

from pallas_kernels.backend import BACKENDS, next_pow2, resolve_backend, triton_params  # noqa: F401  (re-exported)

__all__ = [
    "BACKENDS", "resolve_backend", "aggregate_group_kernel", "AggregateBlock", "group_aggregate", "TPU_SMEM_BUDGET_BYTES",
    "TPU_VMEM_BUDGET_BYTES",
]

# 1 MiB of SMEM per core from TPU v4 on, 16 MiB of scoped VMEM by default: half of each.
TPU_SMEM_BUDGET_BYTES = 512 * 1024
TPU_VMEM_BUDGET_BYTES = 8 * 1024 * 1024


@dataclasses.dataclass(frozen=True)
class AggregateBlock:
  """Destination rows per program and Triton launch parameters."""
  block_nodes: int = 8
  num_warps: int = 4
  num_stages: int = 1

  def __post_init__(self):
    for name in ("block_nodes", "num_warps"):
      v = getattr(self, name)
      if v <= 0 or v & (v - 1):
        raise ConfigError(f"{name}={v} must be a positive power of two")
    if self.block_nodes > 1024:
      raise ConfigError(f"block_nodes={self.block_nodes} must be <= 1024")
    if self.num_stages <= 0:
      raise ConfigError(f"num_stages={self.num_stages} must be positive")


def _kernel(starts_ref, ends_ref, src_ref, w_ref, words_ref, scales_ref, out_ref, *, bits: int,
            fields: int, signed: bool, block_nodes: int):
  k_pad, w_pad = out_ref.shape[1], out_ref.shape[2]
  k = jnp.arange(k_pad, dtype=jnp.int32)[:, None]                    # [fields, 1]
  valid = k < fields
  shift = jnp.where(valid, k * bits, 0).astype(jnp.uint32)             # no shift >= 32
  mask = jnp.uint32((1 << bits) - 1)
  bias = float(2 ** (bits - 1)) if signed else 0.0

  def edge(j, acc):
    row = src_ref[j]
    coef = w_ref[j] * scales_ref[row]
    words = words_ref[row, :]                                          # [words]: packed bytes
    codes = (words[None, :] >> shift) & mask                           # [fields, words]
    vals = codes.astype(jnp.int32).astype(jnp.float32) - bias
    return acc + jnp.where(valid, vals, 0.0) * coef

  def row(r, carry):
    acc = jax.lax.fori_loop(starts_ref[r], ends_ref[r], edge,
                            jnp.zeros((k_pad, w_pad), jnp.float32))
    out_ref[r, :, :] = acc
    return carry

  jax.lax.fori_loop(0, block_nodes, row, 0)


def _mosaic_kernel(starts_ref, ends_ref, src_ref, w_ref, words_ref, scales_ref, out_ref, *,
                   bits: int, fields: int, signed: bool, block_nodes: int):
  first = pl.program_id(0) * block_nodes
  k_pad, w_pad = out_ref.shape[1], out_ref.shape[2]
  k = jax.lax.broadcasted_iota(jnp.int32, (k_pad, w_pad), 0)        # field of each lane
  valid = k < fields
  shift = jnp.where(valid, k * bits, 0)                                # no shift >= 32
  mask = (1 << bits) - 1
  bias = float(2 ** (bits - 1)) if signed else 0.0

  def edge(j, acc):
    row = src_ref[j]                                                   # SMEM scalars
    coef = w_ref[j] * scales_ref[row]
    words = jnp.broadcast_to(words_ref[pl.ds(row, 1), :], (k_pad, w_pad))  # int32 [1, W] row
    codes = jax.lax.shift_right_logical(words, shift) & mask           # [fields, words]
    vals = codes.astype(jnp.float32) - bias
    return acc + jnp.where(valid, vals, 0.0) * coef

  def row(r, carry):
    node = first + r
    acc = jax.lax.fori_loop(starts_ref[node], ends_ref[node], edge,
                            jnp.zeros((k_pad, w_pad), jnp.float32))
    out_ref[r] = acc
    return carry

  jax.lax.fori_loop(0, block_nodes, row, 0)


def _mosaic_call(starts, ends, src_rows, weights, words, scales, *, bits, signed, block,
                 interpret):
  from jax.experimental.pallas import tpu as pltpu
  n_pad = starts.shape[0]
  bn = block.block_nodes
  fields = 32 // bits
  k_pad, w_pad = next_pow2(fields), words.shape[1]
  smem = 4 * (starts.size + ends.size + src_rows.size + weights.size + scales.size)
  vmem = 2 * words.shape[0] * (-(-w_pad // 128) * 128) * 4  # lane-padded, double-buffered
  if smem > TPU_SMEM_BUDGET_BYTES or vmem > TPU_VMEM_BUDGET_BYTES:
    raise NotImplementedError(
        f"the Mosaic quantized aggregation keeps the graph whole on chip: {smem} bytes of SMEM "
        f"(budget {TPU_SMEM_BUDGET_BYTES}) and {vmem} bytes of VMEM words (budget "
        f"{TPU_VMEM_BUDGET_BYTES}); use the XLA twin")
  smem_spec = pl.BlockSpec(memory_space=pltpu.SMEM)
  kernel = functools.partial(_mosaic_kernel, bits=bits, fields=fields, signed=signed,
                             block_nodes=bn)
  return pl.pallas_call(
      kernel,
      grid=(n_pad // bn,),
      in_specs=[smem_spec, smem_spec, smem_spec, smem_spec,
                pl.BlockSpec(words.shape, lambda i: (0, 0)), smem_spec],
      out_specs=pl.BlockSpec((bn, k_pad, w_pad), lambda i: (i, 0, 0)),
      out_shape=jax.ShapeDtypeStruct((n_pad, k_pad, w_pad), jnp.float32),
      interpret=interpret,
      compiler_params=None if interpret else pltpu.CompilerParams(
          dimension_semantics=("parallel",)),
      name=f"quantized_aggregate_b{bits}",
  )(starts, ends, src_rows, weights, jax.lax.bitcast_convert_type(words, jnp.int32), scales)


def aggregate_group_kernel(starts, ends, src_rows, weights, words, scales, *, bits: int,
                           signed: bool, block: AggregateBlock, interpret: bool,
                           backend: str | None = None):
  """Raw pallas_call on padded inputs; returns ``[N_pad, fields_pad, words_pad]`` float32.

  starts/ends int32 ``[N_pad]`` (N_pad a multiple of block_nodes), src_rows/weights ``[E_pad]``,
  words uint32 ``[R_pad, W_pad]``, scales float32 ``[R_pad]``. ``backend``: "triton", "mosaic"
  or None (Mosaic on a TPU default backend, else Triton).
  """
  if resolve_backend(backend) == "mosaic":
    return _mosaic_call(starts, ends, src_rows, weights, words, scales, bits=bits,
                        signed=signed, block=block, interpret=interpret)
  n_pad = starts.shape[0]
  bn = block.block_nodes
  fields = 32 // bits
  k_pad, w_pad = next_pow2(fields), words.shape[1]
  full = lambda a: pl.BlockSpec(a.shape, lambda i: (0,) * a.ndim)  # noqa: E731
  kernel = functools.partial(_kernel, bits=bits, fields=fields, signed=signed, block_nodes=bn)
  return pl.pallas_call(
      kernel,
      grid=(n_pad // bn,),
      in_specs=[pl.BlockSpec((bn,), lambda i: (i,)), pl.BlockSpec((bn,), lambda i: (i,)),
                full(src_rows), full(weights), full(words), full(scales)],
      out_specs=pl.BlockSpec((bn, k_pad, w_pad), lambda i: (i, 0, 0)),
      out_shape=jax.ShapeDtypeStruct((n_pad, k_pad, w_pad), jnp.float32),
      interpret=interpret,
      compiler_params=triton_params(block.num_warps, block.num_stages),
      name=f"quantized_aggregate_b{bits}",
  )(starts, ends, src_rows, weights, words, scales)


def group_aggregate(words, scales, ge, *, bits: int, num_features: int, signed: bool,
                    num_nodes: int, block: AggregateBlock | None = None, interpret: bool = False,
                    backend: str | None = None):
  """One group's contribution ``[N, F]``: pads to power-of-two shapes, runs the kernel, reshapes.

  ``ge`` is a ``jaxsys.ops.quantized_agg.GroupEdges`` (edges sorted by destination).
  """
  block = block or AggregateBlock()
  bn = block.block_nodes
  n_pad = -(-num_nodes // bn) * bn
  e = ge.src_rows.size
  e_pad = next_pow2(max(e, 1))
  rows, w = words.shape
  r_pad, w_pad = next_pow2(max(rows, 1)), next_pow2(w)
  starts = jnp.asarray(np.pad(ge.starts, (0, n_pad - num_nodes)))
  ends = jnp.asarray(np.pad(ge.ends, (0, n_pad - num_nodes)))
  src = jnp.asarray(np.pad(ge.src_rows, (0, e_pad - e)))
  wts = jnp.asarray(np.pad(ge.weights, (0, e_pad - e)))
  words_p = jnp.pad(words, ((0, r_pad - rows), (0, w_pad - w)))
  scales_p = jnp.pad(scales, (0, r_pad - rows))
  out = aggregate_group_kernel(starts, ends, src, wts, words_p, scales_p, bits=bits,
                               signed=signed, block=block, interpret=interpret,
                               backend=backend)
  fields = 32 // bits
  out = out[:num_nodes, :fields, :w]                     # [N, fields, words]
  return out.reshape(num_nodes, fields * w)[:, :num_features]  # [N, F]
