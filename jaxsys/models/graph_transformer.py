"""Graph transformer (GT / Graphormer-slim) with TorchGT's dual-interleaved attention, and a GCN.

Encoder layer (pre-LN): ``h = h + Attn(LN(h)); h = h + FFN(LN(h))`` on node features embedded as
``h0 = W x + DegreeEmb(deg)`` (Graphormer's centrality encoding), optionally with a virtual
(global) node connected to every node (added on the host by ``add_virtual_node``).

Dual-interleaved attention (TorchGT, Wang et al. SC'24): most layers/steps use topology
attention (sparse over edges, or its ECR "reformed" equivalent), and dense global attention is
interleaved on a schedule -- every ``dense_every_layers``-th layer, and/or every layer on every
``dense_every_steps``-th training step (the step decides ``dense_step``; two executables).
``attention="dense"`` gives the dense-attention GT, ``"sparse"`` the pure topology GT.

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

from jaxsys.core.errors import ConfigError
from jaxsys.graphs.dataset import NodeDataset
from jaxsys.nn.graph import DegreeEncoding, GCNConv, GraphAttention, GraphInputs

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
  attn_residual: bool = True  # False: h = Attn(LN(h)) (GAT-like; helps tiny-label graphs like Cora)
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
    if not (0.0 <= self.dropout < 1.0 and 0.0 <= self.input_dropout < 1.0):
      raise ConfigError(f"dropout={self.dropout}, input_dropout={self.input_dropout} must lie in [0, 1)")
    if self.task not in TASKS:
      raise ConfigError(f"task={self.task!r} must be one of {TASKS}")
    if self.attention not in ATTENTION:
      raise ConfigError(f"attention={self.attention!r} must be one of {ATTENTION}")
    if self.topology not in TOPOLOGY:
      raise ConfigError(f"topology={self.topology!r} must be one of {TOPOLOGY}")
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


class EncoderLayer(nnx.Module):
  def __init__(self, cfg: GraphTransformerConfig, *, rngs: nnx.Rngs):
    d = cfg.hidden
    self.norm1 = nnx.LayerNorm(d, rngs=rngs)
    self.attn = GraphAttention(d, cfg.num_heads, impl=cfg.impl, rngs=rngs)
    self.norm2 = nnx.LayerNorm(d, rngs=rngs)
    self.ff1 = nnx.Linear(d, cfg.ffn_mult * d, rngs=rngs)
    self.ff2 = nnx.Linear(cfg.ffn_mult * d, d, rngs=rngs)
    self.drop = nnx.Dropout(cfg.dropout, rngs=rngs)
    self.residual = cfg.attn_residual

  def __call__(self, h, inputs: GraphInputs, mode: str, attention_fn=None):
    a = self.drop(self.attn(self.norm1(h), inputs, mode=mode, attention_fn=attention_fn))
    h = h + a if self.residual else a
    return h + self.drop(self.ff2(self.drop(jax.nn.gelu(self.ff1(self.norm2(h))))))


class GraphTransformer(nnx.Module):
  """GT encoder for node classification (``[N, out_dim]``) or graph regression (``[G, out_dim]``)."""

  def __init__(self, cfg: GraphTransformerConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    self.in_drop = nnx.Dropout(cfg.input_dropout, rngs=rngs)
    self.embed = nnx.Linear(cfg.num_features, cfg.hidden, rngs=rngs)
    self.degree = DegreeEncoding(cfg.max_degree, cfg.hidden, rngs=rngs) if cfg.degree_encoding else None
    self.layers = nnx.List([EncoderLayer(cfg, rngs=rngs) for _ in range(cfg.num_layers)])
    self.norm = nnx.LayerNorm(cfg.hidden, rngs=rngs)
    self.head = nnx.Linear(cfg.hidden, cfg.out_dim, rngs=rngs)

  def __call__(self, x, inputs: GraphInputs, *, dense_step: bool = False, attention_fn=None):
    """``dense_step`` must be a Python bool (it selects the compiled program)."""
    h = self.embed(self.in_drop(x))
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
    self.drop = nnx.Dropout(dropout, rngs=rngs)

  def __call__(self, x, inputs: GraphInputs, **_):
    h = jax.nn.relu(self.conv1(self.drop(x), inputs))
    return self.conv2(self.drop(h), inputs)


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

def train_node_classifier(model, x, inputs: GraphInputs, ds: NodeDataset, *, steps: int = 200,
                          lr: float = 5e-3, weight_decay: float = 5e-4, dense_schedule=None,
                          eval_every: int = 5) -> dict:
  """Full-batch training with AdamW; returns best val accuracy and the test accuracy there.

  ``dense_schedule(step) -> bool`` picks dense steps (dual-interleaved attention); the two
  step kinds are two compiled programs.
  """
  import optax
  import time
  labels = jnp.asarray(ds.labels)
  masks = {k: jnp.asarray(getattr(ds, f"{k}_mask")) for k in ("train", "val", "test")}
  opt = nnx.Optimizer(model, optax.adamw(lr, weight_decay=weight_decay), wrt=nnx.Param)

  @nnx.jit(static_argnames=("dense_step",))
  def train_step(model, opt, x, inputs, dense_step):
    def loss_fn(model):
      logits = model(x, inputs, dense_step=dense_step)
      ce = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
      return jnp.sum(ce * masks["train"]) / jnp.sum(masks["train"])
    loss, grads = nnx.value_and_grad(loss_fn)(model)
    opt.update(model, grads)
    return loss

  @nnx.jit
  def evaluate(model, x, inputs):
    pred = jnp.argmax(model(x, inputs, dense_step=False), -1)
    return {k: jnp.sum((pred == labels) * m) / jnp.sum(m) for k, m in masks.items()}

  best = {"val": -1.0, "test": 0.0, "step": -1}
  losses, times = [], []
  for step in range(steps):
    dense = bool(dense_schedule(step)) if dense_schedule else False
    model.train()
    t0 = time.perf_counter()
    loss = float(train_step(model, opt, x, inputs, dense))
    times.append(time.perf_counter() - t0)
    losses.append(loss)
    if (step + 1) % eval_every == 0 or step == steps - 1:
      model.eval()
      acc = {k: float(v) for k, v in evaluate(model, x, inputs).items()}
      if acc["val"] > best["val"]:
        best = {"val": acc["val"], "test": acc["test"], "step": step}
  return {"best_val": best["val"], "test_at_best_val": best["test"], "best_step": best["step"],
          "losses": losses, "step_times": times}
