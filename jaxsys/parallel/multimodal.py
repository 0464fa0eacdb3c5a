"""Two-stage multimodal sharding (LongVILA MM-SP, Chen et al. 2024).

Stage 1 (vision): the video's frames are split evenly over the ``P`` sequence-parallel ranks
(frames padded to a multiple of ``P``), so each rank encodes ``F/P`` frames; the frame encoder
is per-frame, so this stage needs no communication.

Stage 2 (language): the interleaved sequence (text tokens and frame tokens) must be cut into
``P`` balanced LLM shards in zigzag order. A frame token encoded on rank ``src`` may land in the
LLM shard of rank ``dst``. Each rank packs, for every destination, the frame tokens it owns that
land there (padded to a common capacity ``cap``, a power-of-two bucket), one ``all_to_all``
delivers them, and each rank scatters what it received into its LLM shard. Per rank this moves
``P * cap * hidden`` values: only the frame tokens, never the whole sequence (no all-reduce or
all-gather of the full sequence).

The routing tables are static metadata computed on the host with the batch
(:func:`reshard_maps`); labels, positions and segment ids follow the tokens through the same
zigzag reorder (:func:`prepare_mm_batch`).

Usage::

  batch = prepare_mm_batch(raw, plan)                   # host: shift, zigzag, routing tables
  frame_tokens = shard_frames(encoder(frames), mesh, plan)         # stage 1
  embeds = reshard_to_llm(frame_tokens, text_embeds, batch["send_idx"], batch["recv_pos"],
                          mesh=mesh, plan=plan)                     # stage 2
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from jaxsys.core.errors import ShapeError
from jaxsys.core.mesh import place, program_mesh
from jaxsys.parallel import zigzag as zz
from jaxsys.parallel.api import SPPlan, _axis

__all__ = ["frames_spec", "prepare_mm_batch", "reshard_maps", "reshard_to_llm", "shard_frames"]


def _bucket(n: int) -> int:
  return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def frames_spec(plan: SPPlan, ndim: int) -> PartitionSpec:
  """Frames ``[batch, frames, ...]`` split over the sequence-parallel axes (stage 1)."""
  return PartitionSpec(plan.batch_axis, _axis(plan.seq_axes) if plan.seq_axes else None,
                       *([None] * (ndim - 2)))


def shard_frames(x, mesh, plan: SPPlan):
  """Constrains ``[batch, frames(_tokens), ...]`` to be split over the SP ranks (stage 1)."""
  if x.shape[1] % plan.degree:
    raise ShapeError(f"frames={x.shape[1]} must be divisible by the sequence-parallel degree "
                     f"{plan.degree}; pad the video to a multiple (video_qa_batch max_frames=)")
  if plan.degree == 1:  # nothing to split (and a size-1 Explicit axis would type x as sharded)
    return x
  return place(x, frames_spec(plan, x.ndim), program_mesh(mesh))


def reshard_maps(frame_slot: np.ndarray, num_frame_tokens: int, degree: int, cap: int | None = None):
  """Routing tables of stage 2 for ``frame_slot int[b, L]`` given in LLM (zigzag) order.

  Frame token ``t`` lives on rank ``t // (T/P)`` (stage 1 split). Returns
  ``send_idx int32[b, P_src, P_dst, cap]`` (local frame-token index to send, 0 for padding) and
  ``recv_pos int32[b, P_dst, P_src, cap]`` (local LLM position to write, ``L/P`` = dropped).
  """
  frame_slot = np.asarray(frame_slot)
  b, L = frame_slot.shape
  P = degree
  if L % P or num_frame_tokens % P:
    raise ShapeError(f"sequence length {L} and frame tokens {num_frame_tokens} must be divisible "
                     f"by the sequence-parallel degree {P}")
  L_l, T_l = L // P, num_frame_tokens // P
  if frame_slot.max(initial=-1) >= num_frame_tokens:
    raise ShapeError(f"frame_slot refers to token {frame_slot.max()} but only "
                     f"{num_frame_tokens} frame tokens exist")
  routes = []  # per row: list of (src, dst, src_idx, dst_pos)
  counts = np.zeros((b, P, P), np.int64)
  for r in range(b):
    pos = np.nonzero(frame_slot[r] >= 0)[0]
    t = frame_slot[r, pos]
    src, dst = t // T_l, pos // L_l
    routes.append((src, dst, t % T_l, pos % L_l))
    np.add.at(counts[r], (src, dst), 1)
  need = _bucket(int(counts.max(initial=0)))
  cap = need if cap is None else cap
  if cap < need:
    raise ShapeError(f"cap={cap} is smaller than the {need} frame tokens one rank sends to another")
  send = np.zeros((b, P, P, cap), np.int32)
  recv = np.full((b, P, P, cap), L_l, np.int32)
  for r, (src, dst, si, dp) in enumerate(routes):
    fill = np.zeros((P, P), np.int64)
    for s_, d_, a, p_ in zip(src, dst, si, dp):
      k = fill[s_, d_]
      send[r, s_, d_, k] = a
      recv[r, d_, s_, k] = p_
      fill[s_, d_] += 1
  return send, recv


def reshard_to_llm(frame_tokens, text_embeds, send_idx, recv_pos, *, mesh, plan: SPPlan):
  """Stage 2: places frame tokens into the zigzag LLM shards with one all-to-all.

  Args:
    frame_tokens: ``[b, T, hidden]`` split over the SP ranks (stage 1 order).
    text_embeds: ``[b, L, hidden]`` in LLM (zigzag) order; frame slots are overwritten.
    send_idx, recv_pos: from :func:`reshard_maps`.
  Returns ``[b, L, hidden]`` in LLM order, sequence-sharded like the LLM activations.
  """
  axes = _axis(plan.seq_axes)
  seq3 = PartitionSpec(plan.batch_axis, axes, None)
  route = PartitionSpec(plan.batch_axis, axes, None, None)

  def body(ft, te, send, recv):
    # ft [b, T/P, hidden]; te [b, L/P, hidden]; send/recv [b, 1, P, cap]
    buf = jax.vmap(lambda f, i: f[i])(ft, send[:, 0])            # [b, P_dst, cap, hidden]
    got = jax.lax.all_to_all(buf, axes, split_axis=1, concat_axis=1, tiled=True)  # [b, P_src, cap, hidden]
    b, p, cap, h = got.shape
    pos = recv[:, 0].reshape(b, p * cap)                         # [b, P_src * cap]
    rows = jnp.arange(b)[:, None]
    return te.at[rows, pos].set(got.reshape(b, p * cap, h).astype(te.dtype), mode="drop")

  if plan.degree == 1:
    body_fn = _single_device(send_idx, recv_pos)
    return body_fn(frame_tokens, text_embeds)
  mesh = program_mesh(mesh)  # Explicit axes: see jaxsys.core.mesh
  ins = [place(t, sp, mesh) for t, sp in zip((frame_tokens, text_embeds, send_idx, recv_pos),
                                             (seq3, seq3, route, route))]
  # jit: an eager shard_map runs one compiled program per primitive (inlined under an outer jit).
  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(seq3, seq3, route, route),
                               out_specs=seq3, check_vma=False))(*ins)


def _single_device(send_idx, recv_pos):
  def fn(ft, te):
    idx = send_idx[:, 0, 0]                                      # [b, cap]
    pos = recv_pos[:, 0, 0]
    vals = jax.vmap(lambda f, i: f[i])(ft, idx)
    rows = jnp.arange(te.shape[0])[:, None]
    return te.at[rows, pos].set(vals.astype(te.dtype), mode="drop")
  return fn


def prepare_mm_batch(batch: dict, plan: SPPlan, num_frame_tokens: int, cap: int | None = None) -> dict:
  """Host side: next-token shift, zigzag reorder (ring degree) and the stage-2 routing tables.

  ``batch``: ``tokens int[b, L+1]``, ``frame_slot``, ``loss_mask``, ``positions``,
  ``segment_ids`` (as from ``jaxsys.data.video.video_qa_batch``) and ``frames``. ``L`` must be
  a multiple of ``plan.chunk_multiple()``.
  """
  tokens = np.asarray(batch["tokens"])
  L = tokens.shape[1] - 1
  zz.check_seq_len(L, plan.ring_size, plan.layout, extra=plan.ulysses_size, what="input length")
  out = zz.shifted_lm_batch(tokens, 1, loss_mask=np.asarray(batch["loss_mask"]),
                            positions=np.asarray(batch["positions"]),
                            segment_ids=np.asarray(batch["segment_ids"]))
  out["frame_slot"] = np.asarray(batch["frame_slot"])[:, :-1]
  if plan.layout == "zigzag" and plan.ring_size > 1:
    out = zz.zigzag_batch(out, plan.ring_size, keys=tuple(out))
  send, recv = reshard_maps(out["frame_slot"], num_frame_tokens, plan.degree, cap)
  out.update(send_idx=send, recv_pos=recv, frames=np.asarray(batch["frames"]))
  return out
