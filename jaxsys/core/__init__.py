"""Core: meshes and logical axis rules, errors, optimizers, benchmark helpers, result writer, checkpoints."""

from jaxsys._lazy import lazy_exports

__getattr__, __dir__ = lazy_exports(__name__, {
    "JaxsysError": "errors", "ShapeError": "errors", "ConfigError": "errors",
    "InputError": "errors",
    "make_mesh": "mesh", "logical_to_spec": "mesh", "logical_sharding": "mesh",
    "shard_logically": "mesh", "DEFAULT_RULES": "mesh",
    "time_fn": "bench", "compiled_memory": "bench", "hardware_string": "bench",
    "matmul_peak_gflops": "bench", "Timing": "bench",
    "Row": "results", "write_result": "results", "run_dir": "results",
    "Checkpointer": "checkpoint",
    "OptimizerConfig": "optim",
})
