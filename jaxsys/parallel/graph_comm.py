"""Sylvie: distributed full-graph GCN training with 1-bit halo exchange and bounded staleness.

The graph is split by a partition vector (METIS, ``jaxsys.graphs.metis_partition``); device p
owns the nodes of part p and every edge whose destination it owns. Per layer (aggregate first,
``H' = D^-1/2 (A+I) D^-1/2 H W``) each device needs the boundary rows of ``H`` owned by others:

* forward: owners gather the requested rows into ``[P, S, F]`` (S = the largest request between
  two devices), optionally quantize them to 1 bit (``jaxsys.quant.comm``: per-row lo/hi,
  stochastic rounding, 32 bits per uint32 word) and ``all_to_all`` them;
* backward: the feature gradients of the halo rows travel back the same way (quantized too) and
  are scatter-added into the owners' rows (a ``custom_vjp`` around the transfer);
* bounded staleness S: layer inputs use halo rows received S epochs earlier, and gradients for
  owned rows computed by peers S epochs earlier; the fresh transfers of this epoch feed only
  later epochs, so they can overlap this epoch's compute.

With ``quantize=False, staleness=0`` the result equals single-device training (same init, same
hash dropout keyed by global node id); ``reference_step`` is that single-device program.

Usage::

  plan = build_partition_plan(senders, receivers, n, parts, num_parts=8)
  trainer = SylvieTrainer(plan, dims=(F, 16, C), cfg=SylvieConfig(quantize=True), mesh=mesh)
  state = trainer.init(params, x, labels, train_mask)
  state, loss = trainer.step(state, epoch)
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex_core
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxsys.core.optim import OptimizerConfig, check_nested
from jaxsys.core.errors import ConfigError, InputError, ShapeError
from jaxsys.core.mesh import place, program_mesh, put
from jaxsys.graphs.node_loss import masked_node_cross_entropy
from jaxsys.ops.quantized_agg import normalized_edges
from jaxsys.quant.comm import bytes_per_row, dequantize_1bit, quantize_1bit
from jaxsys.quant.random import hash_dropout
from jaxsys.core.step import apply_optax, make_train_step

__all__ = [
    "all_to_all_operand_bytes", "build_partition_plan", "check_partition", "gcn_layer", "init_gcn_params",
    "inject_grad", "PartitionPlan", "reference_logits", "reference_step", "SylvieConfig",
    "SylvieTrainer", "transfer",
]


@dataclasses.dataclass(frozen=True)
class SylvieConfig:
  """``SylvieTrainer``'s settings. ``optimizer`` (a ``jaxsys.core.optim.OptimizerConfig``): the
  parameters' optimizer; None: AdamW at ``lr`` with ``weight_decay``, and given, those two stay
  at their defaults."""
  quantize: bool = True     # 1-bit boundary features (forward) and gradients (backward)
  staleness: int = 0        # boundary data up to this many epochs old (0 = synchronous)
  dropout: float = 0.5
  lr: float = 0.01
  weight_decay: float = 5e-4
  axis: str = "graph"
  optimizer: OptimizerConfig | None = None

  def __post_init__(self):
    if self.staleness < 0:
      raise ConfigError(f"staleness={self.staleness} must be >= 0")
    if not 0.0 <= self.dropout < 1.0:
      raise ConfigError(f"dropout={self.dropout} must lie in [0, 1)")
    check_nested(self, "lr", "weight_decay")

  def optimizer_config(self) -> OptimizerConfig:
    """The parameters' optimizer: ``optimizer``, or AdamW at ``lr`` with ``weight_decay``."""
    return self.optimizer or OptimizerConfig("adamw", self.lr, weight_decay=self.weight_decay)


@dataclasses.dataclass(frozen=True, eq=False)
class PartitionPlan:
  """Host-side layout of a partitioned graph (all arrays numpy, leading axis = device)."""
  num_parts: int
  num_nodes: int
  local_size: int          # Nl: padded nodes per device
  halo_size: int           # S: padded rows one device sends another
  global_ids: np.ndarray   # int32 [P, Nl] (-1 = padding)
  send_idx: np.ndarray     # int32 [P, P, S] local rows device p sends to q
  send_valid: np.ndarray   # bool [P, P, S]
  edge_src: np.ndarray     # int32 [P, El] into [own Nl rows | halo P*S rows]
  edge_dst: np.ndarray     # int32 [P, El] local destination
  edge_w: np.ndarray       # float32 [P, El] gcn weight (0 = padding)
  halo_rows: int           # real (unpadded) boundary rows over all device pairs

  @property
  def node_valid(self) -> np.ndarray:
    return self.global_ids >= 0

  def shard_nodes(self, arr, fill=0):
    """Global ``[N, ...]`` -> per-device ``[P, Nl, ...]`` (padding rows = fill)."""
    arr = np.asarray(arr)
    if arr.shape[0] != self.num_nodes:
      raise ShapeError(f"array has {arr.shape[0]} rows, graph has {self.num_nodes} nodes")
    out = np.full((self.num_parts, self.local_size) + arr.shape[1:], fill, arr.dtype)
    valid = self.node_valid
    out[valid] = arr[self.global_ids[valid]]
    return out

  def gather_nodes(self, arr):
    """Per-device ``[P, Nl, ...]`` -> global ``[N, ...]``."""
    arr = np.asarray(arr)
    out = np.zeros((self.num_nodes,) + arr.shape[2:], arr.dtype)
    valid = self.node_valid
    out[self.global_ids[valid]] = arr[valid]
    return out

  def wire_bytes(self, feature_dims, quantize: bool, grad_layers=None) -> dict:
    """Bytes the all_to_alls of one epoch move between devices (padded arrays, no self chunk).

    ``feature_dims``: input width of each layer; forward exchanges every layer's input, the
    backward exchanges the gradients of layers ``grad_layers`` (default: all but the first,
    whose input features are constants).
    """
    grad_layers = range(1, len(feature_dims)) if grad_layers is None else grad_layers
    rows = self.num_parts * (self.num_parts - 1) * self.halo_size
    fwd = sum(rows * bytes_per_row(f, quantize) for f in feature_dims)
    bwd = sum(rows * bytes_per_row(feature_dims[l], quantize) for l in grad_layers)
    useful = sum(self.halo_rows * bytes_per_row(f, quantize) for f in feature_dims)
    useful += sum(self.halo_rows * bytes_per_row(feature_dims[l], quantize) for l in grad_layers)
    return {"forward": fwd, "backward": bwd, "total": fwd + bwd, "unpadded_total": useful}


def check_partition(parts, num_nodes: int, num_parts: int) -> np.ndarray:
  parts = np.asarray(parts)
  if parts.ndim != 1 or parts.shape[0] != num_nodes:
    raise InputError(f"parts must assign every node: expected shape [{num_nodes}], got "
                     f"{parts.shape} (nodes missing from the partition)")
  if not np.issubdtype(parts.dtype, np.integer):
    raise InputError(f"parts must be integers, got {parts.dtype}")
  if parts.size and (parts.min() < 0 or parts.max() >= num_parts):
    bad = int(np.sum((parts < 0) | (parts >= num_parts)))
    raise InputError(f"{bad} nodes have a part outside [0, {num_parts}) (nodes missing from "
                     "the partition)")
  return parts.astype(np.int64)


def build_partition_plan(senders, receivers, num_nodes: int, parts, num_parts: int
                         ) -> PartitionPlan:
  """Local orderings, halo send lists and local gcn-normalised edges for every device."""
  if num_parts <= 0:
    raise ConfigError(f"{num_parts=} must be positive")
  parts = check_partition(parts, num_nodes, num_parts)
  s, r, w = (np.asarray(a) for a in normalized_edges(np.asarray(senders), np.asarray(receivers),
                                                      num_nodes, "gcn"))
  counts = np.bincount(parts, minlength=num_parts)
  nl = max(int(counts.max()), 1)
  global_ids = np.full((num_parts, nl), -1, np.int32)
  local = np.zeros(num_nodes, np.int64)
  for p in range(num_parts):
    ids = np.nonzero(parts == p)[0]
    global_ids[p, :ids.size] = ids
    local[ids] = np.arange(ids.size)
  # need[q][p]: sorted global ids device q needs from device p.
  need = [[np.unique(s[(parts[r] == q) & (parts[s] == p)]) if p != q else np.zeros(0, np.int64)
           for p in range(num_parts)] for q in range(num_parts)]
  sh = max(1, max(a.size for row in need for a in row))
  send_idx = np.zeros((num_parts, num_parts, sh), np.int32)
  send_valid = np.zeros((num_parts, num_parts, sh), bool)
  halo_pos = []  # per q: global id -> slot in its [P*S] halo
  for q in range(num_parts):
    pos = {}
    for p in range(num_parts):
      ids = need[q][p]
      send_idx[p, q, :ids.size] = local[ids]
      send_valid[p, q, :ids.size] = True
      pos.update({int(g): p * sh + i for i, g in enumerate(ids)})
    halo_pos.append(pos)
  el = max(1, int(np.bincount(parts[r], minlength=num_parts).max()))
  edge_src = np.zeros((num_parts, el), np.int32)
  edge_dst = np.zeros((num_parts, el), np.int32)
  edge_w = np.zeros((num_parts, el), np.float32)
  for q in range(num_parts):
    sel = np.nonzero(parts[r] == q)[0]
    src = s[sel]
    own = parts[src] == q
    ext = np.where(own, local[src], 0)
    remote = np.nonzero(~own)[0]
    ext[remote] = [nl + halo_pos[q][int(g)] for g in src[remote]]
    edge_src[q, :sel.size] = ext
    edge_dst[q, :sel.size] = local[r[sel]]
    edge_w[q, :sel.size] = w[sel]
  halo_rows = int(sum(a.size for row in need for a in row))
  return PartitionPlan(num_parts, num_nodes, nl, sh, global_ids, send_idx, send_valid,
                       edge_src, edge_dst, edge_w, halo_rows)


# ----------------------------------------------------------------------------- transfers


def _a2a(x, axis):
  # [P, S, ...]: block q goes to device q; the result's block p came from device p.
  return jax.lax.all_to_all(x, axis, 0, 0, tiled=True)


def _wire(x, seed, axis: str, quantize: bool):
  """Sends ``x [P, S, F]`` through all_to_all (1-bit payload when quantize)."""
  if not quantize:
    return _a2a(x, axis)
  payload = quantize_1bit(x, seed=seed)
  received = type(payload)(*(_a2a(a, axis) for a in payload))
  return dequantize_1bit(received, x.shape[-1])


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def transfer(x, seed, axis: str, quantize: bool):
  """all_to_all of boundary rows whose backward sends the gradient back the same way."""
  return _wire(x, seed, axis, quantize)


def _transfer_fwd(x, seed, axis, quantize):
  return _wire(x, seed, axis, quantize), seed


def _transfer_bwd(axis, quantize, seed, g):
  return _wire(g, seed + jnp.uint32(0x51ED), axis, quantize), None


transfer.defvjp(_transfer_fwd, _transfer_bwd)


@jax.custom_vjp
def inject_grad(h, extra):
  """Identity on ``h`` whose backward adds ``extra`` (stale gradients from peers)."""
  return h


def _inject_fwd(h, extra):
  return h, extra


def _inject_bwd(extra, g):
  return g + extra, jnp.zeros_like(extra)


inject_grad.defvjp(_inject_fwd, _inject_bwd)


# ----------------------------------------------------------------------------- model


def init_gcn_params(key, dims) -> dict:
  """Glorot-uniform weights and zero biases of a GCN with layer widths ``dims``."""
  ws, bs = [], []
  for i, (a, b) in enumerate(zip(dims[:-1], dims[1:])):
    lim = np.sqrt(6.0 / (a + b))
    ws.append(jax.random.uniform(jax.random.fold_in(key, i), (a, b), jnp.float32, -lim, lim))
    bs.append(jnp.zeros((b,), jnp.float32))
  return {"w": ws, "b": bs}


def _dropout_seed(seed, layer):
  return jnp.asarray(seed, jnp.uint32) * jnp.uint32(7919) + jnp.uint32(layer)


def gcn_layer(h_ext, edge_src, edge_dst, edge_w, num_rows, w, b):
  """Aggregate first, then transform: ``(sum_e w_e h[src_e]) W + b`` ``[rows, out]``."""
  agg = jax.ops.segment_sum(h_ext[edge_src] * edge_w[:, None], edge_dst, num_rows)  # [rows, in]
  return jnp.einsum("nf,fo->no", agg, w) + b


def reference_logits(params, x, senders, receivers, seed, dropout: float, train: bool):
  """Single-device GCN (same math, same hash dropout) used as the exactness baseline."""
  n = x.shape[0]
  s, r, w = normalized_edges(senders, receivers, n, "gcn")
  h = x
  for l, (wl, bl) in enumerate(zip(params["w"], params["b"])):
    if train:
      h = hash_dropout(h, _dropout_seed(seed, l), dropout)
    h = gcn_layer(h, s, r, w, n, wl, bl)
    if l < len(params["w"]) - 1:
      h = jax.nn.relu(h)
  return h


def reference_step(params, opt_state, x, senders, receivers, labels, mask, seed, tx, dropout):
  def loss_fn(p):
    logits = reference_logits(p, x, senders, receivers, seed, dropout, True)
    return masked_node_cross_entropy(logits, labels, mask)
  params, opt_state, loss, _ = make_train_step(loss_fn, tx, jit=False)(params, opt_state)
  return params, opt_state, loss


# ----------------------------------------------------------------------------- distributed


def _transfer_seed(seed, layer, me, direction=0):
  base = jnp.asarray(seed, jnp.uint32) * jnp.uint32(1_000_003)
  return base + jnp.uint32(97) * jnp.uint32(layer) + jnp.uint32(13) * me.astype(jnp.uint32) \
      + jnp.uint32(direction * 0x3C6EF372)


class SylvieTrainer:
  """Full-graph GCN training on a 1-D device mesh axis (``cfg.axis``) with ``jax.shard_map``."""

  def __init__(self, plan: PartitionPlan, dims, cfg: SylvieConfig, mesh):
    if cfg.axis not in mesh.axis_names:
      raise ConfigError(f"mesh axes {mesh.axis_names} lack the partition axis {cfg.axis!r}")
    if mesh.shape[cfg.axis] != plan.num_parts:
      raise ConfigError(f"plan has num_parts={plan.num_parts} but mesh axis {cfg.axis!r} has "
                        f"{mesh.shape[cfg.axis]} devices")
    self.plan, self.dims, self.cfg, self.mesh = plan, tuple(dims), cfg, mesh
    self.tx = cfg.optimizer_config().build()
    self.num_layers = len(dims) - 1
    self._step = jax.jit(self._step_impl)
    self._eval = jax.jit(self._eval_impl)

  # -- data placement
  def _put(self, arr):
    # mesh.put: from host memory straight into the shards (jnp.asarray first would put the whole
    # array on one device and reshard it with a compiled slicing program per shape)
    return put(arr, NamedSharding(program_mesh(self.mesh), P(self.cfg.axis)))

  def put_nodes(self, arr, fill=0):
    """Global per-node ``[N, ...]`` -> ``[P, Nl, ...]`` split over the partition axis (padding
    rows = ``fill``), laid out like :meth:`slab_logits`."""
    return self._put(self.plan.shard_nodes(arr, fill))

  def _placed(self, params, *sharded):
    """The program mesh and the step's inputs on it: ``params`` replicated, the rest split
    over the partition axis (a reshard on Explicit axes; see ``jaxsys.core.mesh``)."""
    mesh = program_mesh(self.mesh)
    put = lambda tree, spec: jax.tree.map(lambda t: place(t, spec, mesh), tree)  # noqa: E731
    return mesh, put(params, P()), *(put(t, P(self.cfg.axis)) for t in sharded)

  def init(self, params, x, labels, train_mask) -> dict:
    """Shards the data; returns the training state (params, optimizer, staleness buffers)."""
    pl_, depth = self.plan, self.cfg.staleness
    x = np.asarray(x, np.float32)
    if x.shape != (pl_.num_nodes, self.dims[0]):
      raise ShapeError(f"x must be [{pl_.num_nodes}, {self.dims[0]}], got {x.shape}")
    mask = np.asarray(train_mask, bool)
    self.count = float(max(mask.sum(), 1))
    self.data = {k: self._put(v) for k, v in dict(
        x=pl_.shard_nodes(x), labels=pl_.shard_nodes(np.asarray(labels, np.int32)),
        mask=pl_.shard_nodes(mask, False), gids=pl_.global_ids, send_idx=pl_.send_idx,
        send_valid=pl_.send_valid, esrc=pl_.edge_src, edst=pl_.edge_dst, ew=pl_.edge_w).items()}
    halo = pl_.num_parts * pl_.halo_size
    bufs = {"halo": [self._put(np.zeros((pl_.num_parts, depth, halo, f), np.float32))
                     for f in self.dims[:-1]] if depth else [],
            "grad": [self._put(np.zeros((pl_.num_parts, depth, pl_.local_size, f), np.float32))
                     for f in self.dims[:-1]] if depth else []}
    return {"params": params, "opt": self.tx.init(params), **bufs}

  # -- per-device program
  def _forward(self, params, d, seed, halos, grads_in, train, quantize):
    """Local forward; returns logits [Nl, C] and this epoch's fresh halos (stale mode)."""
    cfg, pl_ = self.cfg, self.plan
    me = jax.lax.axis_index(cfg.axis)
    h, fresh = d["x"], []
    for l in range(self.num_layers):
      if train:
        h = hash_dropout(h, _dropout_seed(seed, l), cfg.dropout, row_ids=d["gids"])
      send = jnp.where(d["send_valid"][..., None], h[d["send_idx"]], 0.0)  # [P, S, F]
      tseed = _transfer_seed(seed, l, me)
      if halos is None:
        halo = transfer(send, tseed, cfg.axis, quantize)                    # [P, S, F]
      else:
        fresh.append(_wire(jax.lax.stop_gradient(send), tseed, cfg.axis, quantize))
        halo = halos[l]
        if l > 0:
          h = inject_grad(h, grads_in[l])
      ext = jnp.concatenate([h, halo.reshape(-1, h.shape[-1])], axis=0)   # [Nl + P*S, F]
      h = gcn_layer(ext, d["esrc"], d["edst"], d["ew"], pl_.local_size, params["w"][l],
                    params["b"][l])
      if l < self.num_layers - 1:
        h = jax.nn.relu(h)
    return h, fresh

  def _device_step(self, params, d, halo_bufs, grad_bufs, seed):
    cfg, pl_ = self.cfg, self.plan
    d = {k: v[0] for k, v in d.items()}
    stale = cfg.staleness > 0
    halos = [b[0, 0].reshape(pl_.num_parts, pl_.halo_size, -1) for b in halo_bufs] if stale else None
    grads_in = [b[0, 0] for b in grad_bufs] if stale else None

    def loss_fn(p, hs):
      logits, fresh = self._forward(p, d, seed, hs, grads_in, True, cfg.quantize)
      # per-device sum over the global count: the psum below is the global mean
      return masked_node_cross_entropy(logits, d["labels"], d["mask"], denominator=self.count), fresh

    (loss, fresh), (g, g_halos) = jax.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True)(
        params, halos)
    g = jax.lax.psum(g, cfg.axis)
    loss = jax.lax.psum(loss, cfg.axis)
    if not stale:
      return loss, g, [], []
    me = jax.lax.axis_index(cfg.axis)
    new_halo, new_grad = [], []
    for l in range(self.num_layers):
      new_halo.append(_roll(halo_bufs[l], fresh[l].reshape(1, 1, -1, fresh[l].shape[-1])))
      back = jnp.zeros((pl_.local_size, self.dims[l]), jnp.float32)
      if l > 0:  # layer-0 inputs are constants: no gradient to send
        recv = _wire(g_halos[l], _transfer_seed(seed, l, me, 1), cfg.axis, cfg.quantize)
        recv = jnp.where(d["send_valid"][..., None], recv, 0.0)          # [P, S, F]
        back = back.at[d["send_idx"]].add(recv)
      new_grad.append(_roll(grad_bufs[l], back[None, None]))
    return loss, g, new_halo, new_grad

  def _step_impl(self, state, seed):
    ax = self.cfg.axis
    rep, shard = P(), P(ax)
    mesh, params, data, halo, grad = self._placed(state["params"], self.data, state["halo"],
                                                  state["grad"])
    fn = jax.shard_map(
        self._device_step, mesh=mesh,
        in_specs=(rep, {k: shard for k in self.data}, [shard] * len(state["halo"]),
                  [shard] * len(state["grad"]), rep),
        out_specs=(rep, rep, [shard] * len(state["halo"]), [shard] * len(state["grad"])),
        check_vma=False)
    loss, g, halo, grad = fn(params, data, halo, grad, place(seed, rep, mesh))
    # Gradients are psum-ed inside the shard_map program; the update runs replicated.
    params, opt = apply_optax(self.tx, g, state["opt"], params)
    return {"params": params, "opt": opt, "halo": halo, "grad": grad}, loss

  def step(self, state, epoch: int):
    return self._step(state, jnp.uint32(epoch))

  def _eval_impl(self, params):
    def dev(p, d):
      d = {k: v[0] for k, v in d.items()}
      logits, _ = self._forward(p, d, jnp.uint32(0), None, None, False, False)
      return logits[None]
    ax = self.cfg.axis
    mesh, params, data = self._placed(params, self.data)
    return jax.shard_map(dev, mesh=mesh, in_specs=(P(), {k: P(ax) for k in data}),
                         out_specs=P(ax), check_vma=False)(params, data)

  def slab_logits(self, params) -> jax.Array:
    """Per-device logits ``[P, Nl, C]`` on the mesh (exact float32 exchange, no dropout); a
    traced call inlines into the caller's program."""
    return self._eval(params)

  def logits(self, params) -> np.ndarray:
    """Global-order logits ``[N, C]`` (exact float32 exchange, no dropout)."""
    return self.plan.gather_nodes(np.asarray(self.slab_logits(params)))

  def measured_wire_bytes(self, state) -> int:
    """Bytes moved between devices by one step, read off the all_to_all operands it traces."""
    jaxpr = jax.make_jaxpr(self._step_impl)(state, jnp.uint32(0))
    per_device = all_to_all_operand_bytes(jaxpr.jaxpr)
    p = self.plan.num_parts
    return per_device * (p - 1)  # P devices x operand bytes x (P-1)/P leave the device


def _roll(buf, new):
  """Drops the oldest staleness slot and appends ``new`` ([1, depth, ...] buffers)."""
  return jnp.concatenate([buf[:, 1:], new], axis=1)


def all_to_all_operand_bytes(jaxpr) -> int:
  """Sum of operand bytes of every all_to_all in a jaxpr (recursing into sub-jaxprs)."""
  total = 0
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "all_to_all":
      total += sum(int(np.prod(v.aval.shape)) * v.aval.dtype.itemsize for v in eqn.invars)
    for val in eqn.params.values():
      for sub in (val if isinstance(val, (list, tuple)) else (val,)):
        if isinstance(sub, jex_core.ClosedJaxpr):
          total += all_to_all_operand_bytes(sub.jaxpr)
        elif isinstance(sub, jex_core.Jaxpr):
          total += all_to_all_operand_bytes(sub)
  return total
