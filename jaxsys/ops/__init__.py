"""Pure-JAX functional ops: the reference and the fast CPU path of every kernel.

Each op has one public function dispatching on ``impl="auto" | "xla" | "pallas" |
"pallas_interpret"`` through ``jaxsys.core.dispatch``. Modules are named apart from the functions
they export (``attn`` / ``attention``, ``graph_attn`` / ``graph_attention``, ``quantized_agg`` /
``quantized_aggregate``), so ``jaxsys.ops.<function>`` is always the function.
"""

from jaxsys._lazy import lazy_exports

_getattr, __dir__ = lazy_exports(__name__, {
    "attention": "attn",
    "sparse_graph_attention": "graph_attn",
    "graph_attention": "graph_attn",
    "segment_softmax": "graph_attn",
    "quantized_aggregate": "quantized_agg",
    "paged_decode_attention": "paged_attention",
    "merge_lse": "merge",
    "check_ids": "ids",
    "checked": "ids",
    "tcp_pack": "tcp",
    "tp_pack": "tcp",
}, also=("masks",))

from jaxsys.ops import masks  # noqa: E402, F401  (the mask vocabulary, used with every op)


def __getattr__(name):
  return _getattr(name)
