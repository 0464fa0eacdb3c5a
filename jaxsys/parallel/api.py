"""Public sequence-parallel attention: one call, five strategies, global arrays in and out.

Strategies (``P`` = product of the sequence-parallel mesh axes):

* ``"ulysses"``: all-to-all over all SP axes (heads split ``P`` ways), full attention per head group.
* ``"ring"``: ring attention over all SP axes, contiguous layout (the unbalanced baseline).
* ``"zigzag"``: ring attention over all SP axes, zigzag (dual-chunk) layout: balanced causal work.
* ``"hybrid"``: LongVILA 2D attention, Ulysses over the "ulysses" axis x zigzag ring over "ring".
* ``"allgather"``: all-gather K/V over all SP axes, local queries attend the whole sequence
  (the simple baseline; memory grows with the full sequence).

``sequence_parallel_attention`` takes and returns global ``[batch, seq, heads, dim]`` arrays in
natural token order; it pads (``pad=True``), reorders for zigzag, shards, runs the shard_map
program and restores. Inside a model that already runs on zigzag-ordered, sequence-sharded
activations use ``tokens_reordered=True`` (global arrays already in layout order) or
``sequence_parallel_attention_shard`` (local shards, inside your own ``shard_map``).

Usage::

  mesh = jaxsys.core.mesh.make_mesh({"ring": 2, "ulysses": 4})
  out = sequence_parallel_attention(q, k, v, mesh=mesh, strategy="hybrid", mask=masks.Causal())
  attn_fn = functools.partial(sequence_parallel_attention, mesh=mesh, strategy="hybrid")
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from jaxsys.core.errors import ConfigError, ShapeError
from jaxsys.core.mesh import place, program_mesh
from jaxsys.ops.attn.api import attention
from jaxsys.ops.attn.common import validate
from jaxsys.ops.masks import Mask
from jaxsys.parallel import zigzag as zz
from jaxsys.parallel.hybrid import hybrid_attention_shard
from jaxsys.parallel.ring import check_relative_mask, ring_attention_shard
from jaxsys.parallel.ulysses import check_heads, ulysses_attention_shard

__all__ = [
    "allgather_attention_shard", "check_plan_inputs", "make_plan", "PAD_SEGMENT",
    "seq_spec", "sequence_parallel_attention", "sequence_parallel_attention_shard", "shard_program", "sp_attention_fn",
    "SPPlan", "STRATEGIES",
]

STRATEGIES = ("hybrid", "ulysses", "ring", "zigzag", "allgather")
PAD_SEGMENT = -1  # segment id of padding tokens; real segment ids must be >= 0


@dataclasses.dataclass(frozen=True)
class SPPlan:
  """Resolved axes of one strategy on one mesh.

  ``ring_axes`` / ``ulysses_axes``: mesh axes of the ring and of the all-to-all (each may be
  several axes, flattened major to minor). The sequence is sharded over ``seq_axes``.
  """
  strategy: str
  ring_axes: tuple[str, ...]
  ulysses_axes: tuple[str, ...]
  ring_size: int
  ulysses_size: int
  layout: str
  batch_axis: str | None = None

  @property
  def seq_axes(self) -> tuple[str, ...]:
    return self.ring_axes + self.ulysses_axes

  @property
  def degree(self) -> int:
    return self.ring_size * self.ulysses_size

  def chunk_multiple(self) -> int:
    """Sequence lengths must be a multiple of this."""
    return self.degree * zz.num_chunks(self.layout)


def _axis(names):
  return names[0] if len(names) == 1 else tuple(names)


def make_plan(mesh: Mesh, strategy: str = "hybrid", *, ring_axis: str = "ring",
              ulysses_axis: str = "ulysses", batch_axis: str | None = "data") -> SPPlan:
  """Checks the mesh has the axes ``strategy`` needs and resolves them."""
  if strategy not in STRATEGIES:
    raise ConfigError(f"{strategy=} must be one of {STRATEGIES}")
  names = tuple(mesh.axis_names)
  sp = tuple(a for a in (ring_axis, ulysses_axis) if a in names)
  if strategy == "hybrid":
    missing = [a for a in (ring_axis, ulysses_axis) if a not in names]
    if missing:
      raise ConfigError(f"strategy='hybrid' needs mesh axes ({ring_axis!r}, {ulysses_axis!r}); "
                        f"mesh axes are {names}, missing {missing}")
    ring_axes, uly_axes = (ring_axis,), (ulysses_axis,)
  else:
    if not sp:
      raise ConfigError(f"{strategy=} needs a sequence-parallel mesh axis named {ring_axis!r} "
                        f"or {ulysses_axis!r}; mesh axes are {names}")
    ring_axes, uly_axes = ((), sp) if strategy == "ulysses" else (sp, ())
  size = lambda axes: math.prod(mesh.shape[a] for a in axes)  # noqa: E731
  layout = "zigzag" if strategy in ("zigzag", "hybrid") else "contiguous"
  if strategy == "allgather":
    ring_axes, uly_axes = sp, ()
  batch = batch_axis if batch_axis in names and batch_axis not in sp else None
  return SPPlan(strategy, ring_axes, uly_axes, size(ring_axes), size(uly_axes), layout, batch)


def sequence_parallel_attention_shard(q, k, v, *, plan: SPPlan, mask=None, segment_ids=None,
                                      scale=None, impl: str = "auto"):
  """Runs ``plan`` on local shards (call inside ``shard_map`` over ``plan.seq_axes``).

  Shards are ``[batch, seq/P, heads, dim]`` in layout order (zigzag-reordered for the ring
  degree when ``plan.layout == "zigzag"``); ``segment_ids`` are the matching local ids.
  """
  s = plan.strategy
  if s == "ulysses":
    return ulysses_attention_shard(q, k, v, axis=_axis(plan.ulysses_axes), size=plan.ulysses_size,
                                   mask=mask, segment_ids=segment_ids, scale=scale, impl=impl)
  if s in ("ring", "zigzag"):
    return ring_attention_shard(q, k, v, axis=_axis(plan.ring_axes), size=plan.ring_size,
                                layout=plan.layout, mask=mask, segment_ids=segment_ids,
                                scale=scale, impl=impl)
  if s == "hybrid":
    return hybrid_attention_shard(q, k, v, ring_axis=_axis(plan.ring_axes),
                                  ring_size=plan.ring_size, ulysses_axis=_axis(plan.ulysses_axes),
                                  ulysses_size=plan.ulysses_size, layout=plan.layout, mask=mask,
                                  segment_ids=segment_ids, scale=scale, impl=impl)
  return allgather_attention_shard(q, k, v, axis=_axis(plan.ring_axes), mask=mask,
                                   segment_ids=segment_ids, scale=scale, impl=impl)


def allgather_attention_shard(q, k, v, *, axis, mask=None, segment_ids=None, scale=None,
                              impl: str = "auto"):
  """Baseline: gather all K/V (and kv segment ids), attend the local queries at their offset."""
  n = q.shape[1]
  rank = jax.lax.axis_index(axis)
  kg = jax.lax.all_gather(k, axis, axis=1, tiled=True)  # [batch, seq, kv_heads, dim]
  vg = jax.lax.all_gather(v, axis, axis=1, tiled=True)
  seg = None
  if segment_ids is not None:
    qs, ks = segment_ids if isinstance(segment_ids, (tuple, list)) else (segment_ids,) * 2
    seg = (qs, jax.lax.all_gather(ks, axis, axis=1, tiled=True))
  off = jnp.broadcast_to(rank * n, (q.shape[0],)).astype(jnp.int32)
  return attention(q, kg, vg, mask=mask, segment_ids=seg, scale=scale, impl=impl, q_offset=off)


def check_plan_inputs(plan: SPPlan, q, k, mask, seq_len: int, pad: bool):
  """Clear errors for shapes or masks the plan cannot serve."""
  if mask is not None and not isinstance(mask, Mask):
    # a dense [b|1, h|1, q, k] array would have to be cut along q and k like the shards are
    raise NotImplementedError(
        f"sequence-parallel attention (strategy={plan.strategy!r}) takes mask= as a lazy "
        f"jaxsys.ops.masks.Mask (Full, Causal, Local, ... and their combinations), not a dense "
        f"array (got {type(mask).__name__} of shape {getattr(mask, 'shape', None)}); pass padding "
        f"as segment_ids, or use jaxsys.ops.attention on one device")
  if plan.ulysses_size > 1:
    check_heads(q.shape[2], k.shape[2], plan.ulysses_size)
  if plan.strategy in ("ring", "zigzag", "hybrid"):
    check_relative_mask(mask)
  if not pad:
    zz.check_seq_len(seq_len, plan.ring_size, plan.layout, extra=plan.ulysses_size)


def seq_spec(plan: SPPlan, ndim: int) -> PartitionSpec:
  """The ``PartitionSpec`` of an ``ndim``-rank activation ``[batch, seq, ...]`` under ``plan``: batch
  over the plan's batch axis, sequence over its SP axes, the rest replicated. Use it to place
  global arrays for ``tokens_reordered=True`` calls or to name ``out_shardings``."""
  seq = None if not plan.seq_axes else _axis(plan.seq_axes)
  return PartitionSpec(plan.batch_axis, seq, *([None] * (ndim - 2)))


def shard_program(plan: SPPlan, mesh: Mesh, *, mask=None, scale=None, impl="auto",
                  has_segments=False, reorder=False):
  """The ``shard_map`` over global arrays ``(q, k, v[, q_ids, kv_ids])``, sequence-sharded.

  With ``reorder`` the inputs are in natural order: each rank permutes its shards into the
  zigzag layout on entry and back on exit (``zigzag.zigzag_reorder_shard``), so no global
  gather of the sequence is ever needed; otherwise they are already in layout order.
  """
  spec4, spec2 = seq_spec(plan, 4), seq_spec(plan, 2)
  seq = _axis(plan.seq_axes)
  to_layout = lambda t: zz.zigzag_reorder_shard(t, plan.ring_size, seq, plan.degree)  # noqa: E731

  def body(q, k, v, *segs):
    if reorder:
      q, k, v, *segs = (to_layout(t) for t in (q, k, v, *segs))
    seg = tuple(segs) if segs else None
    out = sequence_parallel_attention_shard(q, k, v, plan=plan, mask=mask, segment_ids=seg,
                                            scale=scale, impl=impl)
    return zz.zigzag_restore_shard(out, plan.ring_size, seq, plan.degree) if reorder else out

  in_specs = (spec4,) * 3 + ((spec2, spec2) if has_segments else ())
  # check_vma=False: per-block kernels may build loop carries without varying-axis types.
  return jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=spec4, check_vma=False)


def sequence_parallel_attention(q, k, v, *, mesh: Mesh, strategy: str = "hybrid", mask=None,
                                segment_ids=None, scale=None, impl: str = "auto",
                                ring_axis: str = "ring", ulysses_axis: str = "ulysses",
                                batch_axis: str | None = "data", pad: bool = False,
                                tokens_reordered: bool = False, q_offset=None, return_lse=False,
                                **unused):
  """Sequence-parallel self-attention on global arrays (same contract as ``jaxsys.ops.attention``).

  Args:
    q: ``[batch, seq, heads, dim]``; k, v: ``[batch, seq, kv_heads, dim]`` (self-attention).
    mesh: a mesh with axes ``ring_axis`` and/or ``ulysses_axis`` (and optionally ``batch_axis``).
    strategy: one of ``STRATEGIES``.
    mask: ``None``/``Full()``, ``Causal()``, ``Local(w)`` (any head-independent mask for
      "ulysses"/"allgather").
    segment_ids: ``int[batch, seq]`` (ids >= 0) or a pair; packed sequences.
    pad: pad ``seq`` to the strategy's multiple (padding is a separate segment, output sliced).
    tokens_reordered: inputs are already in the plan's layout order (zigzag for the ring degree),
      as produced once by the data pipeline with ``zigzag_batch``; the output stays in it.
  Returns ``[batch, seq, heads, dim]`` in q's dtype, in the same token order as the inputs,
  sequence-sharded over the plan's axes. Any mesh axis types work: inside an Explicit mesh
  context the inputs are resharded and the output is typed sharded; otherwise the program runs
  on the mesh's Auto twin (``jaxsys.core.mesh.program_mesh``).
  """
  if return_lse:
    raise NotImplementedError("sequence_parallel_attention does not return the lse")
  for key, value in unused.items():
    if value is not None:
      raise NotImplementedError(f"sequence_parallel_attention does not support {key}=")
  args = validate(q, k, v, mask=mask, segment_ids=segment_ids, scale=scale)
  b, s = q.shape[:2]
  if k.shape[1] != s:
    raise ShapeError(f"sequence-parallel attention is self-attention: q_len={s} != kv_len={k.shape[1]}")
  if q_offset is not None and not (isinstance(q_offset, int) and q_offset == 0):
    raise NotImplementedError(f"{q_offset=} is not supported: sequence-parallel attention starts at 0")
  plan = make_plan(mesh, strategy, ring_axis=ring_axis, ulysses_axis=ulysses_axis,
                   batch_axis=batch_axis)
  check_plan_inputs(plan, q, k, mask, s, pad and not tokens_reordered)
  q_seg, k_seg = args.q_segment_ids, args.kv_segment_ids
  target = zz.pad_len(s, plan.chunk_multiple())
  if target != s:  # only with pad=True (checked above)
    if q_seg is None:
      q_seg = k_seg = jnp.zeros((b, s), jnp.int32)
    q, k, v = (zz.pad_seq(t, target) for t in (q, k, v))
    q_seg, k_seg = (zz.pad_seq(t, target, value=PAD_SEGMENT) for t in (q_seg, k_seg))
  segs = () if q_seg is None else (q_seg, k_seg)
  reorder = plan.layout == "zigzag" and plan.ring_size > 1 and not tokens_reordered
  mesh = program_mesh(mesh)  # Explicit axes: see jaxsys.core.mesh
  # jit: called outside a traced program a shard_map runs eagerly, one compiled program per
  # primitive; inside one (a jitted model) this jit is inlined.
  prog = jax.jit(shard_program(plan, mesh, mask=mask, scale=args.scale, impl=impl,
                               has_segments=bool(segs), reorder=reorder))
  spec4, spec2 = seq_spec(plan, 4), seq_spec(plan, 2)
  out = prog(*(place(t, spec4, mesh) for t in (q, k, v)), *(place(t, spec2, mesh) for t in segs))
  if target == s:
    return out
  # unshard the sequence first: Explicit axes reject a slice that cuts shards unevenly
  out = place(out, PartitionSpec(plan.batch_axis, None, None, None), mesh)
  return jax.lax.slice_in_dim(out, 0, s, axis=1)


def sp_attention_fn(mesh: Mesh, strategy: str = "hybrid", *, tokens_reordered: bool = True, **kwargs):
  """An ``attention_fn`` for ``Decoder(..., attention_fn=...)`` running ``strategy`` on ``mesh``.

  With ``tokens_reordered=True`` (default) the model's inputs, positions and labels must be
  zigzag-reordered once by the data pipeline (``zigzag.shifted_lm_batch``) for zigzag plans.
  """
  make_plan(mesh, strategy, ring_axis=kwargs.get("ring_axis", "ring"),
            ulysses_axis=kwargs.get("ulysses_axis", "ulysses"))  # fail early on a bad mesh
  import functools
  return functools.partial(sequence_parallel_attention, mesh=mesh, strategy=strategy,
                           tokens_reordered=tokens_reordered, **kwargs)
