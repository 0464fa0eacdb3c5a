"""jaxsys: efficient-ML-systems research as JAX/Flax building blocks.

Layers (data flows downward only): ``core`` -> ``ops`` -> ``parallel`` -> ``nn`` -> ``models``
-> ``serving`` / ``speculative`` / ``rl``; ``graphs``, ``quant``, ``cluster``, ``data`` and
``eval`` sit beside them. Submodules are imported lazily so ``import jaxsys`` stays cheap.
"""

import importlib

__version__ = "0.1.0"

_SUBMODULES = (
    "core", "ops", "parallel", "nn", "models", "decoding", "serving", "speculative", "rl",
    "graphs", "quant", "cluster", "data", "eval", "vision", "nerf", "train", "experiments",
)
__all__ = ["__version__", *_SUBMODULES]


def __getattr__(name):
  if name in _SUBMODULES:
    return importlib.import_module(f"jaxsys.{name}")
  raise AttributeError(f"module 'jaxsys' has no attribute {name!r}")


def __dir__():
  return sorted(list(globals()) + list(_SUBMODULES))
