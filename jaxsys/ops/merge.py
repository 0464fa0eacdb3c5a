"""The log-sum-exp merge of partial attentions: one rule for every op that splits its keys.

Partial ``p`` attends the queries to a disjoint subset of the keys and yields its normalised
output ``o_p`` and log-sum-exp ``lse_p`` (``-inf`` where it saw no key). Over all keys:

  lse = log sum_p exp(lse_p),      out = sum_p exp(lse_p - lse) o_p                      (1)

computed max-subtracted (``m = max_p lse_p``), in float32, with zero output and ``lse = -inf``
where no partial saw a key. The result does not depend on ``m``, so ``m`` is a
``stop_gradient`` constant and the merge differentiates exactly.

Users: flash-decode split-K (``paged_attention``, XLA and Pallas paths), the tiles + edges of
reformed graph attention and the tiles of one query block row (``graph_attn``), and the ring
steps of sequence parallelism (``jaxsys.parallel.ring``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["merge_lse", "normalize_partial"]


def merge_lse(outs, lses, *, axis: int = 0, segment_ids=None, num_segments: int | None = None,
              indices_are_sorted: bool = False, lse_heads_first: bool = False):
  """Merges partial attentions with rule (1).

  Args:
    outs: normalised partial outputs stacked on ``axis``: ``[..., P, ..., dim]``, or a sequence
      of ``P`` arrays ``[..., dim]`` (then ``axis`` is 0).
    lses: their log-sum-exp, stacked the same way: ``outs``' shape without ``dim``, or with its
      last two axes swapped when ``lse_heads_first`` (attention's ``out [.., rows, heads, dim]``
      with ``lse [.., heads, rows]``).
    segment_ids: ``int[P]``: merge the partials of equal id (``num_segments`` results, e.g.
      the tiles of one query block row) instead of all ``P``.
  Returns ``out`` (float32, ``axis`` reduced or replaced by ``num_segments``) and ``lse`` in the
  layout of ``lses``.
  """
  if isinstance(outs, (list, tuple)):
    outs, lses, axis = jnp.stack(outs), jnp.stack(lses), 0
  o = jnp.moveaxis(outs.astype(jnp.float32), axis, 0)  # [P, ..., dim]
  lse = jnp.moveaxis(lses.astype(jnp.float32), axis, 0)  # [P, ...]
  if segment_ids is None:
    m = jnp.max(lse, axis=0)
    total = lambda x: jnp.sum(x, axis=0)  # noqa: E731
    spread = lambda x: x[None]  # noqa: E731
  else:
    kw = dict(num_segments=num_segments, indices_are_sorted=indices_are_sorted)
    m = jax.ops.segment_max(lse, segment_ids, **kw)
    total = lambda x: jax.ops.segment_sum(x, segment_ids, **kw)  # noqa: E731
    spread = lambda x: x[segment_ids]  # noqa: E731
  m = jax.lax.stop_gradient(jnp.where(jnp.isfinite(m), m, 0.0))
  w = jnp.exp(lse - spread(m))  # [P, ...]; 0 where a partial saw no key
  z = total(w)
  safe = jnp.where(z > 0, z, 1.0)
  rows = (lambda x: jnp.swapaxes(x, -1, -2)[..., None]) if lse_heads_first else (lambda x: x[..., None])
  out = total(o * rows(w)) / rows(safe)
  lse_out = jnp.where(z > 0, m + jnp.log(safe), -jnp.inf)
  if segment_ids is not None and axis:  # the segment axis goes where the partial axis was
    out, lse_out = jnp.moveaxis(out, 0, axis), jnp.moveaxis(lse_out, 0, axis)
  return out, lse_out


def normalize_partial(o, m, l):
  """An unnormalised online-softmax partial ``(o = sum_j e^{s_j - m} v_j, m, l = sum_j e^{s_j - m})``
  as ``(o / l, m + log l)`` for ``merge_lse`` (zeros and ``-inf`` where ``l == 0``)."""
  safe = jnp.where(l > 0, l, 1.0)
  return o / safe[..., None], jnp.where(l > 0, m + jnp.log(safe), -jnp.inf)
