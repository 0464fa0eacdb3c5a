"""TLT assembled: GRPO whose rollouts run on the adaptive speculative engine, with the drafter
trained online on the rollouts' own target features.

:func:`make_tlt_trainer` wires the parts the TLT paper combines (they live in
``jaxsys.speculative`` and ``jaxsys.rl.grpo``):

* a :class:`~jaxsys.speculative.engine.RolloutEngine` on (a copy of) the policy and the drafter,
  speculative with the strategy bandit (and its "no drafting" arm, ``TLTConfig.vanilla_arm``);
* a :class:`~jaxsys.speculative.online.DrafterBuffer` of the last ``online_buffer`` rollouts,
  optionally seeded with warm-up rollouts (a GRPO step holds only a few long responses; training
  on those alone memorises them instead of tracking the policy);
* a :class:`~jaxsys.speculative.online.DrafterTrainer` on a copy of the drafter, its update
  compiled before the first step, driven by a :class:`~jaxsys.speculative.online.SpotTrainer`
  (``spot_steps`` updates between rollouts with ``synchronous=True``, else in the background
  during the long tail) that swaps the new drafter into the engine;
* the :class:`~jaxsys.rl.grpo.GRPOTrainer` that ties rollout, rewards, update and weight sync.

``speculative=False`` builds the same pipeline without speculation or drafter training: the
vanilla baseline TLT is compared against (same engine code, same executable pool).

:func:`warm_up_drafter` is the step before: vanilla rollouts of the initial policy, their target
features in a buffer, optionally the drafter's reduced vocabulary from their tokens, then a
number of drafter updates (and its top-1 on a held-out rollout).

Usage::

  from jaxsys.rl.tlt import TLTConfig, make_tlt_trainer, warm_up_drafter
  warm = warm_up_drafter(policy, drafter, rollout, [sampler_prompts(32) for _ in range(4)],
                         seeds=range(4), steps=400)
  rollout = RolloutConfig(strategies=(Strategy(4, 1, 5),), max_new=64, max_prompt=32,
                          sampling=SamplingParams(1.0), stop_tokens=(eos,))
  tlt = make_tlt_trainer(policy, warm.drafter, sampler, rollout, TLTConfig(spot_steps=40),
                         warm_rollouts=warm.rollouts, reward_fn=reward, pad_id=pad)
  tlt.precompile()                 # optional: every rollout executable and update width
  for _ in range(10):
    metrics = tlt.step()           # reward_mean, rollout_seconds, mean_accepted, drafter_seconds, ...
  policy, drafter_state = tlt.trainer.policy, tlt.engine.dstate
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax.numpy as jnp
from flax import nnx

from jaxsys.core.errors import ConfigError, check_min, check_positive, check_range
from jaxsys.core.optim import OptimizerConfig, check_nested
from jaxsys.rl import grpo
from jaxsys.speculative import online
from jaxsys.speculative.engine import RolloutConfig, RolloutEngine
from jaxsys.speculative.pool import ExecutablePool

__all__ = ["drafter_seq_len", "DrafterWarmup", "make_tlt_trainer", "TLT", "TLTConfig", "warm_up_drafter"]


@dataclasses.dataclass(frozen=True)
class TLTConfig:
  """GRPO settings (nested) plus the online drafter's: buffer size, optimiser, update count.

  ``drafter_optimizer`` (a ``jaxsys.core.optim.OptimizerConfig``) is the online drafter's
  optimizer; None: AdamW at ``drafter_lr`` with ``drafter_weight_decay``, and given, those two
  stay at their defaults. (The policy's optimizer is ``grpo.optimizer``, hence the prefix.)
  """
  grpo: grpo.GRPOConfig = grpo.GRPOConfig()
  online_buffer: int = 6        # rollouts the drafter trains on (the latest ones)
  drafter_lr: float = 5e-4
  drafter_batch: int = 16
  drafter_weight_decay: float = 0.0
  spot_steps: int = 40          # drafter updates per rollout
  synchronous: bool = True      # updates between rollouts (True) or during the long tail
  vanilla_arm: bool = True      # the bandit may also run the long tail without drafting
  buffer_seed: int = 1
  drafter_optimizer: OptimizerConfig | None = None

  def __post_init__(self):
    if not isinstance(self.grpo, grpo.GRPOConfig):
      raise ConfigError(f"grpo={self.grpo!r} must be a GRPOConfig")
    check_min(self, 1, "online_buffer", "drafter_batch", "spot_steps")
    check_positive(self, "drafter_lr")
    check_min(self, 0, "drafter_weight_decay")
    check_nested(self, "drafter_lr", "drafter_weight_decay", field="drafter_optimizer")

  def drafter_optimizer_config(self) -> OptimizerConfig:
    """The online drafter's optimizer: ``drafter_optimizer``, or AdamW at ``drafter_lr`` with
    ``drafter_weight_decay``."""
    return self.drafter_optimizer or OptimizerConfig("adamw", self.drafter_lr, weight_decay=self.drafter_weight_decay)


@dataclasses.dataclass
class TLT:
  """The assembled pipeline; ``spot`` and ``drafter_trainer`` are None without speculation."""
  trainer: grpo.GRPOTrainer
  engine: RolloutEngine
  buffer: online.DrafterBuffer
  spot: online.SpotTrainer | None
  drafter_trainer: online.DrafterTrainer | None

  def step(self) -> dict:
    """One GRPO step (rollout, rewards, update, weight sync; drafter training with TLT)."""
    return self.trainer.step()

  def precompile(self) -> None:
    """Every rollout executable (all buckets and shrinks) and every update width, before step 1."""
    self.engine.precompile()
    self.trainer.precompile()


def drafter_seq_len(rollout: RolloutConfig) -> int:
  """Drafter training length: prompt + response, rounded up to a power of two."""
  return 1 << (rollout.max_prompt + rollout.max_new - 1).bit_length()


@dataclasses.dataclass
class DrafterWarmup:
  """What :func:`warm_up_drafter` returns."""
  drafter: Any      # the trained drafter (with steps == 0 the one given, draft_vocab=True's vocabulary installed)
  rollouts: list    # the warm-up rollout results, in order (make_tlt_trainer's warm_rollouts)
  metrics: dict     # the last update's metrics, heldout_top1, rollout_seconds, train_seconds


def warm_up_drafter(policy, drafter, rollout: RolloutConfig, prompt_batches: Sequence, *,
                    seeds: Sequence[int], steps: int, lr: float = 3e-3, batch: int = 16,
                    draft_vocab: bool = False, heldout: tuple | None = None, heldout_rows: int = 16,
                    buffer_seed: int = 0, pool: ExecutablePool | None = None) -> DrafterWarmup:
  """TLT's drafter warm-up on the initial policy.

  One vanilla rollout per entry of ``prompt_batches`` (batch ``k`` sampled with ``seeds[k]``, on
  ``rollout``'s engine settings) fills a :class:`~jaxsys.speculative.online.DrafterBuffer` with
  the target's own features; ``draft_vocab=True`` then installs the reduced draft vocabulary on
  ``drafter`` itself (the drafter config's ``draft_vocab`` most frequent response tokens,
  FR-Spec); then ``steps``
  updates of a :class:`~jaxsys.speculative.online.DrafterTrainer` (``lr``, ``batch`` rows of
  :func:`drafter_seq_len` tokens). ``heldout=(prompts, seed)``: one more rollout, whose top-1 over
  ``heldout_rows`` sampled rows is reported (top-1 on the training data alone hides memorisation).
  """
  from jaxsys.models.llm.drafter import drafter_loss, top_token_ids
  if len(seeds) != len(prompt_batches):
    raise ConfigError(f"seeds has {len(seeds)} entries for {len(prompt_batches)} prompt batches")
  check_range("steps", steps, 0)
  rcfg = dataclasses.replace(rollout, speculative=False)
  engine = RolloutEngine(policy, drafter, rcfg, pool=pool)
  n = len(prompt_batches)
  buffer = online.DrafterBuffer(max_steps=max(n, 1), seed=buffer_seed)
  t0 = time.perf_counter()
  results = [engine.generate(list(p), seed=int(s)) for p, s in zip(prompt_batches, seeds)]
  for k, r in enumerate(results):
    buffer.add(k - n, r.sequences, r.features, r.prompt_lengths)
  metrics = {"rollout_seconds": time.perf_counter() - t0}
  if draft_vocab:
    drafter.set_draft_vocab(top_token_ids([s for r in results for s in r.sequences], drafter.config.draft_vocab,
                                          policy.config.vocab_size,
                                          [p for r in results for p in r.prompt_lengths]))
  seq_len = drafter_seq_len(rcfg)
  t0 = time.perf_counter()
  if steps:
    trainer = online.DrafterTrainer(drafter, lr=lr, batch=batch, seq_len=seq_len)
    metrics.update(trainer.train(policy, buffer, steps))
    drafter = trainer.drafter
  metrics["train_seconds"] = time.perf_counter() - t0
  if heldout is not None:
    ho = online.DrafterBuffer(max_steps=1, seed=buffer_seed)
    r = engine.generate(list(heldout[0]), seed=int(heldout[1]))
    ho.add(0, r.sequences, r.features, r.prompt_lengths)
    top1 = drafter_loss(drafter, policy, *(jnp.asarray(a) for a in ho.sample(heldout_rows, seq_len)))[1]["top1"]
    metrics["heldout_top1"] = float(top1)
  return DrafterWarmup(drafter, results, metrics)


def make_tlt_trainer(policy, drafter, sampler, rollout: RolloutConfig,
                     config: TLTConfig = TLTConfig(), *, speculative: bool = True,
                     warm_rollouts: Sequence = (), pool: ExecutablePool | None = None,
                     reward_fn: Callable | None = None, pad_id: int | None = None) -> TLT:
  """Builds TLT (``speculative=True``) or its vanilla baseline on a copy of ``policy``.

  ``drafter``: the (warmed-up) EAGLE drafter the engine starts with; it is not modified (the
  online trainer updates a copy). ``sampler``: the RL prompt sampler (``sample(n, rng)`` of
  examples with ``prompt``, as ``rl.tasks``). ``rollout``: the engine config; ``speculative`` and
  ``vanilla_arm`` are set here. ``warm_rollouts``: rollout results (``sequences``, ``features``,
  ``prompt_lengths``) the online buffer starts with (the latest ``online_buffer`` of them).
  ``pool``: an executable pool shared with other engines (each bucket compiles once).
  ``reward_fn``/``pad_id`` as in ``GRPOTrainer``.
  """
  if speculative and drafter is None:
    raise ConfigError("speculative=True needs a drafter")
  # A copy: two pipelines built from one policy (TLT and its baseline) start from the same
  # weights and never share updates.
  policy = nnx.merge(*nnx.split(policy))
  rcfg = dataclasses.replace(rollout, speculative=speculative,
                             vanilla_arm=speculative and config.vanilla_arm)
  engine = RolloutEngine(policy, drafter, rcfg, pool=pool)
  n = config.online_buffer
  buffer = online.DrafterBuffer(max_steps=n, seed=config.buffer_seed)
  spot = dtr = None
  if speculative:
    for j, r in enumerate(list(warm_rollouts)[-n:]):
      buffer.add(j - n, r.sequences, r.features, r.prompt_lengths)
    dtr = online.DrafterTrainer(nnx.merge(*nnx.split(drafter)), batch=config.drafter_batch,
                                seq_len=drafter_seq_len(rcfg), optimizer=config.drafter_optimizer_config())
    if len(buffer):
      dtr.warm_up(policy, buffer)  # compiles the update before step 1 (state restored)
    spot = online.SpotTrainer(dtr, buffer, max_steps=config.spot_steps,
                              synchronous=config.synchronous)
  kw = {} if pad_id is None else {"pad_id": pad_id}
  trainer = grpo.GRPOTrainer(policy, engine, sampler, config.grpo,
                             buffer=buffer if speculative else None, spot=spot,
                             reward_fn=reward_fn, **kw)
  return TLT(trainer, engine, buffer, spot, dtr)
