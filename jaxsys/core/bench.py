"""Benchmark helpers: warm-up, ``block_until_ready``, min/median of N, compiled peak memory.

Absolute times on a shared CPU are noisy; experiments time baseline and ours side by side in
one process and report ratios.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import platform
import statistics
import time
from collections.abc import Callable

import jax

__all__ = [
    "ANALYSIS_OPTIONS", "BACKEND_COMPILES", "bandwidth_probe", "block", "compile_count", "compile_for_analysis",
    "compiled_memory", "count_trace", "cpu_cores",
    "hardware_string",
    "matmul_peak_gflops", "normal_input", "read_bandwidth", "time_fn", "time_interleaved", "Timing", "TRACE_COUNTS", "watch_compiles",
]


@dataclasses.dataclass(frozen=True)
class Timing:
  """Seconds per call over ``len(times)`` timed calls (after warm-up)."""
  times: tuple[float, ...]

  @property
  def min(self) -> float:
    return min(self.times)

  @property
  def median(self) -> float:
    return statistics.median(self.times)

  @property
  def ms(self) -> float:
    """Best (minimum) time in milliseconds: the least noisy estimate on a shared machine."""
    return 1e3 * self.min


def block(x):
  return jax.tree.map(lambda a: a.block_until_ready() if hasattr(a, "block_until_ready") else a, x)


def time_fn(fn: Callable, *args, warmup: int = 1, iters: int = 5, min_time: float = 0.0,
            **kwargs) -> Timing:
  """Times ``fn(*args, **kwargs)``; waits for device results so async dispatch is counted.

  Runs at least ``iters`` timed calls and keeps going until ``min_time`` seconds were spent.
  """
  for _ in range(warmup):
    block(fn(*args, **kwargs))
  times = []
  start = time.perf_counter()
  while len(times) < iters or time.perf_counter() - start < min_time:
    t0 = time.perf_counter()
    block(fn(*args, **kwargs))
    times.append(time.perf_counter() - t0)
  return Timing(tuple(times))


def normal_input(seed: int, shape: tuple[int, ...], dtype="float32") -> jax.Array:
  """A benchmark input of standard normals ``[*shape]``, drawn on the host (numpy's PCG64 seeded
  with ``seed``). ``jax.random`` compiles one program per shape (0.3-0.6 s each on XLA:CPU), which
  a sweep over sizes pays again and again for data whose values do not matter to a timing."""
  import numpy as np  # noqa: PLC0415
  return jax.numpy.asarray(np.random.default_rng(seed).standard_normal(shape, np.float32), dtype)


#: XLA options for a program compiled to be read (its memory plan, its collectives), never run: the
#: backend's LLVM optimisation level 0. Fusion, buffer assignment and SPMD partitioning are HLO
#: passes that run before LLVM, so the plan and the optimised HLO are the ones a default compile
#: gives (tests/core/test_bench.py checks both); on XLA:CPU LLVM's optimisation is most of the
#: compile time. CPU only: other backends keep their defaults.
ANALYSIS_OPTIONS = {"xla_backend_optimization_level": 0}


def compile_for_analysis(lowered):
  """``lowered.compile()`` for reading its ``memory_analysis()`` / ``as_text()``, never for running:
  with :data:`ANALYSIS_OPTIONS` on CPU. A program that is also run should be compiled once the
  default way instead (the run reuses it, or the persistent cache's copy of it)."""
  return lowered.compile(compiler_options=ANALYSIS_OPTIONS if jax.default_backend() == "cpu" else None)


def compiled_memory(fn: Callable, *args, unrun: bool = False, **kwargs) -> dict[str, int] | None:
  """Bytes XLA plans for a jitted ``fn``: arguments, outputs, temporaries and their sum.

  This is the compiler's plan (exact for what it allocates), available on every backend that
  reports ``memory_analysis``; returns None where the backend does not. ``unrun=True``: ``fn`` at
  these shapes is never run, so it compiles through :func:`compile_for_analysis` (the same plan,
  a cheaper compile on CPU); leave it False when the program also runs, so that one compile serves both.
  """
  jitted = fn if hasattr(fn, "lower") else jax.jit(fn)
  try:
    lowered = jitted.lower(*args, **kwargs)
    analysis = (compile_for_analysis(lowered) if unrun else lowered.compile()).memory_analysis()
  except Exception:  # pragma: no cover - backend without memory analysis
    return None
  if analysis is None:
    return None
  out = {
      "argument_bytes": int(analysis.argument_size_in_bytes),
      "output_bytes": int(analysis.output_size_in_bytes),
      "temp_bytes": int(analysis.temp_size_in_bytes),
  }
  out["peak_bytes"] = out["argument_bytes"] + out["output_bytes"] + out["temp_bytes"]
  return out


def matmul_peak_gflops(n: int = 1024, dtype="float32", iters: int = 5) -> float:
  """Measured f32 matmul throughput on the default device (the roofline for FLOP-bound ops)."""
  import jax.numpy as jnp
  a = jnp.ones((n, n), dtype)
  f = jax.jit(lambda x: x @ x)
  t = time_fn(f, a, iters=iters)
  return 2 * n**3 / t.min / 1e9


def bandwidth_probe(gib: float = 1.0):
  """``(fn, args, nbytes)``: a jitted row sum over ``gib`` GiB of f32 (rows of 256, so XLA splits
  it over all cores). Timed beside an op in one ``time_interleaved`` call, ``nbytes / time`` is
  the read bandwidth under the same machine load as the op (``read_bandwidth`` times it alone)."""
  import jax.numpy as jnp
  if gib <= 0:
    from jaxsys.core.errors import ConfigError
    raise ConfigError(f"{gib=} must be > 0")
  rows = max(1, int(gib * (1 << 30)) // (4 * 256))
  x = jnp.ones((rows, 256), jnp.float32)
  return jax.jit(lambda a: jnp.sum(a, axis=1)), (x,), int(x.nbytes)


def read_bandwidth(gib: float = 1.0, iters: int = 5) -> dict[str, float]:
  """Measured memory read bandwidth in bytes/s: the roofline of bandwidth-bound ops (decode).

  ``"xla"``: the ``bandwidth_probe`` sum over ``gib`` GiB, best of ``iters``; ``"numpy"``:
  numpy's single-threaded sum of the same buffer, best of 2. Use a buffer well above the
  last-level cache (the default 1 GiB) for DRAM bandwidth.
  """
  import numpy as np
  if iters < 1:
    from jaxsys.core.errors import ConfigError
    raise ConfigError(f"{iters=} must be >= 1")
  f, (x,), nbytes = bandwidth_probe(gib)
  best = time_fn(f, x, warmup=1, iters=iters).min
  xn = np.asarray(x)
  best_np = time_fn(xn.sum, warmup=0, iters=2).min
  return {"xla": nbytes / best, "numpy": nbytes / best_np}


def cpu_cores() -> int:
  """Cores this process may run on (its affinity mask where the OS has one): the thread count to
  give a CPU peer (llama.cpp) so that it uses what XLA uses."""
  return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def hardware_string() -> str:
  """One line naming the backend and, on CPU, the core count and processor."""
  backend = jax.default_backend()
  if backend == "cpu":
    cores = cpu_cores()
    proc = platform.processor() or platform.machine()
    try:
      with open("/proc/cpuinfo") as f:
        for line in f:
          if line.startswith("model name"):
            proc = line.split(":", 1)[1].strip()
            break
    except OSError:
      pass
    return f"cpu: {cores} cores, {proc}"
  devs = jax.devices()
  return f"{backend}: {len(devs)} x {devs[0].device_kind}"


#: How often each named jitted function was traced (a retrace means a recompile), for tests and
#: benchmarks that check a bucket is reused. Keys are ``"<module>.<function>"``-style names.
TRACE_COUNTS: collections.Counter = collections.Counter()


def count_trace(name: str) -> None:
  """Call at the top of a jitted function's Python body: counts one trace of ``name``."""
  TRACE_COUNTS[name] += 1


def time_interleaved(fns, *args, rounds: int = 5, warmup: int = 1) -> dict[str, Timing]:
  """Times several functions side by side: ``rounds`` rounds, each calling every function once
  in turn (round-robin), so load changes on a shared machine hit all of them alike.

  ``fns`` maps a label to a callable (called with ``*args``) or to a ``(fn, args)`` pair (its own
  arguments). Each function first runs ``warmup`` untimed calls (compilation), all before the
  first timed round; every call waits for its device results (``block_until_ready``). Returns
  ``{label: Timing}`` with ``rounds`` times each, in the order of ``fns``; A/B comparisons take
  ``.min`` (or ``.ms``) of each.
  """
  if rounds < 1 or warmup < 0:
    from jaxsys.core.errors import ConfigError
    raise ConfigError(f"rounds={rounds} must be >= 1 and warmup={warmup} >= 0")
  calls = {}
  for label, f in fns.items():
    fn, fargs = f if isinstance(f, tuple) else (f, args)
    if not callable(fn):
      from jaxsys.core.errors import InputError
      raise InputError(f"fns[{label!r}] must be a callable or a (callable, args) pair, got {f!r}")
    calls[label] = (fn, tuple(fargs))
  for fn, fargs in calls.values():
    for _ in range(warmup):
      block(fn(*fargs))
  times = {label: [] for label in calls}
  for _ in range(rounds):
    for label, (fn, fargs) in calls.items():
      t0 = time.perf_counter()
      block(fn(*fargs))
      times[label].append(time.perf_counter() - t0)
  return {label: Timing(tuple(t)) for label, t in times.items()}


#: ``TRACE_COUNTS`` key counting XLA backend compilations (jitted calls, eager ops, ``.compile()``).
BACKEND_COMPILES = "xla.backend_compile"
# JAX's monitoring event for one backend compilation (jax._src.dispatch.BACKEND_COMPILE_EVENT;
# there is no public constant).
_BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_watching = False


def _on_duration_event(event: str, duration: float, **kwargs) -> None:
  if event == _BACKEND_COMPILE_EVENT:
    TRACE_COUNTS[BACKEND_COMPILES] += 1


def watch_compiles() -> None:
  """Starts counting XLA backend compilations in ``TRACE_COUNTS[BACKEND_COMPILES]``; idempotent
  (one process-wide listener on JAX's compile event)."""
  global _watching
  if not _watching:
    jax.monitoring.register_event_duration_secs_listener(_on_duration_event)
    _watching = True


def compile_count() -> int:
  """XLA backend compilations counted so far; the difference of two reads is the number of
  compilations between them (a cache hit compiles nothing). The first call starts counting."""
  watch_compiles()
  return TRACE_COUNTS[BACKEND_COMPILES]
