"""MEGA degree-aware bits and condensed edge order.

Degree-aware mixed precision (MEGA sec. 3): a node's bitwidth is allocated from its in-degree,
``b_i = clip(round(t + k * log2(1 + deg_i)), 1, 8)`` with ``t`` solved so the element-weighted
average hits a budget. It serves as an initialiser for A2Q's learnable bits and as a regulariser
``mean((b - b_deg)^2)`` pulling learned bits towards the degree prior. ``k < 0`` gives fewer
bits to high-degree nodes (sign chosen by the user; A2Q's learned bits tell which way a model
wants it -- the experiment plots them against in-degree).

Condense-Edge order (MEGA sec. 4): edges sorted by destination block, then by source, so a
block of destination rows reads each source row once instead of once per edge.

Usage::

  deg = in_degree(receivers, n)
  b0 = degree_aware_bits(deg, target_bits=2.0)
  order = condensed_edge_order(senders, receivers, n, block_size=64)
"""

from __future__ import annotations

import numpy as np

from jaxsys.core.errors import ConfigError, InputError, ShapeError
from jaxsys.quant.a2q import MAX_BITS, MIN_BITS

__all__ = [
    "condensed_edge_order", "degree_aware_bits", "degree_regularizer", "destination_order", "in_degree",
    "source_row_loads",
]


def in_degree(receivers, num_nodes: int) -> np.ndarray:
  r = np.asarray(receivers)
  if r.size and (r.min() < 0 or r.max() >= num_nodes):
    raise InputError(f"receivers must lie in [0, {num_nodes}), got [{r.min()}, {r.max()}]")
  return np.bincount(r, minlength=num_nodes).astype(np.int64)


def _bits_for(t, deg, k, lo, hi):
  return np.clip(np.round(t + k * np.log2(1.0 + deg)), lo, hi)


def degree_aware_bits(degree, target_bits: float, *, slope: float = 1.0, min_bits: int = MIN_BITS,
                      max_bits: int = MAX_BITS) -> np.ndarray:
  """Integer bits ``[N]`` rising (slope > 0) with log in-degree, averaging ~``target_bits``."""
  if not (MIN_BITS <= min_bits <= max_bits <= MAX_BITS):
    raise ConfigError(f"need {MIN_BITS} <= {min_bits=} <= {max_bits=} <= {MAX_BITS}")
  if not (min_bits <= target_bits <= max_bits):
    raise ConfigError(f"{target_bits=} must lie in [{min_bits=}, {max_bits=}]: below the "
                      "minimum no allocation can meet the budget")
  deg = np.asarray(degree, np.float64)
  if deg.ndim != 1:
    raise ShapeError(f"degree must be 1-D, got shape {deg.shape}")
  if np.any(deg < 0):
    raise InputError("degree must be non-negative")
  lo_t, hi_t = -64.0, 64.0
  for _ in range(80):  # the mean is monotone in t: bisection
    mid = 0.5 * (lo_t + hi_t)
    if _bits_for(mid, deg, slope, min_bits, max_bits).mean() < target_bits:
      lo_t = mid
    else:
      hi_t = mid
  cands = [_bits_for(t, deg, slope, min_bits, max_bits) for t in (lo_t, hi_t)]
  best = min(cands, key=lambda b: abs(b.mean() - target_bits))
  return best.astype(np.int32)


def degree_regularizer(bits, degree_bits):
  """``mean((b - b_deg)^2)``: pulls learned continuous bits towards the degree prior."""
  import jax.numpy as jnp
  b = jnp.reshape(bits, (-1,))
  return jnp.mean((b - jnp.asarray(degree_bits, b.dtype).reshape(-1)) ** 2)


def condensed_edge_order(senders, receivers, num_nodes: int, block_size: int = 64) -> np.ndarray:
  """Edge permutation: by destination block, then source, then destination."""
  if block_size <= 0:
    raise ConfigError(f"{block_size=} must be positive")
  s, r = np.asarray(senders), np.asarray(receivers)
  if s.shape != r.shape or s.ndim != 1:
    raise ShapeError(f"senders and receivers must be equal 1-D arrays, got {s.shape}, {r.shape}")
  for name, a in (("senders", s), ("receivers", r)):
    if a.size and (a.min() < 0 or a.max() >= num_nodes):
      raise InputError(f"{name} must lie in [0, {num_nodes})")
  return np.lexsort((r, s, r // block_size))


def destination_order(senders, receivers) -> np.ndarray:
  """The usual CSR-by-destination order (the baseline for locality)."""
  return np.lexsort((np.asarray(senders), np.asarray(receivers)))


def source_row_loads(senders, receivers, order, block_size: int = 64) -> int:
  """Packed source rows fetched when a destination block keeps the last fetched row.

  A fetch happens whenever the source changes between consecutive edges (or a new destination
  block starts): the accelerator-style count of irregular feature reads.
  """
  s = np.asarray(senders)[order]
  blk = np.asarray(receivers)[order] // block_size
  if s.size == 0:
    return 0
  change = np.ones(s.size, bool)
  change[1:] = (s[1:] != s[:-1]) | (blk[1:] != blk[:-1])
  return int(change.sum())
