"""Which Pallas lowering a kernel takes: Triton (GPU) or Mosaic (TPU)."""

from __future__ import annotations

import jax

from pallas_kernels.errors import ConfigError

__all__ = ["BACKENDS", "require_triton_pow2", "resolve_backend"]

BACKENDS = ("triton", "mosaic")


def resolve_backend(backend: str | None) -> str:
  """``backend`` or, when None, "mosaic" on a TPU default backend and "triton" otherwise."""
  if backend is None:
    return "mosaic" if jax.default_backend() == "tpu" else "triton"
  if backend not in BACKENDS:
    raise ConfigError(f"backend={backend!r} must be one of {BACKENDS}")
  return backend


def require_triton_pow2(kernel: str, backend: str, interpret: bool, **sizes: int) -> None:
  """Refuses, before anything is traced, the sizes Pallas' Triton lowering cannot compile: every
  array in a Triton kernel must have power-of-two dimensions. ``NotImplementedError`` (with the
  sizes) lets ``impl="auto"`` fall back to the op's XLA twin; interpret mode and Mosaic run any
  size, so they pass."""
  if backend != "triton" or interpret:
    return
  bad = {k: v for k, v in sizes.items() if v < 1 or v & (v - 1)}
  if bad:
    raise NotImplementedError(
        f"{kernel} on Triton needs power-of-two sizes; got "
        + ", ".join(f"{k}={v}" for k, v in bad.items()) + " (the XLA twin runs this shape)")
