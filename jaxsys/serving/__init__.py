"""Serving: generation with a contiguous KV cache, and the LServe sparse-attention engine."""

from jaxsys._lazy import lazy_exports

__getattr__, __dir__ = lazy_exports(__name__, {
    "generate": "generate",
    "GenerationResult": "generate",
    "Sampling": "generate",
    "Engine": "engine",
    "EngineConfig": "engine",
})
