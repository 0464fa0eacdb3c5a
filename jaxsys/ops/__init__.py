"""Pure-JAX functional ops: the reference and the fast CPU path of every kernel.

Each op has one public function dispatching on ``impl="auto" | "xla" | "pallas" |
"pallas_interpret"`` through ``jaxsys.core.dispatch``. Modules are named apart from the functions
they export (``graph_attn`` / ``graph_attention``, ``quantized_agg`` / ``quantized_aggregate``), so
``jaxsys.ops.<function>`` is always the function. The one exception is the ``attention`` package,
whose function ``jaxsys.ops.attention`` is bound here over it: import its modules with
``from jaxsys.ops.attention import api`` (not ``import jaxsys.ops.attention.api``).
"""

from jaxsys._lazy import lazy_exports

_getattr, __dir__ = lazy_exports(__name__, {
    "masks": "masks",
    "sparse_graph_attention": "graph_attn",
    "graph_attention": "graph_attn",
    "segment_softmax": "graph_attn",
    "quantized_aggregate": "quantized_agg",
    "paged_decode_attention": "paged_attention",
    "merge_lse": "merge",
    "check_ids": "ids",
    "checked": "ids",
})


# Bound eagerly: importing the ``attention`` subpackage would otherwise shadow the function.
from jaxsys.ops import masks  # noqa: E402
from jaxsys.ops.attention.api import attention  # noqa: E402


def __getattr__(name):
  return _getattr(name)
