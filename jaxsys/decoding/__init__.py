"""The decoding core that generation, serving and speculative rollouts stand on.

* ``cache``: the cache protocol (``attend(layer, attn, q, k, v)``, ``advance``, ``lengths``) that
  ``Decoder.forward_hidden`` threads through the blocks, and its contiguous implementations:
  ``KVCache``, ``Prefill`` (a prompt into an empty cache, static causal layout) and ``TreeCache``
  (speculative verification). The paged LServe views are in ``jaxsys.serving.paged_views``.
* ``sampling``: ``SamplingParams`` (temperature 0 = greedy, top-k 0 / top-p 1 = off, seed) and
  the processed distribution every sampler and speculative acceptance use.
* ``core``: prompt checks, bucketing, prefill, step, output emission and the on-device loop.

``jaxsys.serving.generate``, ``jaxsys.serving.ServingEngine`` and
``jaxsys.speculative.RolloutEngine`` are thin layers over these.
"""

from jaxsys._lazy import lazy_exports

__getattr__, __dir__ = lazy_exports(__name__, {
    "KVCache": "cache", "Prefill": "cache", "TreeCache": "cache",
    "SamplingParams": "sampling", "GREEDY": "sampling", "sample": "sampling",
    "target_probs": "sampling",
    "check_prompts": "core", "bucket": "core", "context_length": "core",
})
