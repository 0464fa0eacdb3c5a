"""Serving, as thin layers over the decoding core (``jaxsys.decoding``).

* ``generation``: ``generate`` (batched prompts, contiguous cache, one on-device decode loop).
* ``engine``: ``ServingEngine`` / ``ServingConfig``: continuous batching over the paged cache,
  dense or LServe sparse attention; ``paged_views``: the paged cache as caches of the core.
* ``paged_cache``, ``page_select``, ``lserve``, ``prefill``, ``streaming``: the LServe pieces.
"""

from jaxsys._lazy import lazy_exports

__getattr__, __dir__ = lazy_exports(__name__, {
    "generate": "generation", "GenerationResult": "generation", "decode_step": "generation",
    "ServingEngine": "engine", "ServingConfig": "engine", "ServingResult": "engine",
})
