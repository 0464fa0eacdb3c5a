"""Ring attention (Liu et al. 2023) with zigzag load balancing, as a shard_map program.

Each of the ``P`` ranks on the ring axis holds a shard of queries and of keys/values. K/V
blocks travel around the ring with ``ppermute`` inside a ``lax.scan`` (the send of the next
block is issued before the current block is used, so communication can overlap compute); each
rank attends its queries to every block and merges the partial results with the stable
log-sum-exp rule (all statistics float32):

    L = logaddexp(L_a, L_b),   O = exp(L_a - L) O_a + exp(L_b - L) O_b.

The backward is a ``custom_vjp`` that runs the ring again: dQ stays at home, dK/dV accumulators
travel with their K/V block and arrive back at the owning rank after ``P`` hops. Per block, the
cotangents handed to the local attention are ``dO_b = w_b dO`` and ``dL_b = w_b <dO, O_b - O>``
with ``w_b = exp(L_b - L)`` (differentiating the merge above), so the block gradient equals the
block's share of the full-softmax gradient.

Chunk layouts (``jaxsys.parallel.zigzag``): "contiguous" (rank r holds block r) or "zigzag"
(rank r holds chunks r and 2P-1-r). Query/key positions are global token indices derived from
the layout, so causal / local masks and packed segment ids hold across chunk boundaries; block
pairs a mask hides entirely are skipped with ``lax.cond`` (that is where zigzag balances work).

The per-block attention is ``jaxsys.ops.attention(..., return_lse=True, q_offset=...,
segment_ids=(q_ids, kv_ids))``.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxsys.core.errors import check_min
from jaxsys.ops import masks as masks_lib
from jaxsys.ops.attn.api import attention
from jaxsys.ops.merge import merge_lse
from jaxsys.parallel import zigzag as zz

__all__ = [
    "block_may_be_visible", "check_relative_mask", "merge", "ring_attention_shard", "RingSpec",
    "schedule_work",
]


@dataclasses.dataclass(frozen=True)
class RingSpec:
  """Static description of one ring: mesh axis (or axes), size, layout, mask, scale, impl."""
  axis: str | tuple[str, ...]
  size: int
  layout: str = "zigzag"
  mask: masks_lib.Mask | None = None
  scale: float | None = None
  impl: str = "auto"

  def __post_init__(self):
    zz.num_chunks(self.layout)
    check_min(self, 1, "size", error=ValueError, where="ring ")
    check_relative_mask(self.mask)


# ----------------------------------------------------------------------------- masks

def check_relative_mask(mask):
  """Ring attention places blocks by relative offset: only translation-invariant masks work."""
  if mask is None or isinstance(mask, (masks_lib.Full, masks_lib.Causal, masks_lib.Local)):
    return
  if isinstance(mask, (masks_lib.Or, masks_lib.And)):
    for m in mask.masks:
      check_relative_mask(m)
    return
  raise NotImplementedError(
      f"ring attention supports Full, Causal, Local masks and their |/& combinations "
      f"(translation-invariant); got {type(mask).__name__}. Use strategy='ulysses' or 'allgather'.")


def block_may_be_visible(mask, q_lo, k_lo, c: int, xp=jnp):
  """Whether any key of block ``[k_lo, k_lo+c)`` is visible to a query of ``[q_lo, q_lo+c)``.

  Conservative (True when unsure); works on traced scalars and on numpy ints (``xp=np``).
  """
  if mask is None or isinstance(mask, masks_lib.Full):
    return xp.asarray(True)
  if isinstance(mask, masks_lib.Causal):
    return k_lo <= q_lo + c - 1
  if isinstance(mask, masks_lib.Local):  # 0 <= i - j < w for some i, j in the blocks
    return (k_lo <= q_lo + c - 1) & (q_lo - k_lo - c + 1 < mask.window)
  if isinstance(mask, masks_lib.And):
    out = xp.asarray(True)
    for m in mask.masks:
      out = out & block_may_be_visible(m, q_lo, k_lo, c, xp)
    return out
  if isinstance(mask, masks_lib.Or):
    out = xp.asarray(False)
    for m in mask.masks:
      out = out | block_may_be_visible(m, q_lo, k_lo, c, xp)
    return out
  return xp.asarray(True)


def schedule_work(layout: str, ring_size: int, local_len: int, mask) -> np.ndarray:
  """Attention blocks (each ``c x c`` query-key pairs) every rank computes: ``int[P]``.

  Evaluates the same skip predicate the program uses, so it counts the work that runs.
  """
  nc = zz.num_chunks(layout)
  c = local_len // nc
  work = np.zeros(ring_size, np.int64)
  for r in range(ring_size):
    qs = zz.chunk_starts(layout, r, ring_size, local_len, xp=np)
    for src in range(ring_size):
      ks = zz.chunk_starts(layout, src, ring_size, local_len, xp=np)
      for a in range(nc):
        for b in range(nc):
          work[r] += bool(block_may_be_visible(mask, int(qs[a]), int(ks[b]), c, xp=np))
  return work * c * c


# ----------------------------------------------------------------------------- merge

def merge(o_a, lse_a, o_b, lse_b):
  """Stable merge of two partial attentions. ``o [b, n, h, d]`` f32, ``lse [b, h, n]`` f32."""
  lse = jnp.logaddexp(lse_a, lse_b)
  safe = jnp.where(jnp.isfinite(lse), lse, 0.0)
  w_a = jnp.where(jnp.isfinite(lse_a), jnp.exp(lse_a - safe), 0.0)  # [b, h, n]
  w_b = jnp.where(jnp.isfinite(lse_b), jnp.exp(lse_b - safe), 0.0)
  o = o_a * _rows(w_a) + o_b * _rows(w_b)
  return o, lse


def _rows(w):
  """[b, h, n] -> [b, n, h, 1] to scale per-row outputs."""
  return jnp.swapaxes(w, 1, 2)[..., None]


# ----------------------------------------------------------------------------- blocks

def _block_fn(spec: RingSpec, q_seg, k_seg, offset):
  """Local attention of one query chunk on one key chunk; positions differ by ``offset``."""
  seg = None if q_seg is None else (q_seg, k_seg)

  def fn(q, k, v):
    b = q.shape[0]
    return attention(q, k, v, mask=spec.mask, segment_ids=seg, scale=spec.scale,
                     impl=spec.impl, return_lse=True,
                     q_offset=jnp.broadcast_to(offset, (b,)).astype(jnp.int32))
  return fn


def _vzeros(x, *others):
  """f32 zeros shaped like ``x`` that vary over the same mesh axes as ``x`` and ``others``.

  (``lax.cond`` branches inside ``shard_map`` must agree on which axes a value varies over.)
  """
  z = jnp.zeros_like(x, jnp.float32)
  for o in others:
    z = z + jnp.zeros_like(o.reshape(-1)[0], jnp.float32)
  return z


def _chunks(x, nc):
  """[b, n, ...] -> [b, nc, n/nc, ...]."""
  return None if x is None else x.reshape(x.shape[0], nc, x.shape[1] // nc, *x.shape[2:])


def _sizes(q, k, nc):
  b, n, h, d = q.shape
  return b, n // nc, h, d


def _take(x, i):
  """Chunk ``i`` (traced) of ``[b, nc, ...]``; None stays None."""
  return None if x is None else jax.lax.dynamic_index_in_dim(x, i, axis=1, keepdims=False)


def _add_at(x, i, val):
  cur = jax.lax.dynamic_index_in_dim(x, i, axis=1, keepdims=False)
  return jax.lax.dynamic_update_index_in_dim(x, cur + val, i, axis=1)


def _pair(spec, p, nc, q_starts, k_starts, qsc, ksc):
  """Query chunk ``a``, key chunk ``j`` of pair ``p`` (a loop, not unrolled: small programs)."""
  a, j = p // nc, p % nc
  qs, ks = q_starts[a], k_starts[j]
  fn = _block_fn(spec, _take(qsc, a), _take(ksc, j), qs - ks)
  return a, j, fn, qs, ks


def _fwd_step(spec, qc, qsc, q_starts, o, lse, kv, src):
  """Attends every local query chunk to every chunk of the K/V block owned by ``src``."""
  kc, vc, ksc = kv
  nc, c = qc.shape[1], qc.shape[2]
  k_starts = zz.chunk_starts(spec.layout, src, spec.size, c * nc)

  def pair(p, carry):
    o, lse = carry
    a, j, fn, qs, ks = _pair(spec, p, nc, q_starts, k_starts, qsc, ksc)
    q, k, v = _take(qc, a), _take(kc, j), _take(vc, j)

    def run():
      ob, lb = fn(q, k, v)
      return ob.astype(jnp.float32), lb

    def skip():
      z = _vzeros(q, k, v)  # [b, c, h, d]
      return z, jnp.swapaxes(z[..., 0], 1, 2) - jnp.inf

    ob, lb = jax.lax.cond(block_may_be_visible(spec.mask, qs, ks, c), run, skip)
    oa, la = merge_lse([_take(o, a), ob], [_take(lse, a), lb], lse_heads_first=True)
    o = jax.lax.dynamic_update_index_in_dim(o, oa, a, axis=1)
    lse = jax.lax.dynamic_update_index_in_dim(lse, la, a, axis=1)
    return o, lse

  return jax.lax.fori_loop(0, nc * nc, pair, (o, lse))


def _rotate(spec: RingSpec, x):
  perm = [(i, (i + 1) % spec.size) for i in range(spec.size)]
  return jax.tree.map(lambda a: jax.lax.ppermute(a, spec.axis, perm), x)


def _forward(spec: RingSpec, q, k, v, q_seg, k_seg):
  nc = zz.num_chunks(spec.layout)
  b, c, h, d = _sizes(q, k, nc)
  rank = jax.lax.axis_index(spec.axis)
  q_starts = zz.chunk_starts(spec.layout, rank, spec.size, c * nc)
  qc, qsc = _chunks(q, nc), _chunks(q_seg, nc)
  kv = (_chunks(k, nc), _chunks(v, nc), _chunks(k_seg, nc))
  o = _vzeros(qc, k, v)  # [b, nc, c, h, d]
  lse = jnp.swapaxes(o[..., 0], 2, 3) - jnp.inf  # [b, nc, h, c]

  def body(carry, step):
    o, lse, kv = carry
    nxt = _rotate(spec, kv)  # issued first: the transfer overlaps the block compute
    o, lse = _fwd_step(spec, qc, qsc, q_starts, o, lse, kv, (rank - step) % spec.size)
    return (o, lse, nxt), None

  (o, lse, kv), _ = jax.lax.scan(body, (o, lse, kv), jnp.arange(spec.size - 1))
  o, lse = _fwd_step(spec, qc, qsc, q_starts, o, lse, kv, (rank - spec.size + 1) % spec.size)
  # [b, nc, c, h, d] -> [b, n, h, d];  lse [b, nc, h, c] -> [b, h, n]
  o = o.reshape(b, nc * c, h, d)
  lse = jnp.moveaxis(lse, 1, 2).reshape(b, h, nc * c)
  return o, lse


def _bwd_step(spec, qc, qsc, q_starts, oc, lc, doc, dq, kv, dkv, src):
  """Adds this K/V block's contributions to dQ (local) and to the travelling dK/dV."""
  kc, vc, ksc = kv
  nc, c = qc.shape[1], qc.shape[2]
  k_starts = zz.chunk_starts(spec.layout, src, spec.size, c * nc)

  def pair(p, carry):
    dq, dk, dv = carry
    a, j, fn, qs, ks = _pair(spec, p, nc, q_starts, k_starts, qsc, ksc)
    q, k, v = _take(qc, a), _take(kc, j), _take(vc, j)
    o, L, do = _take(oc, a), _take(lc, a), _take(doc, a)

    def run():
      (ob, lb), vjp = jax.vjp(fn, q, k, v)
      safe = jnp.where(jnp.isfinite(L), L, 0.0)
      w = jnp.where(jnp.isfinite(lb), jnp.exp(lb - safe), 0.0)  # [b, h, c]
      do_b = (do * _rows(w)).astype(ob.dtype)
      # dL_b = w_b <dO, O_b - O> per row: [b, c, h] -> [b, h, c]
      g = w * jnp.swapaxes(jnp.sum(do * (ob.astype(jnp.float32) - o), -1), 1, 2)
      return tuple(t.astype(jnp.float32) for t in vjp((do_b, g)))

    def skip():
      return _vzeros(q, k, v, do), _vzeros(k, q, v, do), _vzeros(v, q, k, do)

    dqb, dkb, dvb = jax.lax.cond(block_may_be_visible(spec.mask, qs, ks, c), run, skip)
    return _add_at(dq, a, dqb), _add_at(dk, j, dkb), _add_at(dv, j, dvb)

  dq, dk, dv = jax.lax.fori_loop(0, nc * nc, pair, (dq, *dkv))
  return dq, (dk, dv)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring(spec, q, k, v, q_seg, k_seg):
  return _forward(spec, q, k, v, q_seg, k_seg)[0].astype(q.dtype)


def _ring_fwd(spec, q, k, v, q_seg, k_seg):
  o, lse = _forward(spec, q, k, v, q_seg, k_seg)
  return o.astype(q.dtype), (q, k, v, q_seg, k_seg, o, lse)


def _ring_bwd(spec, res, do):
  q, k, v, q_seg, k_seg, o, lse = res
  nc = zz.num_chunks(spec.layout)
  b, c, h, d = _sizes(q, k, nc)
  rank = jax.lax.axis_index(spec.axis)
  q_starts = zz.chunk_starts(spec.layout, rank, spec.size, c * nc)
  qc, qsc = _chunks(q, nc), _chunks(q_seg, nc)
  oc, doc = _chunks(o, nc), _chunks(do.astype(jnp.float32), nc)
  lc = jnp.moveaxis(lse.reshape(b, h, nc, c), 2, 1)  # [b, nc, h, c]
  kv = (_chunks(k, nc), _chunks(v, nc), _chunks(k_seg, nc))
  dkv = (_vzeros(kv[0], q, v, do), _vzeros(kv[1], q, k, do))
  dq = _vzeros(qc, k, v, do)

  def body(carry, step):
    dq, kv, dkv = carry
    nxt = _rotate(spec, kv)
    dq, dkv = _bwd_step(spec, qc, qsc, q_starts, oc, lc, doc, dq, kv, dkv,
                        (rank - step) % spec.size)
    return (dq, nxt, _rotate(spec, dkv)), None

  (dq, kv, dkv), _ = jax.lax.scan(body, (dq, kv, dkv), jnp.arange(spec.size - 1))
  dq, dkv = _bwd_step(spec, qc, qsc, q_starts, oc, lc, doc, dq, kv, dkv,
                      (rank - spec.size + 1) % spec.size)
  dk, dv = _rotate(spec, dkv)  # the P-th hop brings each dK/dV home
  shape = lambda x, ref: x.reshape(ref.shape).astype(ref.dtype)  # noqa: E731
  return shape(dq, q), shape(dk, k), shape(dv, v), None, None


_ring.defvjp(_ring_fwd, _ring_bwd)


def ring_attention_shard(q, k, v, *, axis, size: int, layout: str = "zigzag", mask=None,
                         segment_ids=None, scale=None, impl: str = "auto"):
  """Ring attention on already-sharded, already-laid-out shards (call inside ``shard_map``).

  Args:
    q: ``[batch, n, heads, dim]`` local queries (``n = seq / size``, chunks per ``layout``).
    k, v: ``[batch, n, kv_heads, dim]`` local keys/values.
    axis: the ring's mesh axis name (or tuple of names, flattened major to minor).
    size: the ring degree (product of those axes' sizes).
    segment_ids: ``int[batch, n]`` local ids, or a pair (q_ids, kv_ids).
  Returns ``[batch, n, heads, dim]`` in q's dtype.
  """
  spec = RingSpec(axis=axis, size=size, layout=layout, mask=mask, scale=scale, impl=impl)
  zz.check_seq_len(q.shape[1], 1, layout, what="local seq_len")
  if segment_ids is None:
    q_seg = k_seg = None
  elif isinstance(segment_ids, (tuple, list)):
    q_seg, k_seg = segment_ids
  else:
    q_seg = k_seg = segment_ids
  if q_seg is not None:
    q_seg, k_seg = jnp.asarray(q_seg, jnp.int32), jnp.asarray(k_seg, jnp.int32)
  return _ring(spec, q, k, v, q_seg, k_seg)
