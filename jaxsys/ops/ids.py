"""Validation of integer id vectors (edge endpoints, node ids) before they index anything.

An id vector indexes the rows of a ``[size, ...]`` array, so it must hold integers in
``[0, size)``. The check runs on the caller's array as given, BEFORE any cast to int32: cast to
int32, ``2**32 + 1`` becomes ``1``; as a gather index ``-1`` reads row ``size - 1``; a segment id
``>= size`` is silently dropped by ``segment_sum``. None of these may pass unnoticed.

* Concrete ids (lists, numpy arrays, device arrays outside ``jit``) are checked on the host:
  ``ShapeError`` if they are not integers, ``InputError`` if one lies outside ``[0, size)``; the
  message names the argument, the first bad index and its value, and the valid range.
* Traced ids (inside ``jit``): the dtype is static and checked while tracing; the values are
  not known, so the range check is a ``jax.experimental.checkify.debug_check``. Under plain
  ``jit`` it is a no-op (no cost, no effect); run the function through ``checked`` (or
  ``checkify.checkify``) to get the error::

    f = jax.jit(lambda s, r: sparse_graph_attention(q, k, v, s, r))
    out = checked(f)(senders, receivers)        # InputError: receivers[3]=9 ... [0, num_nodes=8)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

from jaxsys.core.errors import InputError, ShapeError

__all__ = ["check_ids", "checked", "MAX_IDS"]

MAX_IDS = 2 ** 31  # ids are stored as int32: a size above this has ids that do not fit


def check_ids(name: str, ids, size: int, *, size_name: str = "num_nodes") -> None:
  """Raises unless ``ids`` holds integers in ``[0, size)`` (see the module docstring).

  Empty ids pass whatever their dtype (``np.asarray([])`` is float64). Returns nothing: cast
  the ids (e.g. to int32) only after this check.
  """
  size = int(size)
  if size > MAX_IDS:
    raise ShapeError(f"{size_name}={size} exceeds the int32 id range: at most 2**31 ids")
  if isinstance(ids, jax.core.Tracer):
    if not jnp.issubdtype(ids.dtype, jnp.integer):
      raise ShapeError(f"{name} must be an integer array, got dtype {ids.dtype}")
    if ids.size:
      bad = (ids < 0) | (ids >= size)
      i = jnp.argmax(bad)
      checkify.debug_check(~jnp.any(bad), f"{name} must lie in [0, {size_name}={size}), got "
                           f"{name}[{{i}}]={{value}}", i=i, value=ids.reshape(-1)[i])
    return
  x = np.asarray(ids)
  if x.size == 0:
    return
  if not np.issubdtype(x.dtype, np.integer):
    flat = x.reshape(-1)
    i = 0
    if np.issubdtype(x.dtype, np.floating):
      frac = np.nonzero(flat != np.floor(flat))[0]
      i = int(frac[0]) if frac.size else 0
    raise ShapeError(f"{name} must be an integer array with values in [0, {size_name}={size}), "
                     f"got dtype {x.dtype} ({name}[{i}]={flat[i].item()!r})")
  bad = (x < 0) | (x >= size)
  if bad.any():
    flat = x.reshape(-1)
    i = int(np.argmax(bad.reshape(-1)))
    raise InputError(f"{name} must lie in [0, {size_name}={size}), got {name}[{i}]={int(flat[i])} "
                     f"({int(bad.sum())} of {x.size} out of range; range [{int(x.min())}, "
                     f"{int(x.max())}])")


def checked(fn):
  """``fn`` with its traced id checks enforced: runs it under ``checkify.checkify`` and raises a
  failed check as ``InputError``. Works around ``jax.jit(fn)`` as well as around ``fn``."""
  checkified = checkify.checkify(fn)

  @functools.wraps(fn)
  def run(*args, **kwargs):
    err, out = checkified(*args, **kwargs)
    msg = err.get()
    if msg is not None:
      raise InputError(msg.removesuffix(" (`check` failed)"))
    return out

  return run
