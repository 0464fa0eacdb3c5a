"""One dispatcher for every op: implementations tried in order, falling back on NotImplementedError.

Each op builds one ``Dispatcher(op, {"xla": ..., "pallas": ..., "pallas_interpret": ...})``
and its public function calls ``dispatcher(impl, *args, **kwargs)``:

* ``impl="auto"``: the op's implementations in ``auto_order()`` -- "pallas" then "xla" on GPU
  and TPU, "xla" on CPU;
* ``impl=<name>``: that implementation only;
* an implementation that cannot serve a call raises ``NotImplementedError`` with the reason and
  the next one is tried; when none is left, ``ImplementationError`` (a ``NotImplementedError``)
  lists every implementation tried and its reason -- for an explicit impl, the one reason; each
  fallback is logged (logger ``jaxsys.dispatch``, INFO) with the refusal's reason;
* a name that is not one of the op's implementations raises ``ConfigError`` listing the choices.

The Pallas kernels pick Triton on GPU and Mosaic on TPU themselves (``backend=None``). A kernel
that cannot serve a call on TPU -- inputs beyond its on-chip (SMEM/VMEM) budget, a pattern
Mosaic cannot express -- raises ``NotImplementedError`` like any other refusal, so ``"auto"``
serves the call with the op's XLA twin there.

An implementation is a callable or a ``"module:function"`` string imported on first use (an
import error propagates: a broken backend is never silently replaced by another one).
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable

import jax

from jaxsys.core.errors import ConfigError, JaxsysError

__all__ = ["ACCELERATORS", "auto_order", "Dispatcher", "ImplementationError", "IMPLS", "require_backend"]

IMPLS = ("auto", "xla", "pallas", "pallas_interpret")
ACCELERATORS = ("gpu", "tpu")
_log = logging.getLogger("jaxsys.dispatch")


class ImplementationError(JaxsysError, NotImplementedError):
  """No implementation could serve a call; ``reasons`` maps each one tried to why not."""

  def __init__(self, op: str, reasons: dict[str, str]):
    self.op, self.reasons = op, dict(reasons)
    listed = "; ".join(f"{name}: {why}" for name, why in self.reasons.items())
    super().__init__(f"no {op} implementation could serve this call ({listed})")


def auto_order() -> tuple[str, ...]:
  """Implementations ``impl="auto"`` tries, in order, on the default backend."""
  return ("pallas", "xla") if jax.default_backend() in ACCELERATORS else ("xla",)


def require_backend(op: str, platforms: tuple[str, ...] = ACCELERATORS, what: str = "GPU or TPU"):
  """For compiled Pallas implementations: ``NotImplementedError`` unless the default backend is
  one of ``platforms`` (Pallas compiles for GPU/TPU; on CPU it only interprets)."""
  backend = jax.default_backend()
  if backend not in platforms:
    raise NotImplementedError(f"compiled Pallas {op} needs a {what} (backend is {backend!r}); "
                              "use impl='pallas_interpret' or 'xla'")


class Dispatcher:
  """The implementation table of one op (see the module docstring)."""

  def __init__(self, op: str, implementations: dict[str, Callable | str], *,
               auto: Callable[[], tuple[str, ...]] | None = None, quiet: tuple[str, ...] = ()):
    """``auto``: the op's own ``impl="auto"`` order (default :func:`auto_order`), for ops with a
    specialised implementation tried first (attention's short-query decode path). ``quiet``:
    implementations whose refusals are routine (a specialised path declining a general call)
    and are logged at DEBUG instead of INFO."""
    self.op = op
    self._impls = dict(implementations)
    self._auto, self._quiet = auto or auto_order, tuple(quiet)

  @property
  def names(self) -> tuple[str, ...]:
    """Accepted ``impl`` values: "auto" and every implementation, in table order."""
    return ("auto",) + tuple(self._impls)

  def register(self, name: str):
    """Decorator adding (or replacing) an implementation."""
    def deco(fn):
      self._impls[name] = fn
      return fn
    return deco

  def check(self, impl: str) -> None:
    if impl not in self.names:
      raise ConfigError(f"{impl=} must be one of {self.names} (op {self.op})")

  def get(self, name: str) -> Callable:
    """The implementation ``name`` (imported on first use)."""
    self.check(name)
    fn = self._impls[name]
    if isinstance(fn, str):
      module, attr = fn.split(":")
      fn = self._impls[name] = getattr(importlib.import_module(module), attr)
    return fn

  def order(self, impl: str) -> tuple[str, ...]:
    self.check(impl)
    if impl != "auto":
      return (impl,)
    return tuple(name for name in self._auto() if name in self._impls)

  def __call__(self, impl: str, *args, **kwargs):
    reasons = {}
    order = self.order(impl)
    for i, name in enumerate(order):
      try:
        return self.get(name)(*args, **kwargs)
      except NotImplementedError as e:
        reasons[name] = str(e)
        if i + 1 < len(order):  # once per trace: say why the next implementation serves the call
          level = logging.DEBUG if name in self._quiet else logging.INFO
          _log.log(level, "%s: %s refused this call (%s); trying %s", self.op, name, e, order[i + 1])
    raise ImplementationError(self.op, reasons)
