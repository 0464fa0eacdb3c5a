"""Generic jitted optax training loop for NNX models, with verified orbax checkpoint/resume.

* :func:`causal_lm_loss`: next-token cross-entropy with an optional loss mask (answer tokens
  only, padding excluded), returned as (sum, count) so gradient accumulation is exact.
* :func:`make_optimizer`: AdamW with linear warm-up + cosine decay and global-norm clipping.
* :func:`make_train_step`: one jitted optax step on a loss, for pure parameters or an NNX model
  (the building block of the task-specific loops: GNNs, graph transformer, PalQuant, drafter,
  policy warm-up); :func:`apply_optax` is its optax part alone.
* :func:`train`: runs ``cfg.total_steps`` steps of ``train_step``; the batch for step ``s`` is
  ``batches(s)`` (a pure function of the step, so a resumed run sees the same data). With
  ``cfg.accum_steps = A`` each batch is split into A micro-batches whose gradients are summed in
  a ``lax.scan`` before one update. With ``workdir`` it checkpoints params + optimizer state
  every ``cfg.checkpoint_every`` steps and resumes from the newest intact checkpoint: the loss
  curve after a resume equals the uninterrupted one. Metrics go to a tqdm bar and
  ``workdir/metrics.jsonl``. With ``mesh``, parameters are placed by their logical axes and
  batches split on the "batch" rule.
* **What is trained** (``jaxsys.nn.lora.trainable_filter``): every ``nnx.Param``, or only the
  LoRA adapters when the model has any (``jaxsys.nn.lora.apply_lora``), minus the parameters
  whose path (``layers/0/attn/wq``) matches a ``cfg.freeze`` regex. Frozen parameters get no
  gradient and no optimizer state, are placed on the mesh like the rest, and are not part of
  the checkpoint (the model passed in supplies them on resume).

Guarantees (crash and numerics safety):

* **Non-finite steps.** The jitted step checks that the loss, the gradient norm and the updated
  parameters are finite, and applies the update only then (an in-graph select, like
  ``optax.apply_if_finite``, but also covering the loss and the new parameters). The host reads
  that flag where the loop already syncs -- logged steps, checkpoint steps and the last step --
  so there is no extra sync per step. ``cfg.on_nonfinite="raise"`` (default): the first
  non-finite step freezes the state, and at the next such boundary ``train`` raises
  :class:`NonFiniteError` naming that step, with the model holding the parameters of the step
  before it (at most ``log_every`` steps of compute are wasted). ``"skip"``: non-finite updates
  are dropped (parameters, moments and the schedule's count stay as they were), counted in
  ``TrainResult.skipped`` / the ``skipped`` metric and logged. Either way the state every
  checkpoint and the returned model hold is finite (the starting state is checked too).
* **Crash-safe checkpoints** (see :mod:`jaxsys.core.checkpoint`): saves are atomic and
  hash-verified; resume uses the newest intact step and names the steps it skips; rotation
  never deletes the newest good checkpoint.
* **Resume checks the math.** Each checkpoint records the ``TrainConfig``. Resuming with other
  values of the fields in :data:`MATH_FIELDS` (learning rate, schedule, ``total_steps``,
  optimizer hyperparameters, ``accum_steps``) is a :class:`ConfigError` naming the fields unless
  they are passed in ``allow_config_change``; ``total_steps`` below the restored step is always
  an error. Parameter and optimizer-state shapes and dtypes must match the checkpoint (an
  ``InputError`` naming the leaf). Not checked: the loss function, the data, the model's
  non-parameter state and code.
* **Metrics log.** On start, ``metrics.jsonl`` is rewritten (atomically) without the rows after
  the restored step, so it never holds duplicate or orphaned rows; each row is then appended
  with one ``write`` call, so a kill leaves at most one torn last line, dropped on the next start.

Usage::

  result = train(model, lambda s: synthetic.training_batch(mix, seed=0, step=s, batch_size=32,
                 length=128), TrainConfig(total_steps=1000), workdir="runs/tiny")
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import time
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxsys.core.errors import ConfigError, InputError, ShapeError, check_one_of
from jaxsys.core.step import StepsRun, apply_optax, make_train_step, run_steps  # noqa: F401  (re-exported: the loop family)
from jaxsys.core.mesh import RULE_SETS, entry_axes, logical_sharding, logical_to_spec, on_auto_axes, put
from jaxsys.core.optim import OptimizerConfig

__all__ = [
    "apply_optax", "causal_lm_loss", "init_health", "init_optimizer", "lower_step", "make_loop_step", "make_optimizer", "place_batch", "place_params",
    "make_train_step", "MATH_FIELDS", "run_steps", "StepsRun", "NonFiniteError", "ON_NONFINITE", "optimizer_config", "place_states", "train",
    "TrainConfig",
    "TrainResult",
]

log = logging.getLogger("jaxsys")

# TrainConfig fields that change what the optimizer computes: a resume may not change them
# silently (``train(..., allow_config_change=...)``).
MATH_FIELDS = ("learning_rate", "warmup_steps", "total_steps", "min_lr_ratio", "weight_decay",
               "b1", "b2", "grad_clip", "accum_steps", "optimizer")
ON_NONFINITE = ("raise", "skip")
OPTIMIZERS = ("adamw", "sgd")


class NonFiniteError(FloatingPointError):
  """A training step produced a non-finite loss, gradient norm or parameter."""


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
  on_nonfinite: str = "raise"  # "raise" | "skip" (see the module docstring)
  # "adamw", or "sgd": SGD with momentum b1 and decoupled weight decay (the detectors' optimizer)
  optimizer: str = "adamw"
  # how parameters and optimizer state lie on train()'s mesh: "tp" (heads / mlp / vocab over
  # "model", replicated over "data") or "fsdp" (also each parameter's embed axis over "data");
  # jaxsys.core.mesh.RULE_SETS. The math is the same either way.
  rules: str = "tp"
  # a parameter dimension the mesh axis its rule names does not divide (SmolLM2's 9 heads / 3 kv
  # heads on model=2) is replicated over that axis instead of raising (jaxsys.nn.param_specs)
  replicate_indivisible: bool = False
  # regexes over parameter paths (``layers/0/attn/wq``) that training leaves unchanged (no
  # gradient, no optimizer state); a model with LoRA adapters (jaxsys.nn.lora) trains only them.
  freeze: tuple[str, ...] = ()

  def __post_init__(self):
    object.__setattr__(self, "freeze", tuple(self.freeze))
    for name in ("total_steps", "accum_steps", "log_every"):
      if getattr(self, name) < 1:
        raise ConfigError(f"{name}={getattr(self, name)} must be >= 1")
    if self.warmup_steps < 0 or not self.learning_rate > 0:
      raise ConfigError(f"learning_rate={self.learning_rate} must be > 0 and "
                        f"warmup_steps={self.warmup_steps} >= 0")
    if self.checkpoint_every is not None and self.checkpoint_every < 1:
      raise ConfigError(f"checkpoint_every={self.checkpoint_every} must be >= 1 or None")
    if self.max_to_keep < 1:
      raise ConfigError(f"max_to_keep={self.max_to_keep} must be >= 1")
    check_one_of("optimizer", self.optimizer, OPTIMIZERS)
    check_one_of("rules", self.rules, tuple(RULE_SETS))
    check_one_of("on_nonfinite", self.on_nonfinite, ON_NONFINITE)


def optimizer_config(cfg: TrainConfig) -> OptimizerConfig:
  """The :class:`~jaxsys.core.optim.OptimizerConfig` ``cfg``'s fields describe: linear warmup
  over ``warmup_steps`` (at least 1, below ``total_steps``), then a cosine to ``min_lr_ratio``
  at ``total_steps``."""
  warm = min(cfg.warmup_steps, max(cfg.total_steps - 1, 0))
  return OptimizerConfig(cfg.optimizer, cfg.learning_rate, "warmup_cosine", warmup_steps=max(warm, 1),
                         decay_steps=max(cfg.total_steps, warm + 2), min_lr_ratio=cfg.min_lr_ratio,
                         weight_decay=cfg.weight_decay, b1=cfg.b1, b2=cfg.b2, grad_clip=cfg.grad_clip or None)


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
  return optimizer_config(cfg).build()


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
  skipped: int = 0  # non-finite updates dropped (on_nonfinite="skip")


def _split_micro(batch, accum):
  def one(x):
    if x.shape[0] % accum:
      raise ShapeError(f"batch size {x.shape[0]} must be divisible by accum_steps={accum}")
    return x.reshape(accum, x.shape[0] // accum, *x.shape[1:])
  return jax.tree.map(one, batch)


def _all_finite(tree):
  leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)
            if jnp.issubdtype(x.dtype, jnp.inexact)]
  return jnp.all(jnp.stack(leaves)) if leaves else jnp.bool_(True)


def init_health(step: int) -> dict:
  """The step's finiteness bookkeeping, carried on device: ``step`` (updates so far),
  ``first_bad`` (the 1-based step of the first non-finite update, -1: none) with its loss and
  grad norm, and ``nonfinite`` (how many updates were non-finite)."""
  return {"step": jnp.int32(step), "first_bad": jnp.int32(-1), "nonfinite": jnp.int32(0),
          "bad_loss": jnp.float32(0), "bad_grad_norm": jnp.float32(0)}


def make_loop_step(graphdef, template, tx, loss_fn, accum: int, on_nonfinite: str = "raise"):
  """:func:`train`'s step, with gradient accumulation and the finiteness guard:
  ``(params, opt_state, rest, batch, health) -> (params, opt_state, metrics, health)``,
  jitted with donation; ``rest`` is the model's non-parameter state (passed through unchanged),
  ``health`` is :func:`init_health`'s dict. An update whose loss, gradient norm or new
  parameters are not finite is not applied; with ``on_nonfinite="raise"`` none is applied after
  the first such one either (the state stays that of the last finite step)."""

  def micro_loss(params, rest, mb):
    model = nnx.merge(graphdef, _to_state(template, params), rest)
    total, count, metrics = loss_fn(model, mb)
    return total, (count, metrics)

  grad_fn = jax.value_and_grad(micro_loss, has_aux=True)

  def step(params, opt_state, rest, batch, health):
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
    new_params, new_opt_state = apply_optax(tx, grads, opt_state, params)
    loss, grad_norm = lsum / denom, optax.global_norm(grads)
    metrics = {"loss": loss, "tokens": csum, "grad_norm": grad_norm}
    metrics.update({k: v / denom for k, v in msum.items()})
    # Finite grads keep the moments finite, so loss, grad norm and new params cover the state.
    ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm) & _all_finite(new_params)
    first_bad = health["first_bad"]
    apply = ok if on_nonfinite == "skip" else ok & (first_bad < 0)
    # One conditional, not a select per leaf: new_params also feed the finiteness reduction, so
    # per-leaf selects could not fuse into the update and each copied the predicate's and-chain
    # (~140 more fusions on a 42-leaf model; its step compiled in 9.1 s instead of 6.6 s).
    params, opt_state = jax.lax.cond(apply, lambda: (new_params, new_opt_state), lambda: (params, opt_state))
    done = health["step"] + 1
    is_first = ~ok & (first_bad < 0)
    health = {"step": done, "first_bad": jnp.where(is_first, done, first_bad),
              "nonfinite": health["nonfinite"] + (~ok).astype(jnp.int32),
              "bad_loss": jnp.where(is_first, loss.astype(jnp.float32), health["bad_loss"]),
              "bad_grad_norm": jnp.where(is_first, grad_norm.astype(jnp.float32),
                                         health["bad_grad_norm"])}
    return params, opt_state, metrics, health

  return jax.jit(step, donate_argnums=(0, 1, 4))


_STEP_CACHE: dict = {}


def _cached_step(graphdef, template, cfg: TrainConfig, loss_fn):
  """Reuses the jitted step across ``train`` calls on models of the same graph and config (a
  resumed run does not recompile)."""
  key = (graphdef, cfg, loss_fn)
  if key not in _STEP_CACHE:
    if len(_STEP_CACHE) > 16:
      _STEP_CACHE.clear()
    _STEP_CACHE[key] = make_loop_step(graphdef, template, make_optimizer(cfg), loss_fn,
                                      cfg.accum_steps, cfg.on_nonfinite)
  return _STEP_CACHE[key]


def _to_state(template, pure):
  """A fresh ``nnx.State`` shaped like ``template`` holding the arrays of the pure dict."""
  state = jax.tree.map(lambda x: x, template)
  nnx.replace_by_pure_dict(state, pure)
  return state


def place_params(pure, specs, mesh):
  """Each array of the pure dict ``pure`` on ``mesh`` as ``specs`` (a pure dict over every
  parameter, of which ``pure`` may hold a subset) places it."""
  table = dict(jax.tree_util.tree_flatten_with_path(
      specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))[0])
  return jax.tree_util.tree_map_with_path(
      lambda path, x: put(x, jax.sharding.NamedSharding(mesh, _trimmed(table[path]))), pure)


def _trimmed(spec):
  """``spec`` without trailing ``None`` entries: the form a compiled step gives its outputs
  (``P('data', None)`` places as ``P('data')``, but the two do not compare equal, so state
  placed untrimmed recompiles the step once when its outputs come back)."""
  entries = list(spec)
  while entries and entries[-1] is None:
    entries.pop()
  return jax.sharding.PartitionSpec(*entries)


def init_optimizer(tx, params, mesh=None):
  """``tx.init(params)``; on ``mesh`` the moments keep their parameters' placement and the
  state's other arrays (Adam's step count, made on one device) are replicated over the mesh:
  the placement the update returns, so a step does not compile a second time for its own
  outputs."""
  state = tx.init(params)
  if mesh is None:
    return state
  rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  return jax.tree.map(lambda x: x if isinstance(x.sharding, jax.sharding.NamedSharding)
                      else jax.device_put(x, rep), state)


def place_states(model, mesh, rules, *states, replicate_indivisible: bool = False) -> None:
  """Places each ``nnx.State`` of ``states`` (``model``'s parameters, or a subset of them) on
  ``mesh`` as ``rules`` shard them (``jaxsys.nn.layers.param_specs``), in place; no-op without a
  mesh. Optimizer state ``init``-ed from them, and copies of them, inherit the placement."""
  if mesh is None:
    return
  from jaxsys.nn.layers import param_specs
  specs = nnx.to_pure_dict(param_specs(model, mesh, rules, replicate_indivisible=replicate_indivisible))
  for state in states:
    nnx.replace_by_pure_dict(state, place_params(nnx.to_pure_dict(state), specs, mesh))


def place_batch(batch, mesh):
  """Each host array of ``batch`` on the device(s): split over the "batch" rule's mesh axes, or
  on the default device without a mesh (``device_put``, not ``jnp.asarray``: the latter compiles
  a staging copy for every new shape). Rows those axes do not divide are a ``ShapeError``."""
  if mesh is None:
    return jax.tree.map(jax.device_put, batch)
  axes = entry_axes(logical_to_spec(("batch",), mesh)[0])
  ways = math.prod(mesh.shape[a] for a in axes)
  for x in jax.tree.leaves(batch):
    if x.ndim and x.shape[0] % ways:
      name = " x ".join(f"{a}={mesh.shape[a]}" for a in axes)
      raise ShapeError(f"{x.shape[0]} rows do not divide over the mesh's {name} axis; pass a multiple of {ways}")
  return jax.tree.map(
      lambda x: jax.device_put(x, logical_sharding(("batch",) + (None,) * (x.ndim - 1), mesh)),
      batch)


_all_finite_jit = jax.jit(_all_finite)


def _state_finite(state) -> bool:
  """Whether every float array of ``state`` is finite: one compiled reduction on accelerators; on
  XLA:CPU a numpy scan of the arrays (the compiled one costs ~1-2 s of compile per state
  structure, which a run pays once for a check that reads each value once)."""
  leaves = jax.tree.leaves(state)
  if jax.default_backend() != "cpu" or not all(getattr(x, "is_fully_addressable", True) for x in leaves):
    return bool(_all_finite_jit(state))  # (arrays of other processes: the reduction reads them)
  return all(bool(np.isfinite(np.asarray(x)).all()) for x in leaves if jnp.issubdtype(x.dtype, jnp.inexact))


def _check_finite_state(state, what: str) -> None:
  if _state_finite(state):  # leaf names only on failure
    return
  bad = [jax.tree_util.keystr(k) for k, x in jax.tree_util.tree_flatten_with_path(state)[0]
         if jnp.issubdtype(x.dtype, jnp.inexact) and not bool(jnp.all(jnp.isfinite(x)))]
  raise InputError(f"{what} holds non-finite values in {bad[:4]}")


def _check_resume(cfg: TrainConfig, saved: dict | None, step: int, where, allow) -> None:
  """Raises if resuming ``step`` (recorded config ``saved``) under ``cfg`` changes the math."""
  if step > cfg.total_steps:
    raise ConfigError(f"total_steps={cfg.total_steps} is smaller than the restored step={step} "
                      f"in {where}: a run cannot go back; use a new workdir or a larger "
                      f"total_steps")
  if saved is None:
    log.warning("checkpoint step %d in %s records no TrainConfig: resuming unchecked", step, where)
    return
  changed = [f for f in MATH_FIELDS if f in saved and saved[f] != getattr(cfg, f)]
  refused = [f for f in changed if f not in allow]
  if refused:
    diff = ", ".join(f"{f}={getattr(cfg, f)!r} (checkpoint: {saved[f]!r})" for f in refused)
    raise ConfigError(f"resuming step={step} from {where} with {diff}: this changes the training "
                      f"math; pass allow_config_change={tuple(refused)!r} to continue with the "
                      f"new values")
  for f in changed:
    log.warning("resuming step %d with %s=%r (checkpoint: %r), as allowed", step, f,
                getattr(cfg, f), saved[f])


def _truncate_log(path: Path, keep_upto: int) -> None:
  """Drops the rows of ``path`` after step ``keep_upto`` (and a torn last line), atomically."""
  if not path.exists():
    return
  from jaxsys.core.checkpoint import write_atomic
  rows = []
  for line in path.read_text().splitlines():
    try:
      step = json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
      continue  # a line torn by a kill mid-append
    if step <= keep_upto:
      rows.append(line + "\n")
  write_atomic(path, "".join(rows))


def _append_line(path: Path, line: str) -> None:
  # One write(2) of the whole line: a kill leaves the file without it or with it whole.
  fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
  try:
    os.write(fd, line.encode())
  finally:
    os.close(fd)


@on_auto_axes  # layers' sharding annotations are compiler hints: the step runs on Auto axes
def train(model, batches: Callable[[int], dict], cfg: TrainConfig, *, workdir=None,
          loss_fn=causal_lm_loss, mesh=None, progress: bool = True, stop_at: int | None = None,
          callback: Callable[[int, dict], None] | None = None,
          allow_config_change: Collection[str] = ()) -> TrainResult:
  """Trains ``model`` in place (its parameters are updated) and returns the history.

  ``stop_at`` ends the run early at that step (the schedule still spans ``total_steps``),
  e.g. to simulate an interruption; a run restored at or past it does no step.
  ``callback(step, metrics)`` runs on logged steps. ``allow_config_change``: names of
  :data:`MATH_FIELDS` that may differ from the checkpoint being resumed. Raises
  :class:`NonFiniteError` on a non-finite step with ``cfg.on_nonfinite="raise"``.
  """
  from jaxsys.core.checkpoint import Checkpointer
  unknown = sorted(set(allow_config_change) - set(MATH_FIELDS))
  if unknown:
    raise ConfigError(f"allow_config_change={tuple(allow_config_change)!r} names {unknown}, "
                      f"which are not among {MATH_FIELDS}")
  graphdef, params, rest, template, opt_state = _setup(model, cfg, mesh)
  start = 0
  ckpt = None
  log_path = None
  if workdir is not None:
    workdir = Path(workdir)
    ckpt = Checkpointer(workdir / "checkpoints", max_to_keep=cfg.max_to_keep)
    log_path = workdir / "metrics.jsonl"
    step = ckpt.latest_intact_step()  # logs the newer broken steps it skips
    if step is not None:
      meta = ckpt.metadata(step) or {}
      _check_resume(cfg, meta.get("train_config"), step, ckpt.directory, allow_config_change)
      from jaxsys.nn.layers import FLAX_RENAMES  # checkpoints written before the flax names
      restored = ckpt.restore(step, like={"params": params, "opt_state": opt_state, "step": 0},
                              renames=FLAX_RENAMES)
      params, opt_state, start = restored["params"], restored["opt_state"], int(restored["step"])
    elif ckpt.all_steps():
      log.warning("no intact checkpoint in %s: training from step 0", ckpt.directory)
    _truncate_log(log_path, start)
  _check_finite_state({"params": params, "opt_state": opt_state},
                      f"the state at step {start}" + (" (restored)" if start else ""))
  step_fn = _cached_step(graphdef, template, cfg, loss_fn)
  end = cfg.total_steps if stop_at is None else min(stop_at, cfg.total_steps)
  end = max(end, start)
  history: list[dict[str, float]] = []
  health = init_health(start)
  skipped = 0
  checked = start  # the last step whose finiteness the host has read
  last_saved = start if ckpt is not None and start else None
  bar = None
  if progress:
    from tqdm.auto import tqdm
    bar = tqdm(total=end, initial=start, desc="train", dynamic_ncols=True)
  t0 = time.perf_counter()
  ctx = jax.set_mesh(mesh) if mesh is not None else _null()
  try:
    with ctx:
      for step in range(start, end):
        batch = place_batch(batches(step), mesh)
        params, opt_state, metrics, health = step_fn(params, opt_state, rest, batch, health)
        done = step + 1
        log_now = done % cfg.log_every == 0 or done == end
        save_now = ckpt is not None and cfg.checkpoint_every and (
            done % cfg.checkpoint_every == 0 or done == end)
        if log_now or save_now:
          # The loop syncs here anyway (metrics / checkpoint): read the finiteness record.
          h = jax.device_get(health)
          if int(h["first_bad"]) >= 0 and cfg.on_nonfinite == "raise":
            bad = int(h["first_bad"])
            nnx.update(model, _to_state(template, params))  # frozen at step bad - 1
            saved = ("no checkpoint" if last_saved is None
                     else f"the last checkpoint is step {last_saved}")
            raise NonFiniteError(
                f"non-finite loss or gradient at step {bad} (loss={float(h['bad_loss'])}, "
                f"grad_norm={float(h['bad_grad_norm'])}): training stopped; the model holds the "
                f"parameters after step {bad - 1}, {saved}. "
                f"Lower learning_rate, set grad_clip, or use on_nonfinite='skip'")
          if int(h["nonfinite"]) > skipped:
            log.warning("skipped %d non-finite update(s) in steps %d..%d (%d in this run)",
                        int(h["nonfinite"]) - skipped, checked + 1, done, int(h["nonfinite"]))
            skipped = int(h["nonfinite"])
          checked = done
        if log_now:
          row = {"step": done, **{k: float(v) for k, v in jax.device_get(metrics).items()},
                 "skipped": skipped, "seconds": time.perf_counter() - t0}
          history.append(row)
          if log_path is not None:
            _append_line(log_path, json.dumps(row) + "\n")
          if bar is not None:
            bar.set_postfix(loss=f"{row['loss']:.4f}", acc=f"{row.get('correct', np.nan):.3f}")
          if callback is not None:
            callback(done, row)
        if bar is not None:
          bar.update(1)
        if save_now:
          ckpt.save(done, {"params": params, "opt_state": opt_state, "step": done},
                    metadata={"train_config": dataclasses.asdict(cfg)})
          last_saved = done
  finally:
    if bar is not None:
      bar.close()
    if ckpt is not None:
      ckpt.close()
  nnx.update(model, _to_state(template, params))
  return TrainResult(model, end, history, skipped)


def _setup(model, cfg: TrainConfig, mesh):
  """``(graphdef, params, rest, template, opt_state)``: the trained parameters as a pure dict
  (every nnx.Param, or the LoRA adapters alone, minus ``cfg.freeze``) placed on ``mesh`` by
  ``cfg.rules``, the rest of the model state (frozen parameters placed the same way: no
  gradient, no optimizer state), the trained state's shapes and the fresh optimizer state."""
  from jaxsys.nn.lora import trainable_filter
  graphdef, params_state, frozen, rest = nnx.split(model, trainable_filter(model, cfg.freeze),
                                                   nnx.Param, ...)
  if mesh is not None:
    place_states(model, mesh, cfg.rules, params_state, frozen, replicate_indivisible=cfg.replicate_indivisible)
    params = nnx.to_pure_dict(params_state)
  else:
    params = jax.tree.map(jnp.copy, nnx.to_pure_dict(params_state))  # donated by the step
  template = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params_state)
  return graphdef, params, nnx.merge_state(frozen, rest), template, init_optimizer(make_optimizer(cfg), params, mesh)


@on_auto_axes
def lower_step(model, batch: dict, cfg: TrainConfig, *, loss_fn=causal_lm_loss, mesh=None):
  """The ``jax.stages.Lowered`` of one :func:`train` step on ``batch``, with the parameters and
  optimizer state placed as ``train`` places them: ``.compile().memory_analysis()`` gives the
  per-device bytes, ``.compile().as_text()`` the collectives (``experiments/scaling.py``)."""
  graphdef, params, rest, template, opt_state = _setup(model, cfg, mesh)
  step = _cached_step(graphdef, template, cfg, loss_fn)
  with jax.set_mesh(mesh) if mesh is not None else _null():
    return step.lower(params, opt_state, rest, place_batch(batch, mesh), init_health(0))


class _null:
  def __enter__(self):
    return self

  def __exit__(self, *exc):
    return False
