"""Offline hardware compile of the Pallas-Triton kernels for sm_90a (H100), on a host with no GPU.

``jax.export(..., platforms=["cuda"])`` runs Pallas' Triton lowering on any machine, but stops at
the Triton IR: the hardware compile (IR -> PTX -> cubin, shared memory, registers) happens inside
XLA on a GPU. This module finishes it offline:

1. :func:`capture` exports a function for CUDA and keeps, for every ``pallas_call`` it lowers, the
   Triton module's text (wrapping Pallas' ``lower_jaxpr_to_triton_module``) and the launch
   parameters the custom call carries (``num_warps``, ``num_stages``);
2. :func:`compile_sm90` compiles that text with the ``triton`` wheel for ``cuda:90`` (Hopper,
   ``sm_90a``) exactly as XLA's Triton path would, and runs the wheel's ``ptxas -v`` on the PTX.

The :class:`KernelReport` holds the shared memory (Triton's launch metadata: static + the
pipeline buffers), the registers per thread and the spill bytes; :meth:`KernelReport.problems`
names what breaks an H100's budgets (``H100_SMEM_BYTES`` per block, no spills). Tests call it at
every block configuration the dispatcher can pick (``tests/pallas_kernels/test_sm90_compile.py``).
Needs the ``triton`` wheel (the ``dev`` extra); nothing here runs a kernel.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import subprocess
import tempfile
from pathlib import Path

__all__ = ["H100_SMEM_BYTES", "Captured", "KernelReport", "TRITON_CUSTOM_CALL", "available", "capture",
           "compile_all", "compile_source", "compile_sm90", "export_for"]

#: The custom call Pallas' Triton lowering emits (``pallas_call_registration.py`` spells it out; JAX
#: exports no constant for it). ``jax.export`` refuses custom calls not on its stable list unless
#: told, so every CUDA export here goes through :func:`export_for`.
TRITON_CUSTOM_CALL = "__gpu$xla.gpu.triton"

#: Largest dynamic shared memory one block may use on sm_90 (227 KiB: 228 KiB per SM less 1 KiB
#: the driver reserves per block), the limit ``cudaFuncSetAttribute`` accepts on an H100.
H100_SMEM_BYTES = 227 * 1024


@dataclasses.dataclass(frozen=True)
class Captured:
  """One ``pallas_call`` as the CUDA lowering produced it."""
  name: str          # the kernel's (sanitised) function name
  ttir: str          # the Triton module, MLIR text
  num_warps: int
  num_stages: int


@dataclasses.dataclass(frozen=True)
class KernelReport:
  """What the sm_90a compile of one kernel needs."""
  name: str
  num_warps: int
  num_stages: int
  shared_bytes: int
  registers: int
  spill_stores: int
  spill_loads: int

  def problems(self, smem_limit: int = H100_SMEM_BYTES) -> list[str]:
    """The budgets this kernel breaks, as sentences (empty when it fits)."""
    out = []
    if self.shared_bytes > smem_limit:
      out.append(f"{self.name}: shared memory {self.shared_bytes} B > {smem_limit} B")
    if self.spill_stores or self.spill_loads:
      out.append(f"{self.name}: register spills ({self.spill_stores} B stores, {self.spill_loads} B loads, "
                 f"{self.registers} registers, {self.num_warps} warps)")
    return out


def available() -> str | None:
  """``None`` when the offline compile can run here, else why not (for ``pytest.skip``)."""
  try:
    from triton.backends.nvidia.compiler import get_ptxas  # noqa: PLC0415
    if not Path(get_ptxas(90).path).is_file():
      return "the triton wheel has no ptxas for sm_90"
  except Exception as e:  # noqa: BLE001 - any failure means "cannot compile here", with the reason
    return f"triton's CUDA compiler is not usable here: {type(e).__name__}: {e}"
  return None


@contextlib.contextmanager
def _capturing(into: list):
  """Records the text of every Triton module Pallas lowers while the context is open."""
  from jax._src.pallas.triton import lowering  # noqa: PLC0415 - the hook point is internal

  original = lowering.lower_jaxpr_to_triton_module

  def wrapped(jaxpr, *args, **kwargs):
    result = original(jaxpr, *args, **kwargs)
    into.append((jaxpr.debug_info.func_name, result.module.operation.get_asm(enable_debug_info=False)))
    return result

  lowering.lower_jaxpr_to_triton_module = wrapped
  try:
    yield
  finally:
    lowering.lower_jaxpr_to_triton_module = original


_LAUNCH = re.compile(r"name\s*=\s*\"(?P<name>[^\"]+)\"[^}]*?num_stages\s*=\s*(?P<stages>\d+)[^}]*?"
                     r"num_warps\s*=\s*(?P<warps>\d+)", re.S)


def export_for(platform: str, fn, *args):
  """``jax.export`` of ``jax.jit(fn)`` for one platform ("cuda" or "tpu") on any host: the one
  place the tests and :func:`capture` lower kernels for hardware they do not have.

  JAX 0.10 lowers Pallas-Triton for CUDA without a device. JAX 0.11 deprecates that backend, and
  its CUDA lowering asks for a device's compute capability; a CPU-only host then fails here, and
  the jax-triton route (``triton_flash.py``, compiled by :func:`compile_source` from its own
  source) is the one that keeps its offline checks."""
  import jax  # noqa: PLC0415
  from jax import export  # noqa: PLC0415
  checks = [export.DisabledSafetyCheck.custom_call(TRITON_CUSTOM_CALL)] if platform == "cuda" else []
  return export.export(jax.jit(fn), platforms=[platform], disabled_checks=checks)(*args)


def capture(fn, *args) -> list[Captured]:
  """Every Triton kernel ``jax.jit(fn)(*args)`` lowers to for CUDA (``args`` may be
  ``jax.ShapeDtypeStruct``), in lowering order."""
  from jax._src.interpreters import mlir  # noqa: PLC0415

  modules: list = []
  with _capturing(modules):
    exp = export_for("cuda", fn, *args)
  text = exp.mlir_module()
  launch = {}
  for m in _LAUNCH.finditer(text):  # the custom calls' backend_config (name, num_stages, num_warps)
    launch.setdefault(m["name"], (int(m["warps"]), int(m["stages"])))
  out = []
  for func_name, ttir in modules:
    name = mlir.sanitize_name(func_name)
    warps, stages = launch.get(name, (4, 3))  # Pallas' defaults on CUDA
    out.append(Captured(name, ttir, warps, stages))
  return out


_PTXAS = {"registers": re.compile(r"Used (\d+) registers"),
          "spill_stores": re.compile(r"(\d+) bytes spill stores"),
          "spill_loads": re.compile(r"(\d+) bytes spill loads")}


def compile_source(source, name: str, num_warps: int, num_stages: int) -> KernelReport:
  """Compiles ``source`` (a Triton IR file path, or a ``triton.compiler.ASTSource`` of a
  ``@triton.jit`` function) for sm_90a with the ``triton`` wheel and reads ``ptxas -v``."""
  import triton  # noqa: PLC0415
  from triton.backends.compiler import GPUTarget  # noqa: PLC0415
  from triton.backends.nvidia.compiler import get_ptxas  # noqa: PLC0415

  with tempfile.TemporaryDirectory() as tmp:
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": num_warps, "num_stages": num_stages,
                                       "num_ctas": 1, "enable_fp_fusion": True})  # XLA's setting
    ptx = Path(tmp) / f"{name}.ptx"
    ptx.write_text(compiled.asm["ptx"])
    log = subprocess.run([get_ptxas(90).path, "-v", "--gpu-name=sm_90a", str(ptx), "-o",
                          str(Path(tmp) / "out.cubin")], capture_output=True, text=True, check=True).stderr
  counts = {k: [int(x) for x in rx.findall(log)] for k, rx in _PTXAS.items()}  # one per function
  return KernelReport(name, num_warps, num_stages, int(compiled.metadata.shared),
                      max(counts["registers"], default=0), sum(counts["spill_stores"]),
                      sum(counts["spill_loads"]))


def compile_sm90(kernel: Captured) -> KernelReport:
  """Compiles one captured Pallas kernel (its Triton IR) for sm_90a: :func:`compile_source`."""
  with tempfile.TemporaryDirectory() as tmp:
    src = Path(tmp) / f"{kernel.name}.ttir"
    src.write_text(kernel.ttir)
    return compile_source(str(src), kernel.name, kernel.num_warps, kernel.num_stages)


def compile_all(fn, *args) -> list[KernelReport]:
  """:func:`capture` then :func:`compile_sm90` for each kernel."""
  return [compile_sm90(k) for k in capture(fn, *args)]
