"""Error types shared by the kernels and the library (``jaxsys.core.errors`` re-exports them).

They live here, below both, so that kernels import nothing from ``jaxsys``. Every error names
the argument and the constraint it broke.
"""

__all__ = ["ConfigError", "InputError", "JaxsysError", "ShapeError"]


class JaxsysError(Exception):
  """Base class of jaxsys errors."""


class ShapeError(JaxsysError, ValueError):
  """An array has the wrong rank, shape or dtype for the argument it was passed as."""


class ConfigError(JaxsysError, ValueError):
  """A configuration field holds a value the system cannot honour."""


class InputError(JaxsysError, ValueError):
  """Input data is invalid (out-of-range indices, NaN where checked, malformed rows)."""
