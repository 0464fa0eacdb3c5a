"""Quantized aggregation: dequantize-on-load + sparse neighbour aggregation over packed features.

``out[d] = sum_{e: s -> d} w_e * scale[s] * code[s]`` where ``code`` is read from the MEGA
package (``jaxsys.quant.packing.PackedFeatures``): the aggregation streams each source row's
packed uint32 words (b bits per value) instead of its float32 row.

Weights ``w_e``: "sum" 1; "mean" ``1 / in_deg(d)``; "gcn" adds self loops and uses
``1 / sqrt(deg(s) deg(d))`` (Kipf & Welling's ``D^-1/2 (A + I) D^-1/2``).

The edge list is split per bitwidth group (a source belongs to exactly one group) and sorted by
destination; that plan is host-side static structure (``plan_aggregation``), built once per
(package, graph) and reusable under ``jit``.

Usage::

  out = quantized_aggregate(packed, graph, aggregation="gcn")          # impl="auto"
  plan = plan_aggregation(packed, graph, aggregation="gcn")
  f = jax.jit(lambda pk: quantized_aggregate(pk, None, plan=plan))
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxsys.core.dispatch import Dispatcher, require_backend
from jaxsys.core.errors import ConfigError, InputError, ShapeError
from jaxsys.ops.ids import check_ids

__all__ = [
    "aggregate", "AggregationPlan", "AGGREGATIONS", "check_aggregation", "graph_edges", "GroupEdges",
    "normalized_edges", "plan_aggregation", "quantized_aggregate", "QUANTIZED_AGGREGATE",
]

AGGREGATIONS = ("sum", "mean", "gcn")


def graph_edges(graph):
  """``(senders, receivers, num_nodes or None)`` from a jraph.GraphsTuple or a pair/triple."""
  if hasattr(graph, "senders") and hasattr(graph, "receivers"):
    n = None
    if getattr(graph, "n_node", None) is not None:
      n = int(np.sum(np.asarray(graph.n_node)))
    elif getattr(graph, "nodes", None) is not None:
      n = int(graph.nodes.shape[0])
    return graph.senders, graph.receivers, n
  if isinstance(graph, (tuple, list)) and len(graph) in (2, 3):
    return graph[0], graph[1], (int(graph[2]) if len(graph) == 3 else None)
  raise InputError(f"graph must be a jraph.GraphsTuple or (senders, receivers[, num_nodes]), "
                   f"got {type(graph).__name__}")


def check_aggregation(aggregation: str):
  if aggregation not in AGGREGATIONS:
    raise ConfigError(f"{aggregation=} must be one of {AGGREGATIONS}")


def normalized_edges(senders, receivers, num_nodes: int, aggregation: str):
  """``(senders, receivers, weights)`` for an aggregation; traceable (jnp), adds self loops for gcn.

  Ids are validated before the int32 cast (``jaxsys.ops.ids.check_ids``): concrete ids at once;
  traced ids through a ``checkify.debug_check`` raised by ``jaxsys.ops.checked(f)``.
  """
  check_aggregation(aggregation)
  if np.shape(senders) != np.shape(receivers) or len(np.shape(senders)) != 1:
    raise ShapeError(f"senders/receivers must be equal 1-D arrays, got {np.shape(senders)}, "
                     f"{np.shape(receivers)}")
  check_ids("senders", senders, num_nodes)  # before the int32 cast (2**32 + 1 -> 1)
  check_ids("receivers", receivers, num_nodes)
  s = jnp.asarray(senders, jnp.int32)
  r = jnp.asarray(receivers, jnp.int32)
  if aggregation == "gcn":
    loops = jnp.arange(num_nodes, dtype=jnp.int32)
    s, r = jnp.concatenate([s, loops]), jnp.concatenate([r, loops])
  deg = jax.ops.segment_sum(jnp.ones_like(r, jnp.float32), r, num_nodes)
  if aggregation == "sum":
    w = jnp.ones(s.shape, jnp.float32)
  elif aggregation == "mean":
    w = 1.0 / jnp.maximum(deg, 1.0)[r]
  else:
    dis = jax.lax.rsqrt(jnp.maximum(deg, 1.0))
    w = dis[s] * dis[r]
  return s, r, w


def aggregate(x, senders, receivers, num_nodes: int, aggregation: str = "sum"):
  """Float reference ``out[d] = sum_e w_e x[s_e]`` ``[N, F]`` (the dense-feature baseline)."""
  s, r, w = normalized_edges(senders, receivers, num_nodes, aggregation)
  return jax.ops.segment_sum(x[s] * w[:, None], r, num_nodes)  # [N, F]


@dataclasses.dataclass(frozen=True)
class GroupEdges:
  """Edges whose source is in one bitwidth group, sorted by destination."""
  src_rows: np.ndarray   # int32 [E_g] row inside the group's word array
  dst: np.ndarray        # int32 [E_g]
  weights: np.ndarray    # float32 [E_g]
  starts: np.ndarray     # int32 [N] first edge of each destination
  ends: np.ndarray       # int32 [N] one past its last edge


@dataclasses.dataclass(frozen=True)
class AggregationPlan:
  num_nodes: int
  aggregation: str
  groups: tuple  # GroupEdges per packed group, same order as packed.bits
  bits: tuple

  @property
  def num_edges(self) -> int:
    return int(sum(g.dst.size for g in self.groups))


def _concrete(name, a):
  try:
    return np.asarray(a)
  except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError) as e:
    raise InputError(f"{name} is traced: build plan_aggregation(...) outside jit and pass "
                     "plan=") from e


def plan_aggregation(packed, graph, aggregation: str = "sum") -> AggregationPlan:
  """Host-side split of the (normalised) edge list by the source's bitwidth group."""
  check_aggregation(aggregation)
  senders, receivers, n = graph_edges(graph)
  n = packed.num_nodes if n is None else n
  if n != packed.num_nodes:
    raise ShapeError(f"graph has {n} nodes but packed features hold {packed.num_nodes}")
  s_np, r_np = _concrete("senders", senders), _concrete("receivers", receivers)
  if s_np.shape != r_np.shape or s_np.ndim != 1:
    raise ShapeError(f"senders/receivers must be equal 1-D arrays, got {s_np.shape}, {r_np.shape}")
  check_ids("senders", s_np, n)
  check_ids("receivers", r_np, n)
  s, r, w = (np.asarray(a) for a in normalized_edges(s_np, r_np, n, aggregation))
  group_of = np.full(n, -1, np.int64)
  row_of = np.zeros(n, np.int64)
  for g, ids in enumerate(packed.node_ids):
    ids = _concrete("packed.node_ids", ids)
    group_of[ids] = g
    row_of[ids] = np.arange(ids.size)
  if np.any(group_of < 0):
    raise InputError(f"{int(np.sum(group_of < 0))} nodes are missing from the package")
  groups = []
  for g in range(len(packed.bits)):
    sel = np.nonzero(group_of[s] == g)[0]
    sel = sel[np.argsort(r[sel], kind="stable")]
    dst = r[sel].astype(np.int32)
    starts = np.searchsorted(dst, np.arange(n), side="left").astype(np.int32)
    ends = np.searchsorted(dst, np.arange(n), side="right").astype(np.int32)
    groups.append(GroupEdges(row_of[s[sel]].astype(np.int32), dst, w[sel].astype(np.float32),
                             starts, ends))
  return AggregationPlan(n, aggregation, tuple(groups), tuple(packed.bits))


@functools.partial(jax.jit, static_argnames=("bits", "num_features", "signed", "num_nodes"))
def _xla_group_arrays(words, scales, src_rows, dst, weights, *, bits, num_features, signed,
                      num_nodes):
  from jaxsys.quant.packing import unpack_rows
  packed_rows = words[src_rows]  # [E_g, W]: the only feature bytes read per edge
  vals = unpack_rows(packed_rows, bits, num_features, signed).astype(jnp.float32)  # [E_g, F]
  coef = scales[src_rows] * weights  # [E_g]
  return jax.ops.segment_sum(vals * coef[:, None], dst, num_nodes, indices_are_sorted=True)


def _xla_group(words, scales, ge: GroupEdges, bits, num_features, signed, num_nodes):
  return _xla_group_arrays(words, scales, jnp.asarray(ge.src_rows), jnp.asarray(ge.dst),
                           jnp.asarray(ge.weights), bits=bits, num_features=num_features,
                           signed=signed, num_nodes=num_nodes)


def quantized_aggregate(packed, graph=None, *, aggregation: str = "sum", impl: str = "auto",
                        plan: AggregationPlan | None = None, block=None):
  """Aggregates packed mixed-bit node features over a graph; returns float32 ``[N, F]``.

  Args:
    packed: ``PackedFeatures`` (``jaxsys.quant.packing``).
    graph: jraph.GraphsTuple or ``(senders, receivers)``; may be None when ``plan`` is given.
      Ids must be integers in ``[0, num_nodes)``, checked on the host before any cast
      (``ShapeError`` / ``InputError``); under jit the plan (built outside) carries checked ids.
    aggregation: "sum" | "mean" | "gcn".
    impl: "auto" | "xla" | "pallas" | "pallas_interpret" (``jaxsys.core.dispatch``; the compiled
      kernel lowers to Triton on GPU and Mosaic on TPU, falling back to "xla" past its on-chip
      memory budget; on CPU auto runs "xla").
    plan: a precomputed ``plan_aggregation(packed, graph, aggregation)`` (needed under jit).
    block: ``pallas_kernels.quantized_aggregate.AggregateBlock`` for the Pallas kernel.
  """
  QUANTIZED_AGGREGATE.check(impl)
  check_aggregation(aggregation)
  if plan is None:
    if graph is None:
      raise InputError("pass graph= or plan=")
    plan = plan_aggregation(packed, graph, aggregation)
  elif plan.aggregation != aggregation or plan.bits != tuple(packed.bits):
    raise ConfigError(f"plan was built for aggregation={plan.aggregation!r}, bits={plan.bits}; "
                      f"called with {aggregation=}, bits={tuple(packed.bits)}")
  return QUANTIZED_AGGREGATE(impl, packed, plan, block)


def _sum_groups(packed, plan, group_fn):
  """``sum_g group_fn(words_g, scales_g, edges_g, bits_g)`` over the non-empty groups: ``[N, F]``."""
  out = jnp.zeros((packed.num_nodes, packed.num_features), jnp.float32)
  for g, bits in enumerate(packed.bits):
    if plan.groups[g].dst.size:
      out = out + group_fn(packed.words[g], packed.scales[g], plan.groups[g], bits)
  return out


def _xla_impl(packed, plan, block):
  del block  # a Pallas launch parameter
  return _sum_groups(packed, plan, lambda w, sc, ge, bits: _xla_group(
      w, sc, ge, bits, packed.num_features, packed.signed, packed.num_nodes))


def _pallas_impl(packed, plan, block, interpret=False):
  if not interpret:
    require_backend("quantized_aggregate")  # Triton on GPU, Mosaic on TPU
  from pallas_kernels.quantized_aggregate import group_aggregate
  return _sum_groups(packed, plan, lambda w, sc, ge, bits: group_aggregate(
      w, sc, ge, bits=bits, num_features=packed.num_features, signed=packed.signed,
      num_nodes=packed.num_nodes, block=block, interpret=interpret))


QUANTIZED_AGGREGATE = Dispatcher("quantized_aggregate", {
    "xla": _xla_impl,
    "pallas": _pallas_impl,
    "pallas_interpret": functools.partial(_pallas_impl, interpret=True),
})
