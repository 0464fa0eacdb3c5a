"""jaxsys.parallel: shard_map programs (sequence parallelism, graph partitions, compressed comm).

Sequence parallelism (LongVILA MM-SP): ``sequence_parallel_attention`` (global arrays, strategy
"hybrid" | "ulysses" | "ring" | "zigzag" | "allgather"), its shard-level form
``sequence_parallel_attention_shard``, the ring / Ulysses / 2D programs, zigzag data helpers
and the two-stage multimodal sharding. Submodules load lazily (``jaxsys.parallel.graph`` etc.).
"""

from jaxsys._lazy import lazy_exports

__getattr__, __dir__ = lazy_exports(__name__, {
    "sequence_parallel_attention": "api",
    "sequence_parallel_attention_shard": "api",
    "make_plan": "api",
    "SPPlan": "api",
    "STRATEGIES": "api",
    "ring_attention_shard": "ring",
    "ulysses_attention_shard": "ulysses",
    "hybrid_attention_shard": "hybrid",
    "zigzag_reorder": "zigzag",
    "zigzag_restore": "zigzag",
    "zigzag_indices": "zigzag",
    "zigzag_batch": "zigzag",
    "shifted_lm_batch": "zigzag",
    "sp_attention_fn": "api",
    "initialize_distributed": "distributed",
    "shard_frames": "multimodal",
    "reshard_to_llm": "multimodal",
    "reshard_maps": "multimodal",
    "prepare_mm_batch": "multimodal",
    "hlo_collective_bytes": "costs",
    "analytic_comm_bytes": "costs",
})
