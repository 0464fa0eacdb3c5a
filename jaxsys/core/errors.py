"""Error types. Every error names the argument and the constraint it broke."""


class JaxsysError(Exception):
  """Base class of jaxsys errors."""


class ShapeError(JaxsysError, ValueError):
  """An array has the wrong rank, shape or dtype for the argument it was passed as."""


class ConfigError(JaxsysError, ValueError):
  """A configuration field holds a value the system cannot honour."""


class InputError(JaxsysError, ValueError):
  """Input data is invalid (out-of-range indices, NaN where checked, malformed rows)."""


def check_rank(name: str, x, rank: int):
  if x.ndim != rank:
    raise ShapeError(f"{name} must have rank {rank}, got shape {tuple(x.shape)}")


def check_positive(name: str, value):
  if value is None or value <= 0:
    raise ConfigError(f"{name}={value!r} must be positive")


def check_divisible(name: str, value: int, by_name: str, by: int):
  if by <= 0 or value % by:
    raise ConfigError(f"{name}={value} must be divisible by {by_name}={by}")
