"""Serving: generation with a contiguous KV cache, and the LServe sparse-attention engine."""

from jaxsys._lazy import lazy_exports

# Bound eagerly: importing the ``generate`` submodule would otherwise shadow the function.
from jaxsys.serving.generate import GenerationResult, Sampling, generate  # noqa: E402

_getattr, __dir__ = lazy_exports(__name__, {
    "ServingEngine": "engine",
    "ServingConfig": "engine",
})


def __getattr__(name):
  return _getattr(name)
