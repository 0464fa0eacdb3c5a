"""TP / TCP packing of a masked ray batch into static-shape buckets (the renderer stays jitted).

The pack itself is ``jaxsys.ops.tcp`` (vectorised, differentiable gather/scatter). Here: the
bucket sizes a batch needs, rounded up to powers of two (DESIGN "static shapes, explicit
buckets"), so the jitted colour pass compiles once per ``(mode, T, R')`` bucket; and the density
of valid entries of a packing (how much of the ``[T, R']`` tensor is real work).

Usage::

  T, Rp = plan(valid_np, "tcp")            # host, from the survivors of the masking pass
  idx = pack(valid, "tcp", max_len=T, max_rays=Rp)
"""

from __future__ import annotations

import numpy as np

from jaxsys.core.errors import InputError
from jaxsys.ops.tcp import MODES, PackIndex, gather, pack, pack_sizes, scatter  # noqa: F401

__all__ = ["bucket", "density", "gather", "MODES", "pack", "pack_sizes", "PackIndex", "plan", "scatter"]


def bucket(n: int, *, minimum: int = 1) -> int:
  """The power of two ``>= max(n, minimum)``."""
  if n < 0:
    raise InputError(f"n={n} must be >= 0")
  n = max(int(n), minimum, 1)
  return 1 << (n - 1).bit_length()


def plan(valid, mode: str, *, min_len: int = 8, min_rays: int = 8) -> tuple[int, int]:
  """Bucketed ``(max_len, max_rays)`` for packing ``valid [R, S]`` in ``mode``.

  The ray bucket never exceeds ``R`` for TP (all rays stay) and is capped at ``R`` for TCP
  when ``R`` is not a power of two; the time bucket is capped at ``S``.
  """
  valid = np.asarray(valid)
  R, S = valid.shape
  t, r = pack_sizes(valid, mode)
  max_len = min(bucket(t, minimum=min_len), S)
  max_rays = R if mode == "tp" else min(bucket(r, minimum=min_rays), R)
  return max_len, max_rays


def density(index: PackIndex) -> float:
  """Fraction of a packing's ``[T, R']`` entries that hold a valid sample."""
  v = np.asarray(index.valid)
  return float(v.sum() / max(v.size, 1))
