"""Error types. Every error names the argument and the constraint it broke."""


# Defined beside the kernels, which import nothing from jaxsys; these are the same classes.
from pallas_kernels.errors import ConfigError, InputError, JaxsysError, ShapeError  # noqa: F401


def check_rank(name: str, x, rank: int):
  if x.ndim != rank:
    raise ShapeError(f"{name} must have rank {rank}, got shape {tuple(x.shape)}")


def check_positive(name: str, value):
  if value is None or value <= 0:
    raise ConfigError(f"{name}={value!r} must be positive")


def check_divisible(name: str, value: int, by_name: str, by: int):
  if by <= 0 or value % by:
    raise ConfigError(f"{name}={value} must be divisible by {by_name}={by}")
