"""Generic jitted optax training loop for NNX models, with orbax checkpoint/resume.

* :func:`causal_lm_loss`: next-token cross-entropy with an optional loss mask (answer tokens
  only, padding excluded), returned as (sum, count) so gradient accumulation is exact.
* :func:`make_optimizer`: AdamW with linear warm-up + cosine decay and global-norm clipping.
* :func:`train`: runs ``cfg.total_steps`` steps of ``train_step``; the batch for step ``s`` is
  ``batches(s)`` (a pure function of the step, so a resumed run sees the same data). With
  ``cfg.accum_steps = A`` each batch is split into A micro-batches whose gradients are summed in
  a ``lax.scan`` before one update. With ``workdir`` it checkpoints params + optimizer state
  every ``cfg.checkpoint_every`` steps and resumes from the latest checkpoint: the loss curve
  after a resume equals the uninterrupted one. Metrics go to a tqdm bar and
  ``workdir/metrics.jsonl``. With ``mesh``, parameters are placed by their logical axes and
  batches split on the "batch" rule.

Usage::

  result = train(model, lambda s: synthetic.training_batch(mix, seed=0, step=s, batch_size=32,
                 length=128), TrainConfig(total_steps=1000), workdir="runs/tiny")
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxsys.core.errors import ConfigError, ShapeError
from jaxsys.core.mesh import logical_sharding


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  learning_rate: float = 1e-3
  warmup_steps: int = 100
  total_steps: int = 1000
  min_lr_ratio: float = 0.1
  weight_decay: float = 0.01
  b1: float = 0.9
  b2: float = 0.98
  grad_clip: float | None = 1.0
  accum_steps: int = 1
  log_every: int = 10
  checkpoint_every: int | None = None
  max_to_keep: int = 2

  def __post_init__(self):
    for name in ("total_steps", "accum_steps", "log_every"):
      if getattr(self, name) < 1:
        raise ConfigError(f"{name}={getattr(self, name)} must be >= 1")
    if self.warmup_steps < 0 or not self.learning_rate > 0:
      raise ConfigError(f"learning_rate={self.learning_rate} must be > 0 and "
                        f"warmup_steps={self.warmup_steps} >= 0")
    if self.checkpoint_every is not None and self.checkpoint_every < 1:
      raise ConfigError(f"checkpoint_every={self.checkpoint_every} must be >= 1 or None")


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
  warm = min(cfg.warmup_steps, max(cfg.total_steps - 1, 0))
  schedule = optax.warmup_cosine_decay_schedule(
      0.0, cfg.learning_rate, max(warm, 1), max(cfg.total_steps, warm + 2),
      end_value=cfg.learning_rate * cfg.min_lr_ratio)
  parts = [optax.clip_by_global_norm(cfg.grad_clip)] if cfg.grad_clip else []
  parts.append(optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay))
  return optax.chain(*parts)


def causal_lm_loss(model, batch: dict[str, Any]):
  """Sum of next-token cross-entropy over masked targets, the target count, and metrics.

  ``batch``: ``tokens int[b, t]``; optional ``loss_mask [b, t]`` (1 where token t is a target),
  ``positions``, ``segment_ids`` (packed sequences: a target in another segment is dropped).
  """
  tokens = batch["tokens"]
  if tokens.ndim != 2:
    raise ShapeError(f"tokens must be int[batch, seq], got shape {tokens.shape}")
  kw = {}
  if batch.get("positions") is not None:
    kw["positions"] = batch["positions"][:, :-1]
  if batch.get("segment_ids") is not None:
    kw["segment_ids"] = batch["segment_ids"][:, :-1]
  logits = model(tokens[:, :-1], **kw)  # [batch, seq-1, vocab]
  targets = tokens[:, 1:]
  mask = batch.get("loss_mask")
  mask = jnp.ones(targets.shape, jnp.float32) if mask is None else mask[:, 1:].astype(jnp.float32)
  if batch.get("segment_ids") is not None:
    seg = batch["segment_ids"]
    mask = mask * (seg[:, 1:] == seg[:, :-1])
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
  correct = (jnp.argmax(logits, -1) == targets).astype(jnp.float32)
  count = jnp.sum(mask)
  return jnp.sum(ce * mask), count, {"correct": jnp.sum(correct * mask)}


@dataclasses.dataclass
class TrainResult:
  model: Any
  step: int
  history: list[dict[str, float]]


def _split_micro(batch, accum):
  def one(x):
    if x.shape[0] % accum:
      raise ShapeError(f"batch size {x.shape[0]} must be divisible by accum_steps={accum}")
    return x.reshape(accum, x.shape[0] // accum, *x.shape[1:])
  return jax.tree.map(one, batch)


def make_train_step(graphdef, template, tx, loss_fn, accum: int):
  """``(params, opt_state, rest, batch) -> (params, opt_state, metrics)``, jitted with donation;
  ``rest`` is the model's non-parameter state (passed through unchanged)."""

  def micro_loss(params, rest, mb):
    model = nnx.merge(graphdef, _to_state(template, params), rest)
    total, count, metrics = loss_fn(model, mb)
    return total, (count, metrics)

  grad_fn = jax.value_and_grad(micro_loss, has_aux=True)

  def step(params, opt_state, rest, batch):
    micro = _split_micro(batch, accum)

    def body(carry, mb):
      gsum, lsum, csum, msum = carry
      (total, (count, metrics)), g = grad_fn(params, rest, mb)
      gsum = jax.tree.map(jnp.add, gsum, g)
      msum = jax.tree.map(jnp.add, msum, metrics)
      return (gsum, lsum + total, csum + count, msum), None

    zeros = jax.tree.map(jnp.zeros_like, params)
    first = jax.tree.map(lambda x: x[0], micro)
    m0 = jax.tree.map(jnp.zeros_like, jax.eval_shape(lambda: micro_loss(params, rest, first)[1][1]))
    (gsum, lsum, csum, msum), _ = jax.lax.scan(body, (zeros, 0.0, 0.0, m0), micro)
    denom = jnp.maximum(csum, 1.0)
    grads = jax.tree.map(lambda g: g / denom, gsum)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    metrics = {"loss": lsum / denom, "tokens": csum, "grad_norm": optax.global_norm(grads)}
    metrics.update({k: v / denom for k, v in msum.items()})
    return params, opt_state, metrics

  return jax.jit(step, donate_argnums=(0, 1))


_STEP_CACHE: dict = {}


def _cached_step(graphdef, template, cfg: TrainConfig, loss_fn):
  """Reuses the jitted step across ``train`` calls on models of the same graph and config (a
  resumed run does not recompile)."""
  key = (graphdef, cfg, loss_fn)
  if key not in _STEP_CACHE:
    if len(_STEP_CACHE) > 16:
      _STEP_CACHE.clear()
    _STEP_CACHE[key] = make_train_step(graphdef, template, make_optimizer(cfg), loss_fn,
                                       cfg.accum_steps)
  return _STEP_CACHE[key]


def _to_state(template, pure):
  """A fresh ``nnx.State`` shaped like ``template`` holding the arrays of the pure dict."""
  state = jax.tree.map(lambda x: x, template)
  nnx.replace_by_pure_dict(state, pure)
  return state


def _place_batch(batch, mesh):
  if mesh is None:
    return jax.tree.map(jnp.asarray, batch)
  return jax.tree.map(
      lambda x: jax.device_put(x, logical_sharding(("batch",) + (None,) * (x.ndim - 1), mesh)),
      batch)


def train(model, batches: Callable[[int], dict], cfg: TrainConfig, *, workdir=None,
          loss_fn=causal_lm_loss, mesh=None, progress: bool = True, stop_at: int | None = None,
          callback: Callable[[int, dict], None] | None = None) -> TrainResult:
  """Trains ``model`` in place (its parameters are updated) and returns the history.

  ``stop_at`` ends the run early at that step (the schedule still spans ``total_steps``),
  e.g. to simulate an interruption. ``callback(step, metrics)`` runs on logged steps.
  """
  from jaxsys.core.checkpoint import Checkpointer
  from jaxsys.nn.layers import param_specs
  graphdef, params_state, rest = nnx.split(model, nnx.Param, ...)
  if mesh is not None:
    specs = nnx.to_pure_dict(param_specs(model, mesh))
    params = jax.tree.map(lambda x, s: jax.device_put(x, jax.sharding.NamedSharding(mesh, s)),
                          nnx.to_pure_dict(params_state), specs)
  else:
    params = jax.tree.map(jnp.copy, nnx.to_pure_dict(params_state))  # donated below
  tx = make_optimizer(cfg)
  opt_state = tx.init(params)
  start = 0
  ckpt = None
  log_path = None
  if workdir is not None:
    workdir = Path(workdir)
    ckpt = Checkpointer(workdir / "checkpoints", max_to_keep=cfg.max_to_keep)
    log_path = workdir / "metrics.jsonl"
    if ckpt.latest_step() is not None:
      restored = ckpt.restore(like={"params": params, "opt_state": opt_state, "step": 0})
      params, opt_state, start = restored["params"], restored["opt_state"], int(restored["step"])
  template = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params_state)
  step_fn = _cached_step(graphdef, template, cfg, loss_fn)
  end = cfg.total_steps if stop_at is None else min(stop_at, cfg.total_steps)
  history: list[dict[str, float]] = []
  bar = None
  if progress:
    from tqdm.auto import tqdm
    bar = tqdm(total=end, initial=start, desc="train", dynamic_ncols=True)
  t0 = time.perf_counter()
  ctx = jax.set_mesh(mesh) if mesh is not None else _null()
  with ctx:
    for step in range(start, end):
      batch = _place_batch(batches(step), mesh)
      params, opt_state, metrics = step_fn(params, opt_state, rest, batch)
      done = step + 1
      if done % cfg.log_every == 0 or done == end:
        row = {"step": done, **{k: float(v) for k, v in jax.device_get(metrics).items()},
               "seconds": time.perf_counter() - t0}
        history.append(row)
        if log_path is not None:
          with open(log_path, "a") as f:
            f.write(json.dumps(row) + "\n")
        if bar is not None:
          bar.set_postfix(loss=f"{row['loss']:.4f}", acc=f"{row.get('correct', np.nan):.3f}")
        if callback is not None:
          callback(done, row)
      if bar is not None:
        bar.update(1)
      if ckpt is not None and cfg.checkpoint_every and (done % cfg.checkpoint_every == 0 or done == end):
        ckpt.save(done, {"params": params, "opt_state": opt_state, "step": done})
  if bar is not None:
    bar.close()
  if ckpt is not None:
    ckpt.close()
  nnx.update(model, _to_state(template, params))
  return TrainResult(model, end, history)


class _null:
  def __enter__(self):
    return self

  def __exit__(self, *exc):
    return False
