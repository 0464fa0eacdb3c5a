"""Temporal packing of ray samples for a time-major spiking network: TP and TCP (SpikingNeRF).

A ray batch comes as a per-ray sample grid ``[R, S]`` (sample ``s`` of ray ``r`` is time step
``s``) with a ``valid [R, S]`` mask of the samples that survived masking. A spiking network
wants a regular time-major tensor ``[T, R', C]``. Two packings (SpikingNeRF, Sec. 3.3):

* **TP** (temporal padding): every sample keeps its time step; the gaps hold zeros. The time
  axis spans the valid steps of the batch, ``[offset, offset + T)`` with ``offset`` the first
  valid step of any ray; all ``R`` rays stay.
* **TCP** (temporal condensing-and-padding): each ray's valid samples are moved, in order, to
  ``t = 0, 1, ..., n_r - 1``; rays with no valid sample are dropped; the rest pad to the
  longest ray. Vectorised: a stable sort of ``~valid`` along each ray puts the valid sample
  indices first in their original order; a stable sort of ``n_r == 0`` over rays puts the
  non-empty rays first.

Both return a :class:`PackIndex` of static shape ``[T, R']`` (``T = max_len``,
``R' = max_rays``: buckets chosen by the caller from :func:`pack_sizes`, so a jitted renderer
compiles once per bucket). :func:`gather` moves features ``[R, S, C] -> [T, R', C]`` and
:func:`scatter` moves outputs back ``[T, R', C] -> [R, S, C]``; both are differentiable.

Usage::

  T, Rp = pack_sizes(np.asarray(valid), "tcp")          # host: exact sizes
  idx = tcp_pack(valid, max_len=bucket(T), max_rays=bucket(Rp))
  y = net(gather(x, idx), idx.valid)                     # [T, R', C]
  out = scatter(y, idx, num_steps=S)                     # [R, S, C], zeros where not valid

``impl="auto" | "xla"`` dispatches through ``jaxsys.core.dispatch``; there is no Pallas kernel
(the pack is two sorts and a gather, which XLA does well).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxsys.core.dispatch import Dispatcher
from jaxsys.core.errors import InputError, ShapeError

__all__ = [
    "check_fits", "gather", "MODES", "pack", "pack_sizes", "PackIndex", "scatter", "TCP", "tcp_pack",
    "tp_pack",
]

MODES = ("tp", "tcp")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PackIndex:
  """Where entry ``(t, j)`` of a packed ``[T, R']`` tensor comes from: ray ``ray[j]``, sample
  ``step[t, j]``; ``valid[t, j]`` is False on padding (and on dropped/empty slots)."""
  step: jax.Array   # int32 [T, R']
  ray: jax.Array    # int32 [R']
  valid: jax.Array  # bool  [T, R']

  @property
  def shape(self) -> tuple[int, int]:
    return tuple(self.valid.shape)


def _check_valid(valid):
  if valid.ndim != 2:
    raise ShapeError(f"valid must be bool[rays, samples], got shape {tuple(valid.shape)}")
  return valid.astype(bool)


def pack_sizes(valid, mode: str) -> tuple[int, int]:
  """Host-side exact ``(time_len, num_rays)`` a packing needs for ``valid [R, S]`` (numpy).

  TP: the span of valid steps over the batch and all R rays; TCP: the longest ray's valid count
  and the number of non-empty rays. An all-empty batch needs ``(0, 0)`` (TP: ``(0, R)``).
  """
  valid = np.asarray(_check_valid(np.asarray(valid)))
  if mode not in MODES:
    raise InputError(f"mode={mode!r} must be one of {MODES}")
  counts = valid.sum(1)
  if mode == "tcp":
    return int(counts.max(initial=0)), int((counts > 0).sum())
  steps = np.nonzero(valid.any(0))[0]
  span = int(steps[-1] - steps[0] + 1) if steps.size else 0
  return span, valid.shape[0]


def _tcp_xla(valid, max_len: int, max_rays: int) -> PackIndex:
  R, S = valid.shape
  counts = jnp.sum(valid, axis=1, dtype=jnp.int32)                    # [R]
  # Valid sample indices first, in their original (near -> far) order.
  order = jnp.argsort(~valid, axis=1, stable=True).astype(jnp.int32)  # [R, S]
  # Non-empty rays first, in their original order.
  rays = jnp.argsort(counts == 0, stable=True).astype(jnp.int32)      # [R]
  if max_rays > R:
    rays = jnp.concatenate([rays, jnp.zeros((max_rays - R,), jnp.int32)])
  rays = rays[:max_rays]
  slot_ok = jnp.arange(max_rays) < jnp.minimum(jnp.sum(counts > 0), R)
  if max_len > S:
    order = jnp.concatenate([order, jnp.zeros((R, max_len - S), jnp.int32)], axis=1)
  step = order[rays, :max_len].T                                       # [T, R']
  t = jnp.arange(max_len)[:, None]
  ok = (t < counts[rays][None, :]) & slot_ok[None, :]
  return PackIndex(step=jnp.where(ok, step, 0), ray=jnp.where(slot_ok, rays, 0), valid=ok)


TCP = Dispatcher("tcp_pack", {"xla": _tcp_xla})


def tcp_pack(valid, *, max_len: int, max_rays: int, impl: str = "auto") -> PackIndex:
  """TCP index for ``valid [R, S]`` into a ``[max_len, max_rays]`` tensor (see module doc).

  Under ``jit`` the sizes are not checked against the data (they are static): take them from
  :func:`pack_sizes` (or a bucket above); :func:`check_fits` verifies a packing eagerly.
  """
  valid = _check_valid(valid)
  if max_len < 1 or max_rays < 1:
    raise InputError(f"max_len={max_len} and max_rays={max_rays} must be >= 1")
  return TCP(impl, valid, int(max_len), int(max_rays))


def tp_pack(valid, *, max_len: int, offset=None) -> PackIndex:
  """TP index for ``valid [R, S]``: steps ``offset .. offset + max_len - 1`` of every ray.

  ``offset`` defaults to the first valid step of the batch (traced: fine under ``jit``).
  """
  valid = _check_valid(valid)
  R, S = valid.shape
  if max_len < 1:
    raise InputError(f"max_len={max_len} must be >= 1")
  if offset is None:
    any_t = jnp.any(valid, axis=0)
    offset = jnp.where(jnp.any(any_t), jnp.argmax(any_t), 0)
  step = offset + jnp.arange(max_len, dtype=jnp.int32)[:, None]         # [T, 1]
  inside = step < S
  step = jnp.broadcast_to(jnp.where(inside, step, 0), (max_len, R)).astype(jnp.int32)
  ok = inside & valid[jnp.arange(R)[None, :], step]
  return PackIndex(step=step, ray=jnp.arange(R, dtype=jnp.int32), valid=ok)


def pack(valid, mode: str, *, max_len: int, max_rays: int | None = None) -> PackIndex:
  """:func:`tp_pack` or :func:`tcp_pack` by ``mode`` ("tp" ignores ``max_rays``: all rays)."""
  if mode == "tcp":
    return tcp_pack(valid, max_len=max_len, max_rays=max_rays or valid.shape[0])
  if mode == "tp":
    return tp_pack(valid, max_len=max_len)
  raise InputError(f"mode={mode!r} must be one of {MODES}")


def gather(x, index: PackIndex):
  """``x [R, S, C] -> [T, R', C]`` (zeros on padding)."""
  if x.ndim != 3:
    raise ShapeError(f"x must be [rays, samples, channels], got shape {tuple(x.shape)}")
  out = x[index.ray[None, :], index.step]                                # [T, R', C]
  return jnp.where(index.valid[..., None], out, 0)


def scatter(y, index: PackIndex, num_rays: int, num_steps: int):
  """``y [T, R', C] -> [R, S, C]``: packed entries back to their sample, zeros elsewhere."""
  if y.shape[:2] != index.shape:
    raise ShapeError(f"y must have leading shape {index.shape} (the packing's [T, R']), "
                     f"got {tuple(y.shape)}")
  y = jnp.where(index.valid[..., None], y, 0)
  # Padding entries point at (ray 0, step 0) with a zero value: adding zero is harmless.
  out = jnp.zeros((num_rays, num_steps) + y.shape[2:], y.dtype)
  return out.at[jnp.broadcast_to(index.ray[None, :], index.shape), index.step].add(y)


def check_fits(valid, index: PackIndex) -> None:
  """Eager check that ``index`` holds every valid sample (a bucket too small raises)."""
  held = int(np.asarray(index.valid).sum())
  total = int(np.asarray(valid).sum())
  if held != total:
    raise InputError(f"packing of shape {index.shape} holds {held} of {total} valid samples: "
                     "the bucket is too small (use pack_sizes)")
