"""Graph attention: sparse (edge), dense, block (tiles) and reformed (tiles + edges) paths.

All paths compute, for every query node ``i`` and head ``h``,

  out[i, h] = sum_{j in N(i)} softmax_j(q[i, h] . k[j, h] * scale) v[j, h]        (1)

over the in-neighbours ``N(i) = {s : (s -> i) is an edge}`` (TorchGT's topology attention), or
over all nodes of the same graph for dense (global) attention. Nodes without neighbours output
zeros and get ``lse = -inf``. Layout: ``q, k, v [nodes, heads, head_dim]`` (one node set, no
batch axis; batched small graphs use ``segment_ids``).

* ``sparse_graph_attention``: gathers per edge and a max-subtracted segment softmax; its VJP is
  written flash-attention style (recomputes the edge probabilities from the saved per-node
  log-sum-exp instead of storing ``[edges, heads]`` intermediates of the forward).
* ``tile_graph_attention``: dense ``block x block`` tiles of a reordered adjacency (ECR dense
  blocks); the adjacency inside a tile is a token-level mask (bits). ``impl="attention_op"``
  routes the tiles through ``jaxsys.ops.attention`` with a ``BlockSparse`` mask whose token mask
  is the adjacency (``AdjacencyMask``); the default computes the tiles as batched matmuls.
* ``reformed_graph_attention``: tiles + leftover edges merged with the log-sum-exp rule
  ``lse = logaddexp(lse_a, lse_b)``, ``out = e^{lse_a - lse} out_a + e^{lse_b - lse} out_b``
  (``jaxsys.ops.merge.merge_lse``, which also merges the tiles of one query block row).
* ``dense_graph_attention``: full attention via ``jaxsys.ops.attention`` (``segment_ids`` keep
  graphs / padding apart).

``graph_attention`` dispatches on ``mode``; each op dispatches on ``impl`` (``jaxsys.core.dispatch``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxsys.core.dispatch import Dispatcher, require_backend
from jaxsys.core.errors import ConfigError, ShapeError
from jaxsys.ops import masks as masks_lib
from jaxsys.ops.ids import check_ids
from jaxsys.ops.merge import merge_lse

__all__ = [
    "AdjacencyMask", "dense_graph_attention", "EDGE_CHUNK", "graph_attention", "GraphTiles", "MODES",
    "reformed_graph_attention", "segment_softmax", "SPARSE", "sparse_graph_attention",
    "tile_graph_attention", "TILES",
]

MODES = ("sparse", "dense", "block", "reformed")


# ----------------------------------------------------------------------------- segment softmax

def segment_softmax(logits, segment_ids, num_segments: int, *, indices_are_sorted: bool = False):
  """Softmax of ``logits [E, ...]`` within segments, max-subtracted (stable for any logits).

  ``-inf`` logits get probability 0; a segment whose logits are all ``-inf`` gets zeros.
  """
  m = jax.ops.segment_max(logits, segment_ids, num_segments, indices_are_sorted=indices_are_sorted)
  m = jax.lax.stop_gradient(jnp.where(jnp.isfinite(m), m, 0.0))  # softmax is shift invariant
  e = jnp.exp(logits - m[segment_ids])
  z = jax.ops.segment_sum(e, segment_ids, num_segments, indices_are_sorted=indices_are_sorted)
  return e / jnp.where(z > 0, z, 1.0)[segment_ids]


# ----------------------------------------------------------------------------- validation

def _check_qkv(q, k, v):
  for name, x in (("q", q), ("k", k), ("v", v)):
    if getattr(x, "ndim", None) != 3:
      raise ShapeError(f"{name} must be [nodes, heads, head_dim], got shape {getattr(x, 'shape', None)}")
  if k.shape != v.shape:
    raise ShapeError(f"k {k.shape} and v {v.shape} must have the same shape")
  if q.shape[1:] != k.shape[1:]:
    raise ShapeError(f"q {q.shape} and k {k.shape} must share [heads, head_dim]")


def _check_self(q, k):
  if q.shape[0] != k.shape[0]:
    raise ShapeError(f"q {q.shape} and k {k.shape} must have the same node count for this path")


def _scale(scale, d):
  return 1.0 / math.sqrt(d) if scale is None else float(scale)


# ----------------------------------------------------------------------------- sparse (edges)

def _head_dot(a, b):
  """Per-head dot products ``[E, H, D] x [E, H, D] -> [E, H]`` (float32).

  Written as the elementwise product times a ``[H*D, H]`` block indicator: XLA:CPU lowers
  ``sum(a * b, -1)`` over gathered rows to a scalar loop (~8x slower at 100K edges), while the
  matmul form runs vectorised. Exact up to float32 summation order.
  """
  e, h, d = a.shape
  ind = jnp.asarray(np.repeat(np.eye(h, dtype=np.float32), d, axis=0))  # [H*D, H]
  prod = (a.astype(jnp.float32) * b.astype(jnp.float32)).reshape(e, h * d)
  return jnp.dot(prod, ind, precision=jax.lax.Precision.HIGHEST)


EDGE_CHUNK = 1 << 15  # edges per chunk of the gathered edge ops (a [chunk, H*D] f32 block: 8 MiB at H*D=64)


def _edge_chunks(*edge_arrays):
  """Edge-indexed arrays ``[E, ...]`` zero-padded to whole chunks: ``[num_chunks, EDGE_CHUNK, ...]``.
  Padding edges have index 0 and, where a weight is chunked with them, weight 0."""
  e = edge_arrays[0].shape[0]
  nc = -(-e // EDGE_CHUNK)
  pad = nc * EDGE_CHUNK - e
  return [jnp.pad(a, ((0, pad),) + ((0, 0),) * (a.ndim - 1)).reshape(nc, EDGE_CHUNK, *a.shape[1:])
          for a in edge_arrays]


def _gathered_head_dot(x, ix, y, iy):
  """``_head_dot(x[ix], y[iy])`` in chunks of ``EDGE_CHUNK`` edges: the gathered operands and
  their product never exist for all edges at once (at 10M edges they would be ~3 GB each, and
  writing them costs more than the arithmetic)."""
  e = ix.shape[0]
  if e <= EDGE_CHUNK:
    return _head_dot(x[ix], y[iy])
  out = jax.lax.map(lambda c: _head_dot(x[c[0]], y[c[1]]), tuple(_edge_chunks(ix, iy)))  # [nc, chunk, H]
  return out.reshape(-1, out.shape[-1])[:e]


def _gathered_segment_sum(w, x, ix, seg, num_segments, sorted_):
  """``segment_sum(w[..., None] * x[ix], seg)`` (``w [E, H]``, ``x [*, H, D]``) in chunks of
  ``EDGE_CHUNK`` edges accumulated into one ``[num_segments, H, D]`` buffer, for the same reason
  as ``_gathered_head_dot``."""
  if ix.shape[0] <= EDGE_CHUNK:
    return jax.ops.segment_sum(w[..., None] * x[ix].astype(jnp.float32), seg, num_segments,
                               indices_are_sorted=sorted_)

  def body(acc, c):
    wi, ii, si = c
    return acc + jax.ops.segment_sum(wi[..., None] * x[ii].astype(jnp.float32), si, num_segments), None

  acc0 = jnp.zeros((num_segments,) + x.shape[1:], jnp.float32)
  return jax.lax.scan(body, acc0, tuple(_edge_chunks(w, ix, seg)))[0]


def _edge_logits(q, k, senders, receivers, scale):
  return _gathered_head_dot(q, receivers, k, senders) * scale  # [edges, heads]: q_r . k_s


def _sparse_fwd_impl(q, k, v, senders, receivers, scale, sorted_):
  n = q.shape[0]  # queries; keys may be a different (e.g. halo-extended) node set
  s = _edge_logits(q, k, senders, receivers, scale)  # [E, H]
  m = jax.ops.segment_max(s, receivers, n, indices_are_sorted=sorted_)  # [N, H]
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  p = jnp.exp(s - m[receivers])  # [E, H]
  l = jax.ops.segment_sum(p, receivers, n, indices_are_sorted=sorted_)  # [N, H]
  o = _gathered_segment_sum(p, v, senders, receivers, n, sorted_)  # [N, H, D]
  safe_l = jnp.where(l > 0, l, 1.0)
  out = o / safe_l[..., None]
  lse = jnp.where(l > 0, m + jnp.log(safe_l), -jnp.inf)
  return out.astype(q.dtype), lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _sparse_attention(q, k, v, senders, receivers, scale, sorted_):
  return _sparse_fwd_impl(q, k, v, senders, receivers, scale, sorted_)


def _sparse_fwd(q, k, v, senders, receivers, scale, sorted_):
  out, lse = _sparse_fwd_impl(q, k, v, senders, receivers, scale, sorted_)
  return (out, lse), (q, k, v, senders, receivers, out, lse)


def _sparse_bwd(scale, sorted_, res, cts):
  """Flash-style edge backward: p = exp(s - lse[r]); ds = p (dout_r . v_s - delta_r + dlse_r)."""
  q, k, v, senders, receivers, out, lse = res
  dout, dlse = cts
  n, nk = q.shape[0], k.shape[0]
  dout = dout.astype(jnp.float32)
  s = _edge_logits(q, k, senders, receivers, scale)
  lse_safe = jnp.where(jnp.isfinite(lse), lse, 0.0)
  p = jnp.exp(s - lse_safe[receivers])  # [E, H]
  delta = _head_dot(dout, out)  # [N, H]
  dp = _gathered_head_dot(dout, receivers, v, senders)  # [E, H]
  ds = p * (dp - delta[receivers] + dlse[receivers]) * scale  # [E, H]
  dv = _gathered_segment_sum(p, dout, receivers, senders, nk, False)  # [Nk, H, D]
  dq = _gathered_segment_sum(ds, k, senders, receivers, n, sorted_)
  dk = _gathered_segment_sum(ds, q, receivers, senders, nk, False)
  return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None)


_sparse_attention.defvjp(_sparse_fwd, _sparse_bwd)


def sparse_graph_attention(q, k, v, senders, receivers, *, scale=None, impl: str = "auto",
                           return_lse: bool = False, indices_are_sorted: bool = False):
  """Attention over edges, equation (1): query ``receivers[e]`` reads key ``senders[e]``.

  Args:
    q: ``[nodes, heads, head_dim]``; k, v: ``[key_nodes, heads, head_dim]`` (usually the same
      nodes; a graph-parallel shard passes local + halo keys).
    senders: ``int[edges]`` in ``[0, key_nodes)``; receivers in ``[0, nodes)``. Float ids raise
      ``ShapeError``; ids out of range raise ``InputError`` -- at once for concrete ids, and for
      ids traced under ``jit`` through ``jax.experimental.checkify`` (a ``debug_check``: a no-op
      in plain ``jit``, raised by ``jaxsys.ops.checked(f)`` / ``checkify.checkify(f)``).
    indices_are_sorted: receivers are sorted (true for ``jaxsys.graphs`` datasets).
  Returns ``out [nodes, heads, head_dim]`` (and float32 ``lse [nodes, heads]``).
  """
  SPARSE.check(impl)
  _check_qkv(q, k, v)
  s_shape, r_shape = np.shape(senders), np.shape(receivers)
  if len(s_shape) != 1 or s_shape != r_shape:
    raise ShapeError(f"senders {s_shape} and receivers {r_shape} must be 1-D of equal length")
  # On the ids as given: jnp.asarray would first cast int64 to int32 (2**32 + 1 -> 1).
  check_ids("senders", senders, k.shape[0], size_name="key_nodes")
  check_ids("receivers", receivers, q.shape[0])
  senders, receivers = jnp.asarray(senders, jnp.int32), jnp.asarray(receivers, jnp.int32)
  out, lse = SPARSE(impl, q, k, v, senders, receivers, _scale(scale, q.shape[-1]),
                    bool(indices_are_sorted))
  return (out, lse) if return_lse else out


def _no_edge_kernel(*args):
  raise NotImplementedError(
      "edge-level sparse attention has no Pallas kernel (gather/scatter bound); the Pallas "
      "kernel serves the dense tiles of the block/reformed path")


SPARSE = Dispatcher("sparse_graph_attention", {
    "xla": _sparse_attention, "pallas": _no_edge_kernel, "pallas_interpret": _no_edge_kernel})


# ----------------------------------------------------------------------------- tiles (blocks)

class GraphTiles(NamedTuple):
  """Dense tiles of a reordered adjacency (a pytree of device arrays).

  ``rows``/``cols``: ``int32[T]`` query/key block of each tile, sorted by row;
  ``bits``: ``bool[T, B, B]``, ``bits[t, i, j]`` = query ``rows[t]*B + i`` reads key
  ``cols[t]*B + j``.
  """
  rows: jax.Array
  cols: jax.Array
  bits: jax.Array

  @property
  def block_size(self) -> int:
    return int(self.bits.shape[-1])

  @classmethod
  def from_reformed(cls, reformed) -> "GraphTiles":
    """From a ``jaxsys.graphs.ReformedGraph`` (host) to device arrays."""
    return cls(jnp.asarray(reformed.rows, jnp.int32), jnp.asarray(reformed.cols, jnp.int32),
               jnp.asarray(reformed.block_bits, bool))


@dataclasses.dataclass(frozen=True, eq=False)
class AdjacencyMask(masks_lib.Mask):
  """Token mask ``A[q, k]`` stored as bits of visited tiles (a ``BlockSparse`` token mask).

  ``tile_of[qb, kb]`` is the tile index of block ``(qb, kb)`` or -1; positions outside tiles are
  invisible.
  """
  tile_of: np.ndarray  # int32 [nb, nb]
  bits: np.ndarray  # bool [T, B, B]

  @classmethod
  def from_tiles(cls, rows, cols, bits, num_nodes: int) -> "AdjacencyMask":
    bits = np.asarray(bits, bool)
    b = bits.shape[-1]
    nb = -(-num_nodes // b)
    tile_of = np.full((nb, nb), -1, np.int32)
    tile_of[np.asarray(rows), np.asarray(cols)] = np.arange(bits.shape[0], dtype=np.int32)
    return cls(tile_of, bits)

  def layout(self) -> np.ndarray:
    return (self.tile_of >= 0)[None]

  def visible(self, q_idx, q_pos, k_idx, head=None):
    xp = masks_lib._xp(q_idx, k_idx)
    b = self.bits.shape[-1]
    nb = self.tile_of.shape[0]
    tile_of = xp.asarray(self.tile_of)
    qb, kb = xp.clip(q_idx // b, 0, nb - 1), xp.clip(k_idx // b, 0, nb - 1)
    t = tile_of[qb, kb]
    bit = xp.asarray(self.bits)[xp.maximum(t, 0), q_idx % b, k_idx % b]
    return (t >= 0) & bit


def _tile_partials_xla(qt, kt, vt, bits, scale):
  """Per-tile masked attention: ``o [T, B, H, D]`` (normalised), ``lse [T, H, B]`` (float32)."""
  s = jnp.einsum("tihd,tjhd->thij", qt.astype(jnp.float32), kt.astype(jnp.float32)) * scale
  s = jnp.where(bits[:, None], s, -jnp.inf)  # [T, H, B, B]
  m = jax.lax.stop_gradient(jnp.max(s, axis=-1))
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  p = jnp.exp(s - m[..., None])
  l = jnp.sum(p, axis=-1)  # [T, H, B]
  safe_l = jnp.where(l > 0, l, 1.0)
  o = jnp.einsum("thij,tjhd->tihd", p, vt.astype(jnp.float32))
  o = o / jnp.swapaxes(safe_l, 1, 2)[..., None]
  lse = jnp.where(l > 0, m + jnp.log(safe_l), -jnp.inf)
  return o, lse


def _pad_nodes(x, n_pad):
  return jnp.pad(x, ((0, n_pad - x.shape[0]), (0, 0), (0, 0))) if n_pad > x.shape[0] else x


def _chunked_partials(qb, kb, vb, rows, cols, bits, scale, chunk):
  """``_tile_partials_xla`` over ``chunk`` tiles at a time (bounds the [T, H, B, B] scores);
  each chunk is recomputed in the backward pass instead of storing its probabilities."""
  t = rows.shape[0]
  chunk = max(1, min(chunk, t))
  nc = -(-t // chunk)
  pad = nc * chunk - t
  rows_p, cols_p = (jnp.pad(x, (0, pad)).reshape(nc, chunk) for x in (rows, cols))
  bits_p = jnp.pad(bits, ((0, pad), (0, 0), (0, 0))).reshape(nc, chunk, *bits.shape[1:])

  @jax.checkpoint
  def part(args):
    r, c, bt = args
    return _tile_partials_xla(qb[r], kb[c], vb[c], bt, scale)

  if nc == 1:
    o, lse = part((rows_p[0], cols_p[0], bits_p[0]))
  else:
    o, lse = jax.lax.map(part, (rows_p, cols_p, bits_p))
  o = o.reshape(nc * chunk, *o.shape[-3:])[:t]
  lse = lse.reshape(nc * chunk, *lse.shape[-2:])[:t]
  return o, lse


def tile_graph_attention(q, k, v, tiles: GraphTiles, *, scale=None, impl: str = "auto",
                         return_lse: bool = False, chunk: int = 256):
  """Attention restricted to dense tiles (the block path / ECR dense blocks).

  ``impl``: "xla" (batched matmuls, ``chunk`` tiles at a time, recomputed in the backward),
  "pallas" / "pallas_interpret" (``pallas_kernels.graph_attention``), "attention_op"
  (``jaxsys.ops.attention`` with ``BlockSparse(layout, token_mask=AdjacencyMask)``; needs
  concrete tiles; explicit only) or "auto" (``jaxsys.core.dispatch``). Returns
  ``out [N, H, D]`` (and ``lse [N, H]``).
  """
  TILES.check(impl)
  _check_qkv(q, k, v)
  _check_self(q, k)
  rows, cols, bits = tiles
  if bits.ndim != 3 or bits.shape[1] != bits.shape[2] or rows.shape != cols.shape or rows.shape[0] != bits.shape[0]:
    raise ShapeError(f"tiles must be rows/cols [T] and bits [T, B, B], got {rows.shape}, {cols.shape}, {bits.shape}")
  out, lse = TILES(impl, q, k, v, tiles, _scale(scale, q.shape[-1]), chunk)
  return (out, lse) if return_lse else out


def _tiles_from_partials(q, k, v, tiles, scale, partials):
  """Pads the nodes to whole tiles, runs ``partials(qb, kb, vb, rows, cols, bits)`` (per-tile
  ``o [T, B, H, D]``, ``lse [T, H, B]``) and merges the tiles of each query block row."""
  rows, cols, bits = tiles
  n, h, d = q.shape
  b = bits.shape[-1]
  nb = -(-n // b)
  if rows.shape[0] == 0:
    return jnp.zeros((n, h, d), q.dtype), jnp.full((n, h), -jnp.inf, jnp.float32)
  qb, kb, vb = (_pad_nodes(x, nb * b).reshape(nb, b, h, d) for x in (q, k, v))
  o, lse_t = partials(qb, kb, vb, rows, cols, bits)
  out, lse = merge_lse(o, lse_t, segment_ids=rows, num_segments=nb, indices_are_sorted=True,
                       lse_heads_first=True)  # [nb, B, H, D], [nb, H, B]
  out = out.reshape(nb * b, h, d)[:n].astype(q.dtype)
  lse = jnp.swapaxes(lse, 1, 2).reshape(nb * b, h)[:n]
  return out, lse


def _tiles_xla(q, k, v, tiles, scale, chunk):
  return _tiles_from_partials(q, k, v, tiles, scale, lambda qb, kb, vb, rows, cols, bits:
                              _chunked_partials(qb, kb, vb, rows, cols, bits, scale, chunk))


def _tiles_pallas(q, k, v, tiles, scale, chunk, interpret=False):
  del chunk  # the kernel streams its tiles itself
  if not interpret:
    require_backend("tile graph attention")
  from pallas_kernels import graph_attention as kernel
  return _tiles_from_partials(q, k, v, tiles, scale, lambda qb, kb, vb, rows, cols, bits:
                              kernel.tile_attention(qb[rows], kb[cols], vb[cols], bits,
                                                    scale=scale, interpret=interpret))


def _tiles_via_attention_op(q, k, v, tiles, scale, chunk):
  del chunk
  from jaxsys.ops.attn.api import attention
  if any(isinstance(x, jax.core.Tracer) for x in tiles):
    raise NotImplementedError("impl='attention_op' needs concrete tiles (the BlockSparse layout is static)")
  n = q.shape[0]
  tm = AdjacencyMask.from_tiles(np.asarray(tiles.rows), np.asarray(tiles.cols), np.asarray(tiles.bits), n)
  b = tm.bits.shape[-1]
  nb = tm.tile_of.shape[0]
  mask = masks_lib.BlockSparse(tm.layout(), b, b, token_mask=tm)
  n_pad = nb * b
  qp, kp, vp = (_pad_nodes(x, n_pad)[None] for x in (q, k, v))
  out, lse = attention(qp, kp, vp, mask=mask, scale=scale, q_offset=0, return_lse=True)
  return out[0, :n], jnp.swapaxes(lse[0], 0, 1)[:n]


# "attention_op" is explicit only: auto tries "pallas" (GPU/TPU) and "xla".
TILES = Dispatcher("tile_graph_attention", {
    "xla": _tiles_xla,
    "pallas": _tiles_pallas,
    "pallas_interpret": functools.partial(_tiles_pallas, interpret=True),
    "attention_op": _tiles_via_attention_op,
})


def reformed_graph_attention(q, k, v, tiles: GraphTiles, senders, receivers, *, scale=None,
                             impl: str = "auto", return_lse: bool = False,
                             indices_are_sorted: bool = False, chunk: int = 256):
  """ECR attention: dense tiles + leftover edges, merged exactly (log-sum-exp rule)."""
  tile_impl = impl
  edge_impl = "auto" if impl in ("pallas", "pallas_interpret", "attention_op") else impl
  if tiles[0].shape[0] == 0:  # no tile met the threshold: exactly the edge kernel, no merge
    return sparse_graph_attention(q, k, v, senders, receivers, scale=scale, impl=edge_impl,
                                  return_lse=return_lse, indices_are_sorted=indices_are_sorted)
  a = tile_graph_attention(q, k, v, tiles, scale=scale, impl=tile_impl, return_lse=True, chunk=chunk)
  b = sparse_graph_attention(q, k, v, senders, receivers, scale=scale, impl=edge_impl,
                             return_lse=True, indices_are_sorted=indices_are_sorted)
  out, lse = merge_lse([a[0], b[0]], [a[1], b[1]])
  out = out.astype(q.dtype)
  return (out, lse) if return_lse else out


# ----------------------------------------------------------------------------- dense

def dense_graph_attention(q, k, v, *, segment_ids=None, node_mask=None, scale=None,
                          impl: str = "auto", return_lse: bool = False):
  """Full (global) attention over all nodes via ``jaxsys.ops.attention``.

  ``segment_ids int[N]``: nodes attend only within equal ids (batched graphs);
  ``node_mask bool[N]``: False nodes (padding) are invisible as keys.
  """
  _check_qkv(q, k, v)
  _check_self(q, k)
  from jaxsys.ops.attn.api import attention
  n = q.shape[0]
  seg = jnp.zeros((n,), jnp.int32) if segment_ids is None else jnp.asarray(segment_ids, jnp.int32)
  if seg.shape != (n,):
    raise ShapeError(f"segment_ids must be int[nodes={n}], got shape {seg.shape}")
  kv_seg = seg
  if node_mask is not None:
    node_mask = jnp.asarray(node_mask, bool)
    if node_mask.shape != (n,):
      raise ShapeError(f"node_mask must be bool[nodes={n}], got shape {node_mask.shape}")
    kv_seg = jnp.where(node_mask, seg, -1)
  seg_arg = None if segment_ids is None and node_mask is None else (seg[None], kv_seg[None])
  out, lse = attention(q[None], k[None], v[None], segment_ids=seg_arg, scale=scale, impl=impl,
                       q_offset=0, return_lse=True)
  out, lse = out[0], jnp.swapaxes(lse[0], 0, 1)
  return (out, lse) if return_lse else out


# ----------------------------------------------------------------------------- dispatch

def graph_attention(q, k, v, *, mode: str = "sparse", senders=None, receivers=None,
                    tiles: GraphTiles | None = None, segment_ids=None, node_mask=None, scale=None,
                    impl: str = "auto", return_lse: bool = False, indices_are_sorted: bool = False):
  """One entry point: ``mode`` = "sparse" (edges) | "dense" (global) | "block" (tiles only,
  i.e. ECR with threshold 0) | "reformed" (tiles + leftover edges)."""
  if mode not in MODES:
    raise ConfigError(f"{mode=} must be one of {MODES}")
  if mode in ("sparse", "reformed") and (senders is None or receivers is None):
    raise ConfigError(f"{mode=} needs senders and receivers")
  if mode in ("block", "reformed") and tiles is None:
    raise ConfigError(f"{mode=} needs tiles (GraphTiles.from_reformed(jaxsys.graphs.reform(...)))")
  if mode == "sparse":
    return sparse_graph_attention(q, k, v, senders, receivers, scale=scale, impl=impl,
                                  return_lse=return_lse, indices_are_sorted=indices_are_sorted)
  if mode == "dense":
    return dense_graph_attention(q, k, v, segment_ids=segment_ids, node_mask=node_mask,
                                 scale=scale, impl=impl, return_lse=return_lse)
  if mode == "block":
    return tile_graph_attention(q, k, v, tiles, scale=scale, impl=impl, return_lse=return_lse)
  return reformed_graph_attention(q, k, v, tiles, senders, receivers, scale=scale, impl=impl,
                                  return_lse=return_lse, indices_are_sorted=indices_are_sorted)
