"""Sequence layouts for ring attention: contiguous and zigzag (dual-chunk) load balancing.

With a causal mask and ``P`` ring ranks, a contiguous split gives rank ``r`` the query block
``r``, which sees ``r + 1`` of the ``P`` key blocks: the last rank works ``P`` times more than the
first and the ring waits for it (max/mean work ``2P/(P+1)``). The zigzag layout cuts the sequence
into ``2P`` chunks and gives rank ``r`` the chunks ``r`` and ``2P-1-r``: an early chunk with little
causal work paired with a late chunk with much, so every rank does the same work.

The reorder is done once on the data side (tokens, labels, positions, segment ids) so a model
runs entirely on zigzag-ordered shards; ``zigzag_restore`` maps outputs back to natural order.
On sharded arrays the same permutation runs inside ``shard_map`` (``zigzag_reorder_shard`` /
``zigzag_restore_shard``): every token piece travels once by ``ppermute``, where a global
gather would need all-gathers (and an explicit output sharding on Explicit mesh axes).

Usage::

  tokens_z = zigzag_reorder(tokens, ring_size=4)          # [b, s] natural -> zigzag order
  batch_z = zigzag_batch({"tokens": t, "labels": l, "positions": p}, ring_size=4)
  out = zigzag_restore(out_z, ring_size=4)                 # back to natural order
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from jaxsys.core.errors import ConfigError, ShapeError

__all__ = [
    "check_seq_len", "chunk_starts", "LAYOUTS", "num_chunks", "pad_len", "pad_seq", "permute_shards",
    "shard_pieces", "shifted_lm_batch", "zigzag_batch", "zigzag_indices", "zigzag_reorder",
    "zigzag_reorder_shard", "zigzag_restore", "zigzag_restore_shard",
]

LAYOUTS = ("contiguous", "zigzag")


def num_chunks(layout: str) -> int:
  """Chunks each rank holds: 1 (contiguous) or 2 (zigzag)."""
  if layout not in LAYOUTS:
    raise ConfigError(f"{layout=} must be one of {LAYOUTS}")
  return 1 if layout == "contiguous" else 2


def check_seq_len(seq_len: int, ring_size: int, layout: str, extra: int = 1, what: str = "seq_len"):
  """Raises ``ShapeError`` unless ``seq_len`` splits into ``ring_size * chunks * extra`` parts."""
  parts = ring_size * num_chunks(layout) * extra
  if seq_len % parts:
    why = (f"2 * ring degree ({ring_size})" if layout == "zigzag" else f"ring degree ({ring_size})")
    if extra > 1:
      why += f" * ulysses degree ({extra})"
    raise ShapeError(f"{what}={seq_len} must be divisible by {parts} = {why} for the {layout} "
                     f"layout; pad the sequence (pad=True) or pick another length")


def zigzag_indices(seq_len: int, ring_size: int) -> np.ndarray:
  """``perm`` with ``reordered[i] = natural[perm[i]]``: chunks ``0, 2P-1, 1, 2P-2, ...``."""
  check_seq_len(seq_len, ring_size, "zigzag")
  c = seq_len // (2 * ring_size)
  order = []
  for r in range(ring_size):
    order += [r, 2 * ring_size - 1 - r]
  return np.concatenate([np.arange(i * c, (i + 1) * c) for i in order]).astype(np.int32)


def zigzag_reorder(x, ring_size: int, axis: int = 1):
  """Natural token order -> zigzag order along ``axis`` (numpy in, numpy out; jax otherwise)."""
  perm = zigzag_indices(x.shape[axis], ring_size)
  return np.take(x, perm, axis=axis) if isinstance(x, np.ndarray) else jnp.take(x, perm, axis=axis)


def zigzag_restore(x, ring_size: int, axis: int = 1):
  """Zigzag order -> natural token order along ``axis`` (inverse of ``zigzag_reorder``)."""
  inv = np.argsort(zigzag_indices(x.shape[axis], ring_size)).astype(np.int32)
  return np.take(x, inv, axis=axis) if isinstance(x, np.ndarray) else jnp.take(x, inv, axis=axis)


def shard_pieces(seq_len: int, ring_size: int, degree: int) -> tuple[np.ndarray, int]:
  """The zigzag permutation at the coarsest granularity both layouts respect.

  The sequence is sharded contiguously over ``degree`` ranks (``n = seq_len / degree`` tokens
  each); zigzag moves chunks of ``c = seq_len / (2 * ring_size)`` tokens. Pieces of
  ``gcd(n, c)`` tokens are whole in both, so the permutation is one of pieces:
  returns ``(perm, pieces_per_rank)`` with ``reordered_piece[i] = natural_piece[perm[i]]``.
  """
  check_seq_len(seq_len, ring_size, "zigzag", extra=max(degree // ring_size, 1))
  n, c = seq_len // degree, seq_len // (2 * ring_size)
  g = math.gcd(n, c)
  return zigzag_indices(seq_len // g, ring_size), n // g


def permute_shards(x, perm: np.ndarray, axis, size: int, seq_axis: int = 1):
  """Inside ``shard_map``: applies a piece permutation to a sequence sharded over ``axis``.

  ``x`` is the local shard ``[..., n, ...]`` (``seq_axis``) of a sequence cut into
  ``len(perm)`` pieces, ``m = len(perm) / size`` per rank in order. Afterwards rank ``k`` holds
  old pieces ``perm[k m : (k+1) m]``. One ``ppermute`` per (source slot, destination slot)
  pair: each piece crosses the network once, and its transpose is the inverse permutation.
  """
  perm = np.asarray(perm)
  m = len(perm) // size
  if m * size != len(perm) or x.shape[seq_axis] % m:
    raise ShapeError(f"{len(perm)} pieces do not split over {size} ranks of "
                     f"{x.shape[seq_axis]} tokens")
  g = x.shape[seq_axis] // m
  slots = [jax.lax.slice_in_dim(x, a * g, (a + 1) * g, axis=seq_axis) for a in range(m)]
  src_rank, src_slot = perm // m, perm % m  # where new piece i comes from
  rank = jax.lax.axis_index(axis)
  out = []
  for b in range(m):
    new = np.arange(size) * m + b  # the piece rank k holds in slot b afterwards
    got = None
    for a in range(m):
      pairs = [(int(src_rank[i]), k) for k, i in enumerate(new) if src_slot[i] == a]
      if not pairs:
        continue
      recv = jax.lax.ppermute(slots[a], axis, pairs)
      # ranks fed from another slot received zeros here: keep what they got before
      got = recv if got is None else jnp.where(jnp.asarray(src_slot[new] == a)[rank], recv, got)
    out.append(got)
  return out[0] if m == 1 else jnp.concatenate(out, axis=seq_axis)


def zigzag_reorder_shard(x, ring_size: int, axis, degree: int, seq_axis: int = 1):
  """Inside ``shard_map``: natural-order shards -> the shards of ``zigzag_reorder`` (global)."""
  perm, _ = shard_pieces(x.shape[seq_axis] * degree, ring_size, degree)
  return permute_shards(x, perm, axis, degree, seq_axis)


def zigzag_restore_shard(x, ring_size: int, axis, degree: int, seq_axis: int = 1):
  """Inside ``shard_map``: zigzag-order shards -> natural-order shards (inverse of the above)."""
  perm, _ = shard_pieces(x.shape[seq_axis] * degree, ring_size, degree)
  return permute_shards(x, np.argsort(perm), axis, degree, seq_axis)


def zigzag_batch(batch: Mapping, ring_size: int, axis: int = 1,
                 keys=("tokens", "inputs", "labels", "targets", "positions", "segment_ids",
                       "loss_mask", "embeds")) -> dict:
  """Applies ``zigzag_reorder`` to the per-token fields of a batch; other fields pass through.

  Positions must travel with the tokens (RoPE reads them), so a model on zigzag shards
  computes exactly what it computes on the natural order.
  """
  out = dict(batch)
  for key in keys:
    if key in out and out[key] is not None:
      out[key] = zigzag_reorder(out[key], ring_size, axis)
  return out


def chunk_starts(layout: str, rank, ring_size: int, local_len: int, xp=jnp):
  """Global start index of each chunk that ring rank ``rank`` holds: ``int32[chunks]``.

  ``local_len`` is the rank's total length (all its chunks); ``rank`` may be a traced scalar.
  """
  nc = num_chunks(layout)
  c = local_len // nc
  if layout == "contiguous":
    return xp.reshape(xp.asarray(rank * local_len, dtype=xp.int32), (1,))
  return xp.stack([xp.asarray(rank * c, xp.int32),
                   xp.asarray((2 * ring_size - 1 - rank) * c, xp.int32)])


def pad_len(seq_len: int, multiple: int) -> int:
  return -(-seq_len // multiple) * multiple


def pad_seq(x, target: int, axis: int = 1, value=0):
  """Pads ``x`` along ``axis`` to ``target`` entries with ``value`` (never truncates)."""
  n = x.shape[axis]
  if n > target:
    raise ShapeError(f"cannot pad length {n} down to {target}")
  if n == target:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, target - n)
  xp = np if isinstance(x, np.ndarray) else jnp
  return xp.pad(x, widths, constant_values=value)


def shifted_lm_batch(tokens, ring_size: int = 1, *, loss_mask=None, positions=None,
                     segment_ids=None, layout: str = "zigzag") -> dict:
  """Next-token batch whose fields survive a token reorder: ``inputs``/``targets`` pairs.

  ``tokens int[b, L+1]`` -> ``inputs = tokens[:, :-1]``, ``targets = tokens[:, 1:]`` (and
  ``loss_mask``, ``positions``, ``segment_ids`` aligned with the inputs), then zigzag-reordered
  for ``ring_size`` once, here in the input pipeline. A target in another packed segment than
  its input is masked out.
  """
  xp = np if isinstance(tokens, np.ndarray) else jnp
  b, t = tokens.shape
  inputs, targets = tokens[:, :-1], tokens[:, 1:]
  mask = xp.ones((b, t - 1), xp.float32) if loss_mask is None else loss_mask[:, 1:].astype(xp.float32)
  if positions is None:
    positions = xp.broadcast_to(xp.arange(t - 1, dtype=xp.int32), (b, t - 1))
  else:
    positions = positions[:, :-1]
  batch = {"inputs": inputs, "targets": targets, "positions": positions}
  if segment_ids is not None:
    mask = mask * (segment_ids[:, 1:] == segment_ids[:, :-1])
    batch["segment_ids"] = segment_ids[:, :-1]
  batch["loss_mask"] = mask
  if layout == "zigzag" and ring_size > 1:
    batch = zigzag_batch(batch, ring_size)
  return batch
