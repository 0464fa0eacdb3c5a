"""XLA:CPU settings measured on this project's CPU workloads, applied before JAX starts.

jaxlib 0.10's XLA:CPU hands convolutions to YNNPACK fusions. On the DATE detector's 3x3 convolutions
(16-96 channels, 4-32 pixel maps, batch 16), YNNPACK's backward convolutions (the input and weight
gradients) run far below the CPU's matmul peak; XLA's own (Eigen) convolutions do better. Measured
on 2 AMD EPYC cores, one DATE train step's gradient: 150 ms -> 107 ms, its forward 35 -> 26 ms, with
dots (every matmul, so every other model) unchanged. :data:`CONVOLUTION_FLAG` takes convolutions
out of YNNPACK's fusion list and leaves everything else where XLA puts it::

  from jaxsys.core import xla_cpu
  xla_cpu.apply()        # before any JAX work: adds the flag to XLA_FLAGS (where it is known)
  import jax             # ... then use JAX as usual

Every experiment (``python -m experiments.<name>``, ``jaxsys reproduce``) calls :func:`apply`.

Why the care: XLA reads ``XLA_FLAGS`` once, when JAX creates its backends, and aborts the process
on a flag its version does not know. So the flag is only added for the jaxlib versions where it
was measured (:data:`TESTED`), never over a ``ynn_fusion_type`` the user set, and not once the
backends exist (then :func:`apply` changes nothing and says so). It affects XLA's CPU backend only;
GPU and TPU compilers never read it.
"""

from __future__ import annotations

import os

__all__ = ["apply", "CONVOLUTION_FLAG", "flags", "TESTED"]

_YNN_TYPES = "xla_cpu_experimental_ynn_fusion_type"  # YNNPACK's fusion list ("-x": x removed)
CONVOLUTION_FLAG = f"--{_YNN_TYPES}=-individual_convolution"
#: (major, minor) jaxlib versions whose XLA knows and was measured with :data:`CONVOLUTION_FLAG`.
TESTED = ((0, 10),)


def _jaxlib_version() -> tuple[int, int] | None:
  try:
    from importlib.metadata import version
    major, minor = version("jaxlib").split(".")[:2]
    return int(major), int(minor)
  except Exception:  # not installed, or a version string we cannot read: add nothing
    return None


def flags(current: str | None = None) -> list[str]:
  """The flags :func:`apply` would add to ``current`` (default: the environment's ``XLA_FLAGS``):
  :data:`CONVOLUTION_FLAG` on a :data:`TESTED` jaxlib unless ``current`` already chooses YNNPACK's
  fusion types; else none."""
  current = os.environ.get("XLA_FLAGS", "") if current is None else current
  if _jaxlib_version() not in TESTED or _YNN_TYPES in current:
    return []
  return [CONVOLUTION_FLAG]


def apply() -> bool:
  """Adds :func:`flags` to ``XLA_FLAGS``. Returns whether anything was added; False (and nothing
  changed) once JAX's backends exist, since XLA would no longer read it."""
  from jax._src import xla_bridge
  extra = flags()
  if not extra or xla_bridge.backends_are_initialized():
    return False
  os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", "").strip(), *extra]).strip()
  return True
