"""A bounded pool of ahead-of-time compiled executables, keyed by (what, strategy, batch bucket).

``jax.jit`` already caches by shape, but TLT wants (a) compilation *before* the long tail starts,
so that switching strategy or batch bucket mid-rollout never stalls on the compiler, (b) an explicit
bound on how many executables (and how many bytes of generated code/temporaries) stay resident,
and (c) a count of compilations to prove a cached bucket is never compiled twice.

Usage::

  pool = ExecutablePool(max_entries=32)
  exe = pool.get(("verify", 16, 8), lambda: jax.jit(step).lower(*example_args).compile())
  out = exe(*args)
  pool.compilations            # how many times a builder ran

``enable_persistent_cache(dir)`` additionally turns on JAX's on-disk compilation cache so a fresh
process reloads the executables instead of recompiling them.
"""

from __future__ import annotations

import collections
import os
from collections.abc import Callable, Hashable

import jax

from jaxsys.core.errors import ConfigError

__all__ = ["aot_compile", "enable_persistent_cache", "executable_bytes", "ExecutablePool"]


def executable_bytes(exe) -> int:
  """Bytes the compiled executable holds or plans for while it runs (generated code, temporaries
  and non-aliased outputs), 0 if the backend does not report them."""
  try:
    m = exe.memory_analysis()
  except Exception:  # pragma: no cover - backend without memory analysis
    return 0
  if m is None:
    return 0
  fields = ("generated_code_size_in_bytes", "temp_size_in_bytes", "output_size_in_bytes")
  out = sum(int(getattr(m, f, 0)) for f in fields) - int(getattr(m, "alias_size_in_bytes", 0))
  return max(out, 0)


class ExecutablePool:
  """LRU cache of compiled executables bounded by ``max_entries`` and ``max_bytes``."""

  def __init__(self, max_entries: int = 64, max_bytes: int | None = None):
    if max_entries < 1:
      raise ConfigError(f"max_entries={max_entries} must be >= 1")
    if max_bytes is not None and max_bytes < 1:
      raise ConfigError(f"max_bytes={max_bytes} must be >= 1 or None")
    self.max_entries = max_entries
    self.max_bytes = max_bytes
    self._entries: collections.OrderedDict[Hashable, tuple[object, int]] = collections.OrderedDict()
    self.compilations = 0
    self.hits = 0
    self.evictions = 0
    self.compiled_keys: list[Hashable] = []

  def __contains__(self, key) -> bool:
    return key in self._entries

  def __len__(self) -> int:
    return len(self._entries)

  @property
  def total_bytes(self) -> int:
    return sum(b for _, b in self._entries.values())

  def get(self, key: Hashable, build: Callable[[], object]):
    """The executable for ``key``; ``build()`` (which compiles) runs only on a miss."""
    if key in self._entries:
      self._entries.move_to_end(key)
      self.hits += 1
      return self._entries[key][0]
    exe = build()
    self.compilations += 1
    self.compiled_keys.append(key)
    self._entries[key] = (exe, executable_bytes(exe))
    self._evict(keep=key)
    return exe

  def _evict(self, keep):
    def over():
      if len(self._entries) > self.max_entries:
        return True
      return self.max_bytes is not None and self.total_bytes > self.max_bytes
    while over() and len(self._entries) > 1:
      oldest = next(iter(self._entries))
      if oldest == keep:  # never evict the entry just built
        self._entries.move_to_end(oldest)
        oldest = next(iter(self._entries))
      del self._entries[oldest]
      self.evictions += 1


def enable_persistent_cache(cache_dir: str | os.PathLike):
  """Turns on JAX's persistent compilation cache in ``cache_dir`` (every executable is stored)."""
  os.makedirs(cache_dir, exist_ok=True)
  jax.config.update("jax_compilation_cache_dir", str(cache_dir))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def aot_compile(fn: Callable, *example_args, static_argnums=(), donate_argnums=()):
  """``jax.jit(fn).lower(*example_args).compile()``: an executable fixed to these shapes."""
  return jax.jit(fn, static_argnums=static_argnums, donate_argnums=donate_argnums).lower(*example_args).compile()
