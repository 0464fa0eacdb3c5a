"""GNNs for node classification (GCN, GIN, GAT), float32 or A2Q-quantized, and their trainer.

``GNN(cfg, num_nodes, rngs=...)`` stacks ``jaxsys.nn.quantized`` layers; with ``cfg.quant`` set
every layer quantizes its input features (per node or NNS) and its weights (per channel).
``train_gnn`` trains the weights with ``GNNTrainConfig.optimizer_config()`` (AdamW by default)
and the A2Q step sizes and bit widths with Adam at their own learning rates, adds A2Q's memory
penalty, and keeps the parameters of the best validation epoch. Its result
has the keys of ``graph_transformer.train_graph_transformer`` (``val_acc``, ``test_acc``,
``best_step``, ``losses``) plus ``avg_bits``, ``model`` and ``history``.

Usage::

  cfg = GNNConfig(kind="gcn", in_features=F, num_classes=C, quant=A2QConfig(target_bits=2))
  model = GNN(cfg, num_nodes=N, rngs=nnx.Rngs(0))
  data = NodeData.from_dataset(ds, cfg.kind)
  result = train_gnn(model, data, GNNTrainConfig(epochs=200), seed=0)
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxsys.core.optim import OptimizerConfig, check_nested
from jaxsys.core.errors import ConfigError, ShapeError
from jaxsys.graphs.node_loss import masked_accuracy, masked_node_cross_entropy
from jaxsys.models.graph.node_classification import run_node_training
from jaxsys.nn.quantized import (A2QConfig, FeatureQuantizer, QuantGATConv, QuantGCNConv,
                                 QuantGINConv, QuantLinear, WeightQuantizer)
from jaxsys.ops.quantized_agg import normalized_edges
from jaxsys.quant import a2q
from jaxsys.quant.random import hash_dropout
from jaxsys.train import make_train_step

__all__ = [
    "average_feature_bits", "compression_ratio", "feature_quantizers", "GNN", "GNNConfig",
    "GNNTrainConfig", "KINDS", "masked_accuracy", "NodeData", "train_gnn", "train_sylvie",
    "weight_quantizers",
]

KINDS = ("gcn", "gin", "gat")


@dataclasses.dataclass(frozen=True)
class GNNConfig:
  in_features: int
  num_classes: int
  kind: str = "gcn"
  hidden: int = 16
  num_layers: int = 2
  heads: int = 8
  dropout: float = 0.5
  quant: A2QConfig | None = None

  def __post_init__(self):
    if self.kind not in KINDS:
      raise ConfigError(f"kind={self.kind!r} must be one of {KINDS}")
    for name in ("in_features", "num_classes", "hidden", "num_layers", "heads"):
      if getattr(self, name) <= 0:
        raise ConfigError(f"{name}={getattr(self, name)} must be positive")
    if not 0.0 <= self.dropout < 1.0:
      raise ConfigError(f"dropout={self.dropout} must lie in [0, 1)")

  @property
  def aggregation(self) -> str:
    return "sum" if self.kind == "gin" else "gcn"   # gat uses the self-looped edges of "gcn"


class GNN(nnx.Module):
  """``num_layers`` graph convolutions with ReLU + dropout between them."""

  def __init__(self, cfg: GNNConfig, num_nodes: int, *, rngs: nnx.Rngs, init_bits=None):
    self.cfg = cfg
    dims = [cfg.in_features] + [cfg.hidden] * (cfg.num_layers - 1) + [cfg.num_classes]
    layers = []
    for i in range(cfg.num_layers):
      last = i == cfg.num_layers - 1
      kw = dict(num_nodes=num_nodes, quant=cfg.quant, rngs=rngs,
                init_bits=init_bits[i] if init_bits is not None else None)
      if cfg.kind == "gcn":
        layers.append(QuantGCNConv(dims[i], dims[i + 1], **kw))
      elif cfg.kind == "gin":
        layers.append(QuantGINConv(dims[i], dims[i + 1], **kw))
      else:
        heads = 1 if last else cfg.heads
        din = dims[i] if i == 0 else cfg.hidden * cfg.heads
        layers.append(QuantGATConv(din, dims[i + 1], heads=heads, concat=not last, **kw))
    self.layers = nnx.List(layers)

  def __call__(self, x, edges, *, train: bool = False, seed=0):
    """Returns ``(logits [N, classes], bits_info)``; ``seed`` (int) drives dropout in training.

    Dropout is the counter-hash dropout of ``jaxsys.quant.random`` (cheap on CPU, identical
    under graph partitioning), applied after each layer's feature quantizer.
    """
    bits_info = []
    for i, layer in enumerate(self.layers):
      drop = None
      if train and self.cfg.dropout > 0:
        layer_seed = jnp.asarray(seed, jnp.uint32) * 7919 + i
        drop = functools.partial(hash_dropout, seed=layer_seed, rate=self.cfg.dropout)
      x, info = layer(x, edges, dropout=drop)
      bits_info += info
      if i < len(self.layers) - 1:
        x = jax.nn.relu(x)
    return x, bits_info

  def calibrate(self, x, edges):
    """Sets every feature quantizer's steps from one float forward pass (A2Q init)."""
    qs = feature_quantizers(self)
    for q in qs:
      q.calibrating = True
    try:
      self(x, edges)
    finally:
      for q in qs:
        q.calibrating = False


def feature_quantizers(model) -> list[FeatureQuantizer]:
  return [m for _, m in nnx.iter_graph(model) if isinstance(m, FeatureQuantizer)]


def weight_quantizers(model) -> list[WeightQuantizer]:
  return [m for _, m in nnx.iter_graph(model) if isinstance(m, WeightQuantizer)]


def average_feature_bits(bits_info) -> float:
  """Element-weighted average of the rounded feature bitwidths of one forward pass."""
  if not bits_info:
    return 32.0
  return float(a2q.average_bits(bits_info))


def compression_ratio(model, bits_info) -> dict:
  """Float32 bits / quantized bits of node features + weights (A2Q's compression ratio).

  Quantized features count ``dim * b_i`` per node row, quantized kernels ``rows * b_c`` per
  output channel; everything else (biases, attention vectors, GIN eps) 32 bits on both sides.
  Also reports the ratio including the float32 step sizes (the per-row / per-channel scales).
  """
  fp = q = scale_bits = 0.0
  for b, dim in bits_info:
    n = float(b.size)
    fp += 32.0 * n * dim
    q += float(jnp.sum(a2q.round_bits(b))) * dim
    scale_bits += 32.0 * n
  lin_kernels = {id(m.kernel): m for _, m in nnx.iter_graph(model) if isinstance(m, QuantLinear)}
  for _, p in nnx.iter_graph(model):
    if not isinstance(p, nnx.Param) or _is_quant_param(p):
      continue
    size = float(np.prod(p[...].shape))
    fp += 32.0 * size
    lin = lin_kernels.get(id(p))
    if lin is not None and lin.wq is not None:
      q += float(jnp.sum(a2q.round_bits(lin.wq.bits[...]))) * lin.kernel[...].shape[0]
      scale_bits += 32.0 * lin.kernel[...].shape[1]
    else:
      q += 32.0 * size
  return {"ratio": fp / q, "ratio_with_scales": fp / (q + scale_bits), "float32_bits": fp,
          "quantized_bits": q}


def _is_quant_param(p) -> bool:
  from jaxsys.nn.quantized import BitsParam, StepParam
  return isinstance(p, (StepParam, BitsParam))


@dataclasses.dataclass(frozen=True)
class NodeData:
  """Device arrays of one node-classification graph, edges normalised for the model kind."""
  x: jax.Array
  edges: tuple
  labels: jax.Array
  train_mask: jax.Array
  val_mask: jax.Array
  test_mask: jax.Array

  @classmethod
  def from_dataset(cls, ds, kind: str = "gcn"):
    n = ds.num_nodes
    agg = "sum" if kind == "gin" else "gcn"
    edges = normalized_edges(ds.senders, ds.receivers, n, agg)
    return cls(jnp.asarray(ds.features), edges, jnp.asarray(ds.labels),
               jnp.asarray(ds.train_mask), jnp.asarray(ds.val_mask), jnp.asarray(ds.test_mask))


@dataclasses.dataclass(frozen=True)
class GNNTrainConfig:
  """``train_gnn``'s settings. ``optimizer`` (a ``jaxsys.core.optim.OptimizerConfig``) is the
  weights' optimizer; None: AdamW at ``lr`` with ``weight_decay``, and given, those two stay at
  their defaults."""
  epochs: int = 200
  lr: float = 0.01
  weight_decay: float = 5e-4
  # The A2Q quantizer groups' own Adam step sizes (step sizes and bit widths), not the weights'
  # optimizer: ``optimizer`` leaves them as they are.
  lr_step: float = 0.005
  lr_bits: float = 0.05
  degree_bits: tuple | None = None      # MEGA prior per feature quantizer (regulariser)
  degree_weight: float = 0.0
  optimizer: OptimizerConfig | None = None

  def __post_init__(self):
    if self.epochs <= 0:
      raise ConfigError(f"epochs={self.epochs} must be positive")
    for name in ("lr", "lr_step", "lr_bits"):
      if getattr(self, name) <= 0:
        raise ConfigError(f"{name}={getattr(self, name)} must be positive")
    check_nested(self, "lr", "weight_decay")

  def optimizer_config(self) -> OptimizerConfig:
    """The weights' optimizer: ``optimizer``, or AdamW at ``lr`` with ``weight_decay``."""
    return self.optimizer or OptimizerConfig("adamw", self.lr, weight_decay=self.weight_decay)


def _label(path, _):
  names = [str(getattr(k, "key", getattr(k, "name", k))) for k in path]
  if "bits" in names:
    return "bits"
  if "step" in names:
    return "step"
  return "weights"


def train_gnn(model: GNN, data: NodeData, cfg: GNNTrainConfig, seed: int = 0) -> dict:
  """Full-batch training; returns best-validation accuracies, bits and the selected model.

  ``val_acc``: the best validation accuracy (first epoch reaching it, ``best_step``);
  ``test_acc``/``avg_bits``/``model``: at that epoch; ``losses``: training loss per epoch;
  ``history``: ``(loss, train_acc, val_acc, test_acc, avg_bits)`` per epoch. The epochs run on
  the one node-classification loop (``jaxsys.models.graph.node_classification``), evaluated after each.
  """
  if data.x.shape[1] != model.cfg.in_features:
    raise ShapeError(f"features have {data.x.shape[1]} columns, model expects "
                     f"{model.cfg.in_features}")
  quant = model.cfg.quant
  if quant is not None:
    model.calibrate(data.x, data.edges)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  labels = jax.tree_util.tree_map_with_path(_label, params)
  tx = optax.multi_transform({
      "weights": cfg.optimizer_config().build(),
      "step": OptimizerConfig("adam", cfg.lr_step).build(), "bits": OptimizerConfig("adam", cfg.lr_bits).build()},
      labels)
  train_mask = data.train_mask

  def loss_fn(model, seed):
    logits, info = model(data.x, data.edges, train=True, seed=seed)
    loss = masked_node_cross_entropy(logits, data.labels, train_mask)
    if quant is not None and quant.target_bits is not None and info:
      loss = loss + quant.penalty * a2q.memory_penalty(info, quant.target_bits)
    if cfg.degree_bits is not None and cfg.degree_weight > 0:
      from jaxsys.quant.mega import degree_regularizer
      loss = loss + cfg.degree_weight * sum(
          degree_regularizer(b, db) for (b, _), db in zip(info, cfg.degree_bits) if db is not None)
    return loss

  step = make_train_step(loss_fn, tx, graphdef=graphdef, jit=False)  # traced inside the loop

  def update(state, seed):  # state: (params, opt_state); every epoch starts from the same rest
    params, opt_state, loss, _, _ = step(*state, rest, seed)
    return (params, opt_state), loss

  def evaluate(state):  # [train, val, test accuracy, average bits]
    logits, info = nnx.merge(graphdef, state[0], rest)(data.x, data.edges, train=False)
    accs = [masked_accuracy(logits, data.labels, m)
            for m in (data.train_mask, data.val_mask, data.test_mask)]
    return jnp.stack([*accs, a2q.average_bits(info) if info else jnp.float32(32.0)])

  # a distinct 32-bit dropout stream per (seed, epoch); wraps instead of overflowing for large seeds
  seeds = np.array([(seed * 100003 + e) % 2**32 for e in range(cfg.epochs)], np.uint32)
  run = run_node_training(update, evaluate, (params, tx.init(params)), seeds, steps=cfg.epochs,
                          num_metrics=4, select=1, keep=lambda state: state[0], desc="gnn")
  history = [(float(loss), *map(float, m)) for loss, m in zip(run.losses, run.metrics)]
  best = history[run.best]
  return {"val_acc": best[2], "test_acc": best[3], "best_step": run.best,
          "losses": [h[0] for h in history], "avg_bits": best[4],
          "model": nnx.merge(graphdef, run.kept, rest), "history": history}


def train_sylvie(trainer, params, ds, *, epochs: int, eval_every: int = 1, seeds=None) -> dict:
  """Sylvie's distributed full-graph GCN training on the one node-classification loop.

  ``trainer``: a ``jaxsys.parallel.graph_comm.SylvieTrainer``; ``params``: its GCN parameters
  (``init_gcn_params``); ``ds``: a ``NodeDataset`` (features, labels, train/val/test masks).
  ``seeds``: the per-epoch step seeds (dropout and 1-bit stochastic rounding), int[epochs];
  default: the epoch number, as ``trainer.step(state, epoch)``. Evaluation (exact float32
  exchange, no dropout) follows every ``eval_every``-th epoch and the last.

  Returns ``state`` (the trainer state after the last epoch), ``val_acc`` / ``test_acc`` at the
  first best validation accuracy, ``best_step``, ``losses`` (per epoch) and ``curve``:
  ``(epoch, loss, val_acc, test_acc)`` at each evaluation (``epoch`` counts from 1).
  """
  seeds = np.arange(epochs) if seeds is None else np.asarray(seeds)
  if seeds.shape != (epochs,):
    raise ShapeError(f"seeds must be int[epochs={epochs}], got shape {seeds.shape}")
  state = trainer.init(params, ds.features, ds.labels, ds.train_mask)
  labels = trainer.put_nodes(np.asarray(ds.labels, np.int32))           # int32 [P, Nl]
  masks = [trainer.put_nodes(np.asarray(m, bool), False) for m in (ds.val_mask, ds.test_mask)]
  counts = [int(np.sum(m)) for m in (ds.val_mask, ds.test_mask)]

  def update(state, seed):
    return trainer.step(state, seed)

  def evaluate(state):  # [val, test] hit counts (exact in float32); divided on the host
    pred = jnp.argmax(trainer.slab_logits(state["params"]), -1)      # [P, Nl]
    return jnp.stack([jnp.sum((pred == labels) & m) for m in masks]).astype(jnp.float32)

  run = run_node_training(update, evaluate, state, seeds.astype(np.uint32), steps=epochs,
                          num_metrics=2, eval_every=eval_every, select=0, desc="sylvie")
  val, test = (run.metrics[:, i].astype(np.float64) / max(c, 1) for i, c in enumerate(counts))
  curve = [(i + 1, float(run.losses[i]), float(val[i]), float(test[i])) for i in np.flatnonzero(run.evals)]
  return {"state": run.state, "val_acc": float(val[run.best]), "test_acc": float(test[run.best]),
          "best_step": run.best, "losses": run.losses.tolist(), "curve": curve}
