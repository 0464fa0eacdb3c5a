"""Graph transformer (GT / Graphormer-slim) with TorchGT's dual-interleaved attention, and a GCN.

Encoder layer (pre-LN): ``h = h + Attn(LN(h)); h = h + FFN(LN(h))`` on node features embedded as
``h0 = W x + DegreeEmb(deg)`` (Graphormer's centrality encoding), optionally with a virtual
(global) node connected to every node (added on the host by ``add_virtual_node``).

Dual-interleaved attention (TorchGT, Wang et al. SC'24): most layers/steps use topology
attention (sparse over edges, or its ECR "reformed" equivalent), and dense global attention is
interleaved on a schedule -- every ``dense_every_layers``-th layer, and/or every layer on every
``dense_every_steps``-th training step (the step decides ``dense_step``; two executables).
``attention="dense"`` gives the dense-attention GT, ``"sparse"`` the pure topology GT.

Regularisation / encodings (all off by default; every dropout is ``jaxsys.nn.HashDropout``, whose
counter-hash mask costs a few integer ops per element where XLA:CPU's threefry Bernoulli over
Cora's input features cost more than the rest of a GCN step):

* ``attn_dropout``: dropout on the topology-attention coefficients (GAT's recipe; training only,
  ``topology="sparse"`` only -- the tiled paths never materialise per-edge coefficients).
* ``ffn=False``: drop the FFN sub-layer and apply ELU after attention (a GAT-shaped layer).
* ``dense_gate``: (``embed=True``) a dense-attention layer computes ``h + tanh(g) * Attn(LN(h))`` with a learned
  per-layer ``g`` starting at 0, so interleaved dense steps start as (and can stay) a mild
  perturbation of the topology model instead of a different network: without it, dense steps
  drove the GAT-shaped dual GT on Cora to ~24% test accuracy.
* ``embed=False``: a true GAT stack (``_GATLayer``) -- no embedding, LayerNorm, FFN or head; the
  first layer projects raw features to ``num_heads x hidden/num_heads`` (concatenated, ELU), the
  last to ``out_heads`` heads of ``out_dim`` (averaged) = logits; dropout on every layer's input.
  Its gated dense steps add ``tanh(g) *`` global attention to the topology attention (shared
  q/k/v), so with ``g = 0`` a dense step equals a topology step. On Cora (Planetoid) this stack
  reached higher validation accuracy than the embedding + LayerNorm variant of the same layers.
* ``lap_pe=k``: the last ``k`` columns of ``x`` are Laplacian eigenvector positional encodings
  (``laplacian_pe``); each eigenvector's sign is flipped at random in training (eigenvectors are
  only defined up to sign). Dense attention cannot see the graph without such an encoding.

Tasks: node classification (logits per node) and graph regression (mean readout per graph).

Usage::

  cfg = GraphTransformerConfig(num_features=F, out_dim=C, attention="dual", dense_every_steps=4)
  model = GraphTransformer(cfg, rngs=nnx.Rngs(0))
  logits = model(x, inputs, dense_step=False)
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxsys.core.optim import OptimizerConfig, check_nested
from jaxsys.core.errors import ConfigError
from jaxsys.graphs.dataset import NodeDataset
from jaxsys.graphs.node_loss import masked_accuracy, masked_node_cross_entropy
from jaxsys.models.graph.node_classification import run_node_training
from jaxsys.nn.dropout import HashDropout
from jaxsys.nn.graph import DegreeEncoding, GCNConv, GraphAttention, GraphInputs, attend
from jaxsys.ops.graph_attn import segment_softmax
from jaxsys.core import init

__all__ = [
    "add_virtual_node", "ATTENTION", "EncoderLayer", "GCN", "GraphTransformer", "GraphTransformerConfig",
    "laplacian_pe", "TASKS", "TOPOLOGY", "train_graph_transformer",
]

ATTENTION = ("sparse", "dense", "dual")
TOPOLOGY = ("sparse", "reformed", "block")
TASKS = ("node", "graph")


@dataclasses.dataclass(frozen=True)
class GraphTransformerConfig:
  num_features: int
  out_dim: int  # classes (node task) or regression targets (graph task)
  hidden: int = 64
  num_heads: int = 4
  num_layers: int = 2
  ffn_mult: int = 2
  dropout: float = 0.5
  input_dropout: float = 0.6
  max_degree: int = 64
  degree_encoding: bool = True
  attn_dropout: float = 0.0  # dropout on topology attention coefficients (sparse topology)
  ffn: bool = True  # False: attention + ELU only (GAT-shaped layer)
  dense_gate: bool = False  # dense layers add tanh(g) * Attn to their input, g learned from 0
  lap_pe: int = 0  # last lap_pe columns of x are Laplacian eigenvectors (laplacian_pe)
  attn_residual: bool = True  # False: h = Attn(LN(h)) (GAT-like; helps tiny-label graphs like Cora)
  embed: bool = True  # False: true GAT stack, no embedding / LayerNorm / head (see _GATLayer)
  out_heads: int = 1  # embed=False: heads of the output layer, averaged (GAT)
  task: str = "node"
  attention: str = "dual"  # "sparse" | "dense" | "dual"
  topology: str = "sparse"  # how topology attention runs: "sparse" | "reformed" | "block"
  dense_every_layers: int = 0  # dual: layer l is dense when (l + 1) % k == 0 (0: never)
  dense_every_steps: int = 4  # dual: all layers dense on steps with step % k == 0 (0: never)
  impl: str = "auto"

  def __post_init__(self):
    for f in ("num_features", "out_dim", "hidden", "num_heads", "num_layers", "ffn_mult"):
      if getattr(self, f) < 1:
        raise ConfigError(f"{f}={getattr(self, f)} must be >= 1")
    if self.hidden % self.num_heads:
      raise ConfigError(f"hidden={self.hidden} must be divisible by num_heads={self.num_heads}")
    if not all(0.0 <= r < 1.0 for r in (self.dropout, self.input_dropout, self.attn_dropout)):
      raise ConfigError(f"dropout={self.dropout}, input_dropout={self.input_dropout}, "
                        f"attn_dropout={self.attn_dropout} must lie in [0, 1)")
    if not 0 <= self.lap_pe < self.num_features:
      raise ConfigError(f"lap_pe={self.lap_pe} must lie in [0, num_features={self.num_features})")
    if self.task not in TASKS:
      raise ConfigError(f"task={self.task!r} must be one of {TASKS}")
    if self.attention not in ATTENTION:
      raise ConfigError(f"attention={self.attention!r} must be one of {ATTENTION}")
    if self.topology not in TOPOLOGY:
      raise ConfigError(f"topology={self.topology!r} must be one of {TOPOLOGY}")
    if not self.embed and (self.lap_pe or self.degree_encoding or self.ffn or self.task != "node"
                           or self.num_layers < 2 or self.out_heads < 1):
      raise ConfigError("embed=False (GAT stack) needs lap_pe=0, degree_encoding=False, "
                        "ffn=False, task='node', num_layers >= 2 and out_heads >= 1")
    if self.dense_every_layers < 0 or self.dense_every_steps < 0:
      raise ConfigError(f"dense_every_layers={self.dense_every_layers} and "
                        f"dense_every_steps={self.dense_every_steps} must be >= 0")

  def layer_modes(self, dense_step: bool = False) -> tuple[str, ...]:
    """Attention mode of each layer on a step (``dense_step``: a scheduled dense step)."""
    if self.attention == "dense":
      return ("dense",) * self.num_layers
    if self.attention == "sparse":
      return (self.topology,) * self.num_layers
    k = self.dense_every_layers
    return tuple("dense" if dense_step or (k and (l + 1) % k == 0) else self.topology
                 for l in range(self.num_layers))

  def is_dense_step(self, step: int) -> bool:
    return self.attention == "dual" and self.dense_every_steps > 0 and step % self.dense_every_steps == 0


def _sparse_attention_dropout(q, k, v, inputs: GraphInputs, drop: HashDropout):
  """Topology attention with dropout on the per-edge softmax coefficients (GAT)."""
  n, scale = q.shape[0], 1.0 / np.sqrt(q.shape[-1])
  s, r = inputs.senders, inputs.receivers
  p = segment_softmax(jnp.sum(q[r] * k[s], -1) * scale, r, n, indices_are_sorted=True)
  return jax.ops.segment_sum(drop(p)[..., None] * v[s], r, n, indices_are_sorted=True)


class EncoderLayer(nnx.Module):
  def __init__(self, cfg: GraphTransformerConfig, *, rngs: nnx.Rngs):
    d = cfg.hidden
    self.norm1 = nnx.LayerNorm(d, rngs=rngs, **init.norm_defaults())
    self.attn = GraphAttention(d, cfg.num_heads, impl=cfg.impl, rngs=rngs)
    self.attn_drop = HashDropout(cfg.attn_dropout, rngs=rngs) if cfg.attn_dropout else None
    if cfg.ffn:
      self.norm2 = nnx.LayerNorm(d, rngs=rngs, **init.norm_defaults())
      self.ff1 = nnx.Linear(d, cfg.ffn_mult * d, rngs=rngs, **init.dense_defaults())
      self.ff2 = nnx.Linear(cfg.ffn_mult * d, d, rngs=rngs, **init.dense_defaults())
    self.drop = HashDropout(cfg.dropout, rngs=rngs)
    self.residual = cfg.attn_residual
    self.ffn = cfg.ffn
    self.gate = nnx.Param(jnp.zeros(())) if cfg.dense_gate else None

  def __call__(self, h, inputs: GraphInputs, mode: str, attention_fn=None):
    drop = self.attn_drop
    if attention_fn is None and mode == "sparse" and drop is not None and not drop.deterministic:
      # In eval the coefficients are untouched, so the fused op (custom VJP) is used instead.
      attention_fn = lambda q, k, v, _: _sparse_attention_dropout(q, k, v, inputs, drop)  # noqa: E731
    a = self.drop(self.attn(self.norm1(h), inputs, mode=mode, attention_fn=attention_fn))
    if mode == "dense" and self.gate is not None:
      h = h + jnp.tanh(self.gate[...]) * a
    else:
      h = h + a if self.residual else a
    if not self.ffn:
      return jax.nn.elu(h)
    return h + self.drop(self.ff2(self.drop(jax.nn.gelu(self.ff1(self.norm2(h))))))


class _GATLayer(nnx.Module):
  """GAT-style layer (``embed=False``): ``z = W h`` (``in_dim -> heads x head_dim``), values
  ``v = z``, heads concatenated (+ ELU) or, as the output layer, averaged; no out projection,
  LayerNorm or residual. Scores are scaled dot products of ``q, k = Linear(z)`` (not GAT's
  additive score) so that the same projections serve dense steps; only ``W`` touches the raw
  features, so a step costs about one GAT step. A dense step with ``dense_gate`` computes
  ``topo + tanh(g) * dense`` from shared q/k/v: with ``g = 0`` it is exactly a topology step.
  """

  def __init__(self, in_dim: int, heads: int, head_dim: int, cfg: GraphTransformerConfig, *,
               last: bool, rngs: nnx.Rngs):
    self.heads, self.head_dim, self.last, self.impl = heads, head_dim, last, cfg.impl
    self.proj = nnx.Linear(in_dim, heads * head_dim, rngs=rngs, **init.dense_defaults())  # GAT's W; values are W h
    self.qk = nnx.Linear(heads * head_dim, 2 * heads * head_dim, rngs=rngs, **init.dense_defaults())  # small: inner -> q, k
    self.attn_drop = HashDropout(cfg.attn_dropout, rngs=rngs) if cfg.attn_dropout else None
    self.gate = nnx.Param(jnp.zeros(())) if cfg.dense_gate else None

  def _attend(self, q, k, v, inputs: GraphInputs, mode: str):
    drop = self.attn_drop
    if mode == "sparse" and drop is not None and not drop.deterministic:
      return _sparse_attention_dropout(q, k, v, inputs, drop)
    return attend(q, k, v, inputs, mode, impl=self.impl)

  def __call__(self, h, inputs: GraphInputs, mode: str, topology: str, attention_fn=None):
    n = h.shape[0]
    z = self.proj(h)
    qk = self.qk(z).reshape(n, 2, self.heads, self.head_dim)
    q, k, v = qk[:, 0], qk[:, 1], z.reshape(n, self.heads, self.head_dim)
    run = attention_fn or (lambda q, k, v, m: self._attend(q, k, v, inputs, m))
    if mode == "dense" and self.gate is not None:
      o = run(q, k, v, topology) + jnp.tanh(self.gate[...]) * run(q, k, v, "dense")
    else:
      o = run(q, k, v, mode)
    return jnp.mean(o, 1) if self.last else jax.nn.elu(o.reshape(n, -1))


class GraphTransformer(nnx.Module):
  """GT encoder for node classification (``[N, out_dim]``) or graph regression (``[G, out_dim]``)."""

  def __init__(self, cfg: GraphTransformerConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    self.in_drop = HashDropout(cfg.input_dropout, rngs=rngs)
    if not cfg.embed:  # GAT: dropout(input) -> layer -> ... -> dropout -> output layer
      hd, dims = cfg.hidden // cfg.num_heads, [cfg.num_features] + [cfg.hidden] * (cfg.num_layers - 1)
      self.layers = nnx.List([
          _GATLayer(d, cfg.num_heads, hd, cfg, last=False, rngs=rngs) for d in dims[:-1]]
          + [_GATLayer(dims[-1], cfg.out_heads, cfg.out_dim, cfg, last=True, rngs=rngs)])
      self.drop = HashDropout(cfg.dropout, rngs=rngs)
      return
    self.embed = nnx.Linear(cfg.num_features - cfg.lap_pe, cfg.hidden, rngs=rngs, **init.dense_defaults())
    if cfg.lap_pe:
      self.pe = nnx.Linear(cfg.lap_pe, cfg.hidden, rngs=rngs, **init.dense_defaults())
      self.pe_rngs = rngs.fork()
    self.degree = DegreeEncoding(cfg.max_degree, cfg.hidden, rngs=rngs) if cfg.degree_encoding else None
    self.layers = nnx.List([EncoderLayer(cfg, rngs=rngs) for _ in range(cfg.num_layers)])
    self.norm = nnx.LayerNorm(cfg.hidden, rngs=rngs, **init.norm_defaults())
    self.head = nnx.Linear(cfg.hidden, cfg.out_dim, rngs=rngs, **init.dense_defaults())

  def __call__(self, x, inputs: GraphInputs, *, dense_step: bool = False, attention_fn=None):
    """``dense_step`` must be a Python bool (it selects the compiled program)."""
    if not self.cfg.embed:
      h = self.in_drop(x)
      for i, (layer, mode) in enumerate(zip(self.layers, self.cfg.layer_modes(dense_step))):
        h = layer(self.drop(h) if i else h, inputs, mode, self.cfg.topology, attention_fn)
      return h
    k = self.cfg.lap_pe
    if k:
      x, pe = x[:, :-k], x[:, -k:]
      if not self.in_drop.deterministic:  # train on random signs: the model must not rely on one
        pe = pe * jax.random.rademacher(self.pe_rngs(), (1, k), pe.dtype)
    h = self.embed(self.in_drop(x))
    if k:
      h = h + self.pe(pe)
    if self.degree is not None:
      h = h + self.degree(inputs.degree)
    for layer, mode in zip(self.layers, self.cfg.layer_modes(dense_step)):
      h = layer(h, inputs, mode, attention_fn)
    h = self.norm(h)
    if self.cfg.task == "graph":  # mean readout over the real nodes of each graph
      num_graphs = inputs.n_node.shape[0]
      w = inputs.node_mask.astype(h.dtype)[:, None]
      tot = jax.ops.segment_sum(h * w, inputs.graph_ids, num_graphs, indices_are_sorted=True)
      cnt = jax.ops.segment_sum(w, inputs.graph_ids, num_graphs, indices_are_sorted=True)
      h = tot / jnp.maximum(cnt, 1.0)
    return self.head(h)


class GCN(nnx.Module):
  """Two-layer GCN baseline (Kipf & Welling 2017): dropout -> GCNConv -> ReLU -> dropout -> GCNConv."""

  def __init__(self, num_features: int, hidden: int, out_dim: int, *, dropout: float = 0.5,
               rngs: nnx.Rngs):
    self.conv1 = GCNConv(num_features, hidden, rngs=rngs)
    self.conv2 = GCNConv(hidden, out_dim, rngs=rngs)
    self.drop = HashDropout(dropout, rngs=rngs)

  def __call__(self, x, inputs: GraphInputs, **_):
    h = jax.nn.relu(self.conv1(self.drop(x), inputs))
    return self.conv2(self.drop(h), inputs)


def laplacian_pe(senders, receivers, num_nodes: int, k: int, *, seed: int = 0) -> np.ndarray:
  """``[N, k]`` eigenvectors of the k smallest non-zero eigenvalues of ``I - D^-1/2 A D^-1/2``.

  Eigenvalue 0 has one eigenvector per connected component (78 on Cora); those only say which
  component a node is in, so they are skipped. Isolated nodes get zero rows. Signs are
  arbitrary (the model randomises them in training).
  """
  import scipy.sparse as sp
  from scipy.sparse.csgraph import connected_components
  from scipy.sparse.linalg import eigsh
  a = sp.coo_matrix((np.ones(len(senders)), (receivers, senders)), shape=(num_nodes,) * 2).tocsr()
  a = ((a + a.T) > 0).astype(np.float64)
  a.setdiag(0)
  deg = np.asarray(a.sum(1)).ravel()
  inv = np.where(deg > 0, 1.0 / np.sqrt(np.maximum(deg, 1.0)), 0.0)
  lap = sp.eye(num_nodes) - sp.diags(inv) @ a @ sp.diags(inv)
  v0 = np.random.default_rng(seed).standard_normal(num_nodes)  # eigsh's default start is random
  # Shift-invert around a slightly negative sigma: fast, exact for the bottom of the spectrum.
  # Isolated nodes are components too but have eigenvalue 1 here (their diagonal stays 1).
  c = connected_components(a, directed=False)[0] - int(np.sum(deg == 0))
  val, vec = eigsh(lap.tocsc(), k=min(k + c, num_nodes - 1), sigma=-1e-3, which="LM", v0=v0)
  vec = vec[:, np.argsort(val)][:, c:c + k]
  out = np.zeros((num_nodes, k), np.float32)
  out[:, :vec.shape[1]] = vec * (deg > 0)[:, None]
  return out


def add_virtual_node(ds: NodeDataset) -> NodeDataset:
  """Appends one virtual node (zero features, label 0, in no split) linked to every node."""
  from jaxsys.graphs.dataset import make_node_dataset
  n = ds.num_nodes
  ids = np.arange(n, dtype=np.int32)
  s = np.concatenate([ds.senders, ids, np.full(n, n, np.int32)])
  r = np.concatenate([ds.receivers, np.full(n, n, np.int32), ids])
  x = np.concatenate([ds.features, np.zeros((1, ds.num_features), np.float32)])

  def ext(a, fill):
    return np.append(a, fill)

  return make_node_dataset(x, s, r, ext(ds.labels, 0), train_mask=ext(ds.train_mask, False),
                           val_mask=ext(ds.val_mask, False), test_mask=ext(ds.test_mask, False),
                           num_classes=ds.num_classes, name=ds.name, symmetrize=False)


# ----------------------------------------------------------------------------- training

def train_graph_transformer(model, x, inputs: GraphInputs, ds: NodeDataset, *, steps: int = 200,
                            lr: float = 5e-3, weight_decay: float = 5e-4, l2: float = 0.0,
                            optimizer: OptimizerConfig | None = None, dense_schedule=None,
                            eval_every: int = 5, progress: bool = True) -> dict:
  """Full-batch training with AdamW of a ``GraphTransformer`` (or the ``GCN`` baseline).

  Returns the keys of ``gnn.train_gnn``: ``val_acc`` (best validation accuracy over the
  evaluations), ``test_acc`` (test accuracy at it), ``best_step`` (the first step reaching it),
  ``losses`` (per step); plus ``step_ms`` and the evaluated ``val_curve``/``test_curve``.

  ``l2`` adds ``l2 * w`` to every gradient (coupled L2 as in the GCN/GAT reference code; AdamW's
  decoupled ``weight_decay`` is scaled by ``lr`` and is far weaker at the same value).
  ``optimizer`` (a ``jaxsys.core.optim.OptimizerConfig``) replaces the AdamW those three describe;
  given, ``lr``, ``weight_decay`` and ``l2`` stay at their defaults (ConfigError otherwise).
  ``dense_schedule(step) -> bool`` picks dense steps (dual-interleaved attention). The run is
  the one node-classification loop (``jaxsys.models.graph.node_classification``): every step and
  every ``eval_every``-th evaluation in one compiled ``lax.scan``. ``step_ms`` is the run's mean
  wall time per step (evaluations included, compilation excluded). ``progress``: a tqdm bar (on
  stderr) that the compiled run advances at every evaluation, with the loss and val accuracy.
  """

  from jaxsys.train import make_train_step
  check_nested(dict(optimizer=optimizer, lr=lr, weight_decay=weight_decay, l2=l2), "lr", "weight_decay", "l2",
               defaults=train_graph_transformer)
  labels = jnp.asarray(ds.labels)
  masks = {k: jnp.asarray(getattr(ds, f"{k}_mask")) for k in ("train", "val", "test")}
  tx = (optimizer or OptimizerConfig("adamw", lr, weight_decay=weight_decay, l2=l2)).build()
  model.train()
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  dense = np.array([bool(dense_schedule(i)) if dense_schedule else False for i in range(steps)])

  def loss_fn(model, dense_step):  # dense_step: a Python bool (one program per value)
    logits = model(x, inputs, dense_step=dense_step)
    return masked_node_cross_entropy(logits, labels, masks["train"])

  step = make_train_step(loss_fn, tx, graphdef=graphdef, jit=False)  # traced inside the loop

  def train_step(state, dense_step):
    params, opt_state, loss, _, rest = step(*state, dense_step)
    return (params, opt_state, rest), loss

  def update(state, dense_step):  # state: (params, opt_state, rest); rest: dropout RNG counters
    if dense.any() and not dense.all():  # both programs compiled once, picked per step
      return jax.lax.cond(dense_step, lambda s: train_step(s, True), lambda s: train_step(s, False), state)
    return train_step(state, bool(dense.any()))

  def evaluate(state):  # [val, test accuracy]
    params, _, rest = state
    model = nnx.merge(graphdef, params, rest)
    model.eval()
    logits = model(x, inputs, dense_step=False)
    return jnp.stack([masked_accuracy(logits, labels, masks[k]) for k in ("val", "test")])

  run = run_node_training(update, evaluate, (params, tx.init(params), rest), dense, steps=steps,
                          num_metrics=2, eval_every=eval_every, select=0, progress=progress,
                          desc="graph transformer")
  nnx.update(model, run.state[0], run.state[2])
  acc, best = run.metrics, run.best  # best: the first step with the best val accuracy
  return {"val_acc": float(acc[best, 0]), "test_acc": float(acc[best, 1]),
          "best_step": best, "losses": run.losses.tolist(), "step_ms": run.step_ms,
          "val_curve": acc[run.evals, 0].tolist(), "test_curve": acc[run.evals, 1].tolist()}
