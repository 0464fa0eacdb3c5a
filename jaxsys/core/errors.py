"""Error types and the checks configs run in ``__post_init__``.

Every error names the argument and the constraint it broke: ``num_pages=0 must be >= 1``. The
object checks read fields by name, so one line validates several::

  def __post_init__(self):
    check_positive(self, "num_layers", "num_heads", integer=True)
    check_min(self, 0, "sink", "dropout")
    check_range("clip_eps", self.clip_eps, 0, 1, lo_open=True, hi_open=True)
    check_one_of("mode", self.mode, MODES)
    check_divisible("num_heads", self.num_heads, "num_kv_heads", self.num_kv_heads)
    check_multiple("token_budget", self.token_budget, "page_size", self.page_size, positive=True)

Each takes ``error=`` (default ``ConfigError``) for checks of inputs rather than settings, and
``where=`` to prefix the message (``where="job 7: "``).
"""

from __future__ import annotations

# Defined beside the kernels, which import nothing from jaxsys; these are the same classes.
from pallas_kernels.errors import ConfigError, InputError, JaxsysError, ShapeError  # noqa: F401

__all__ = [
    "ConfigError", "InputError", "JaxsysError", "ShapeError",
    "check_divisible", "check_min", "check_multiple", "check_one_of", "check_positive", "check_range",
    "check_rank",
]


def check_rank(name: str, x, rank: int, *, error=ShapeError, where: str = ""):
  if x.ndim != rank:
    raise error(f"{where}{name} must have rank {rank}, got shape {tuple(x.shape)}")


def _at_least(value, minimum, strict: bool) -> bool:
  try:
    return value is not None and (value > minimum if strict else value >= minimum)
  except TypeError:  # a string or another non-number
    return False


def check_positive(obj, *names: str, integer: bool = False, error=ConfigError, where: str = ""):
  """Each field ``obj.<name>`` is > 0 (and an ``int`` when ``integer``).

  Message: ``name=0 must be positive`` (``... must be a positive int``).
  """
  for name in names:
    value = getattr(obj, name)
    if (integer and not isinstance(value, int)) or not _at_least(value, 0, strict=True):
      kind = "a positive int" if integer else "positive"
      raise error(f"{where}{name}={value!r} must be {kind}")


def check_min(obj, minimum, *names: str, error=ConfigError, where: str = "", note: str = ""):
  """Each field ``obj.<name>`` is >= ``minimum``: ``name=0 must be >= 1`` (plus ``note``)."""
  for name in names:
    value = getattr(obj, name)
    if not _at_least(value, minimum, strict=False):
      raise error(f"{where}{name}={value!r} must be >= {minimum}{note}")


def check_range(name: str, value, lo=None, hi=None, *, lo_open: bool = False,
                hi_open: bool = False, error=ConfigError, where: str = "", note: str = ""):
  """``lo <= value <= hi`` (``<`` on an open side; None = unbounded).

  Message: ``name=1.5 must be in [0, 1]`` / ``... in (0, 1)`` / ``... >= 0`` (plus ``note``).
  """
  ok = lo is None or _at_least(value, lo, strict=lo_open)
  ok = ok and (hi is None or (value is not None and _at_least(hi, value, strict=hi_open)))
  if ok:
    return
  if hi is None:
    constraint = f"{'>' if lo_open else '>='} {lo}"
  elif lo is None:
    constraint = f"{'<' if hi_open else '<='} {hi}"
  else:
    constraint = f"in {'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"
  raise error(f"{where}{name}={value!r} must be {constraint}{note}")


def check_one_of(name: str, value, choices, *, error=ConfigError, where: str = ""):
  """``value in choices``: ``mode='x' must be one of ('exact', 'approximate')``."""
  if value not in choices:
    raise error(f"{where}{name}={value!r} must be one of {tuple(choices)}")


def check_multiple(name: str, value: int, of_name: str, of: int, *, positive: bool = False,
                   error=ConfigError, where: str = ""):
  """``value % of == 0`` (and ``value > 0`` when ``positive``):
  ``token_budget=60 must be a positive multiple of page_size=8``."""
  if not _at_least(of, 0, strict=True) or value % of or (positive and not value > 0):
    kind = "a positive multiple" if positive else "a multiple"
    raise error(f"{where}{name}={value} must be {kind} of {of_name}={of}")


def check_divisible(name: str, value: int, by_name: str, by: int, *, error=ConfigError,
                    where: str = ""):
  """``value % by == 0`` with ``by > 0``: ``num_heads=6 must be divisible by num_kv_heads=4``."""
  if not _at_least(by, 0, strict=True) or value % by:
    raise error(f"{where}{name}={value} must be divisible by {by_name}={by}")
