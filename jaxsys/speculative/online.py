"""Online drafter training: a buffer of target features from recent rollouts, a jitted EAGLE
train step, a "spot" trainer (background during the long tail, or a fixed number of steps
between rollouts), and orbax checkpoints.

TLT trains the drafter on the hidden states the rollout already produced (no extra target
forward), using only the last few RL steps so the drafter tracks the drifting policy, and runs
the training while the rollout is in its long tail (most workers idle); the updated drafter is
swapped into the engine between rollouts.

Usage::

  buffer = DrafterBuffer(max_steps=2)
  buffer.add(step, result.sequences, result.features, result.prompt_lengths)
  trainer = DrafterTrainer(drafter, lr=1e-3)
  metrics = trainer.train(target, buffer, steps=50)
  save_drafter(path, trainer.drafter); drafter = load_drafter(path, drafter.config)
"""

from __future__ import annotations

import collections
import os
import threading

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxsys.core.errors import ConfigError, InputError
from jaxsys.core.optim import OptimizerConfig, check_nested
from jaxsys.models.llm.drafter import DrafterConfig, EagleDrafter, check_compatible, drafter_loss
from jaxsys.train import make_train_step

__all__ = ["DrafterBuffer", "DrafterTrainer", "load_drafter", "save_drafter", "SpotTrainer"]


class DrafterBuffer:
  """Sequences, target features and prompt lengths of the last ``max_steps`` RL steps."""

  def __init__(self, max_steps: int = 2, seed: int = 0):
    if max_steps < 1:
      raise ConfigError(f"max_steps={max_steps} must be >= 1")
    self.steps: collections.deque = collections.deque(maxlen=max_steps)
    self.rng = np.random.default_rng(seed)
    self._lock = threading.Lock()

  def add(self, step: int, sequences, features, prompt_lengths):
    items = [(np.asarray(s), np.asarray(f), int(p)) for s, f, p in zip(sequences, features, prompt_lengths)
             if len(s) >= 2]
    with self._lock:
      self.steps.append((step, items))

  def __len__(self):
    return sum(len(items) for _, items in self.steps)

  def sample(self, batch: int, seq_len: int):
    """``tokens int[batch, seq_len]``, ``feats [batch, seq_len, embed]``, ``mask [batch, seq_len]``
    (1 where the next token is a response token); sequences longer than seq_len are cut."""
    with self._lock:
      pool = [it for _, items in self.steps for it in items]
    if not pool:
      raise ConfigError("the drafter buffer is empty")
    dim = pool[0][1].shape[-1]
    tokens = np.zeros((batch, seq_len), np.int32)
    feats = np.zeros((batch, seq_len, dim), np.float32)
    mask = np.zeros((batch, seq_len), np.float32)
    for i, j in enumerate(self.rng.integers(len(pool), size=batch)):
      s, f, p = pool[j]
      n = min(len(s), seq_len)
      tokens[i, :n], feats[i, :n] = s[:n], f[:n]
      mask[i, max(p - 1, 0):n - 1] = 1.0
    return tokens, feats, mask


class DrafterTrainer:
  """Adam on the drafter's parameters only (the target's embedding/head stay frozen)."""

  def __init__(self, drafter: EagleDrafter, *, lr: float = 1e-3, batch: int = 16, seq_len: int = 64,
               weight_decay: float = 0.0, optimizer: OptimizerConfig | None = None):
    # optimizer: replaces the AdamW that lr and weight_decay describe (both then stay at their defaults).
    if lr <= 0:
      raise ConfigError(f"lr={lr} must be positive")
    check_nested(dict(optimizer=optimizer, lr=lr, weight_decay=weight_decay), "lr", "weight_decay",
                 defaults=DrafterTrainer.__init__)
    self.gdef, self.params, self.rest = nnx.split(drafter, nnx.Param, ...)
    self.tx = (optimizer or OptimizerConfig("adamw", lr, weight_decay=weight_decay)).build()
    self.opt_state = self.tx.init(self.params)
    self.batch, self.seq_len = batch, seq_len
    self.steps_done = 0

    def loss_fn(drafter, tgdef, tstate, tokens, feats, mask):  # -> (loss, metrics)
      return drafter_loss(drafter, nnx.merge(tgdef, tstate), tokens, feats, mask)

    # The target's graphdef is static (one executable per target structure).
    self._update = make_train_step(loss_fn, self.tx, graphdef=self.gdef, has_aux=True,
                                   static_argnums=(0,))

  @property
  def drafter(self) -> EagleDrafter:
    return nnx.merge(self.gdef, self.params, self.rest)

  @property
  def state(self):
    """The full drafter state (what ``RolloutEngine.set_drafter`` takes)."""
    return nnx.split(self.drafter)[1]

  def step(self, target, tokens, feats, mask, *, target_split=None):
    """One update on a sample. ``target_split``: ``nnx.split(target)`` when the caller already
    has it (a loop of steps splits the frozen target once: ~2.5 ms a split for the tiny LM)."""
    if not getattr(self, "_checked", False):
      check_compatible(self.drafter, target)
      self._checked = True
    tgdef, tstate = nnx.split(target) if target_split is None else target_split
    self.params, self.opt_state, loss, metrics, _ = self._update(
        self.params, self.opt_state, self.rest, tgdef, tstate, jnp.asarray(tokens),
        jnp.asarray(feats), jnp.asarray(mask))
    self.steps_done += 1
    return dict(metrics, loss=loss)

  def warm_up(self, target, buffer: DrafterBuffer):
    """Compiles the train step (one step on a buffer sample, then the old parameters, optimizer
    state and sample stream are restored): the first real update then runs no compiler."""
    saved = (self.params, self.opt_state, self.steps_done, buffer.rng.bit_generator.state)
    jax.block_until_ready(self.step(target, *buffer.sample(self.batch, self.seq_len)))
    self.params, self.opt_state, self.steps_done = saved[:3]
    buffer.rng.bit_generator.state = saved[3]

  def train(self, target, buffer: DrafterBuffer, steps: int, stop: threading.Event | None = None):
    """Runs up to ``steps`` train steps on buffer samples; returns the last metrics (floats)."""
    m, split = {}, nnx.split(target)
    for _ in range(steps):
      if stop is not None and stop.is_set():
        break
      m = self.step(target, *buffer.sample(self.batch, self.seq_len), target_split=split)
    return {k: float(v) for k, v in jax.device_get(m).items()}


class SpotTrainer:
  """Drafter training on spare resources, in one of two modes.

  * background (``synchronous=False``): ``start(target)`` launches up to ``max_steps`` train
    steps in a thread while the rollout is in its long tail (the engine's ``on_long_tail``
    hook), ``stop()`` ends them at the end of the rollout and returns the drafter state. Right
    where the drafter trains on otherwise idle devices.
  * between rollouts (``synchronous=True``): ``train_now(target)`` runs exactly ``max_steps``
    steps and returns the state. On a small CPU host there are no idle cores: a background
    thread would race the rollout for them and blur both timings, so the caller runs this
    outside the rollout and reports its time separately (``GRPOTrainer``: ``drafter_seconds``).
  """

  def __init__(self, trainer: DrafterTrainer, buffer: DrafterBuffer, max_steps: int = 20,
               synchronous: bool = False):
    self.trainer, self.buffer, self.max_steps = trainer, buffer, max_steps
    self.synchronous = synchronous
    self._thread = None
    self._stop = threading.Event()
    self.last_metrics: dict = {}
    self.steps_per_rollout: list[int] = []

  def start(self, target):
    if self._thread is not None or len(self.buffer) == 0:
      return
    self._stop.clear()
    before = self.trainer.steps_done

    def run():
      self.last_metrics = self.trainer.train(target, self.buffer, self.max_steps, self._stop) or self.last_metrics
      self._done_steps = self.trainer.steps_done - before

    self._done_steps = 0
    self._thread = threading.Thread(target=run, daemon=True)
    self._thread.start()

  def train_now(self, target):
    """``max_steps`` train steps now (synchronous mode); returns the new drafter state, or None
    with an empty buffer."""
    if len(self.buffer) == 0:
      return None
    before = self.trainer.steps_done
    self.last_metrics = self.trainer.train(target, self.buffer, self.max_steps) or self.last_metrics
    self.steps_per_rollout.append(self.trainer.steps_done - before)
    return self.trainer.state

  def stop(self):
    if self._thread is None:
      return None
    self._stop.set()
    self._thread.join()
    self._thread = None
    self.steps_per_rollout.append(self._done_steps)
    return self.trainer.state


def save_drafter(path, drafter: EagleDrafter, step: int = 0):
  """Saves the drafter's state as ``step`` of a verified checkpoint directory ``path``
  (``core.checkpoint.Checkpointer``: atomic, hashed; non-finite weights are refused)."""
  from jaxsys.core.checkpoint import Checkpointer
  state = nnx.state(drafter)
  if not all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(state)
             if jnp.issubdtype(x.dtype, jnp.floating)):
    raise InputError(f"refusing to save a drafter with non-finite weights to {path}")
  with Checkpointer(os.path.abspath(path), max_to_keep=None) as ckpt:
    ckpt.save(step, state, overwrite=True)


def load_drafter(path, config: DrafterConfig, step: int | None = None) -> EagleDrafter:
  """Restores a drafter saved by ``save_drafter`` (shapes from ``config``; ``step`` default: the
  newest intact one)."""
  from jaxsys.core.checkpoint import Checkpointer
  abstract = nnx.eval_shape(lambda: EagleDrafter(config, rngs=nnx.Rngs(0)))
  gdef, abs_state = nnx.split(abstract)
  with Checkpointer(os.path.abspath(path), max_to_keep=None) as ckpt:
    from jaxsys.nn.layers import FLAX_RENAMES
    state = ckpt.restore(step, like=abs_state, renames=FLAX_RENAMES)
  return nnx.merge(gdef, state)
