"""Pure-JAX functional ops: the reference and the fast CPU path of every kernel.

Each op has one public function dispatching on ``impl="auto" | "xla" | "pallas" |
"pallas_interpret"``.
"""

from jaxsys._lazy import lazy_exports

_getattr, __dir__ = lazy_exports(__name__, {
    "masks": "masks",
    "sparse_graph_attention": "graph_attn",
    "graph_attention": "graph_attn",
    "segment_softmax": "graph_attn",
    "quantized_aggregate": "quantized_agg",
    "paged_decode_attention": "paged_attention",
    "check_ids": "ids",
    "checked": "ids",
})


# Bound eagerly: importing the ``attention`` subpackage would otherwise shadow the function.
from jaxsys.ops import masks  # noqa: E402
from jaxsys.ops.attention.api import attention  # noqa: E402


def __getattr__(name):
  return _getattr(name)
