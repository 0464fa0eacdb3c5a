"""Which Pallas lowering a kernel takes: Triton (GPU) or Mosaic (TPU)."""

from __future__ import annotations

import jax

from pallas_kernels.errors import ConfigError

__all__ = ["BACKENDS", "resolve_backend"]

BACKENDS = ("triton", "mosaic")


def resolve_backend(backend: str | None) -> str:
  """``backend`` or, when None, "mosaic" on a TPU default backend and "triton" otherwise."""
  if backend is None:
    return "mosaic" if jax.default_backend() == "tpu" else "triton"
  if backend not in BACKENDS:
    raise ConfigError(f"backend={backend!r} must be one of {BACKENDS}")
  return backend
