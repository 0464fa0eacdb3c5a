"""Which Pallas lowering a kernel takes: Triton (GPU) or Mosaic (TPU), and the one place the
Triton launch parameters are built.

JAX 0.11 deprecates Pallas' Triton backend (its changelog: "migrate to the Mosaic GPU backend ...
or switch to the official Triton bindings and jax_triton"). The project still chooses Pallas-Triton
for its GPU kernels until the jax-triton route (``triton_flash.py``) has passed the device suite,
so :func:`triton_params` -- every Pallas-Triton kernel's compiler parameters come from it -- files
that deprecation warning away, once, and only for warnings raised inside JAX's Pallas-Triton
modules; a user's own Pallas-Triton kernels are built there too and are quieted alike, which this
docstring is the record of. The jax-triton route raises no such warning.
"""

from __future__ import annotations

import warnings

import jax

from pallas_kernels.errors import ConfigError

__all__ = ["BACKENDS", "next_pow2", "require_triton_pow2", "resolve_backend", "triton_params"]

BACKENDS = ("triton", "mosaic")


def next_pow2(x: int) -> int:
  """The smallest power of two >= ``x`` (1 for ``x <= 1``): Triton's block-shape rule."""
  return 1 << max(0, int(x) - 1).bit_length()


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


_QUIETED = False


def triton_params(num_warps: int, num_stages: int):
  """``pallas.triton.CompilerParams`` for a Pallas-Triton kernel, with the backend's deprecation
  warning filed away (see the module docstring)."""
  global _QUIETED
  if not _QUIETED:
    warnings.filterwarnings("ignore", message=r"(?is).*triton.*deprecat", category=DeprecationWarning,
                            module=r"jax\.(_src\.pallas\.triton|experimental\.pallas)")
    _QUIETED = True
  from jax.experimental.pallas import triton as pltr  # noqa: PLC0415  (GPU lowering, on use)
  return pltr.CompilerParams(num_warps=num_warps, num_stages=num_stages)
