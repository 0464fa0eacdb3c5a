"""rl.tlt.make_tlt_trainer: TLT (online drafter) and its vanilla baseline built on the tiny policy."""

import jax
import numpy as np
import pytest
from flax import nnx

from jaxsys.core.errors import ConfigError
from jaxsys.decoding.sampling import SamplingParams
from jaxsys.models.llm.decoder import random_model
from jaxsys.models.llm.drafter import DrafterConfig, EagleDrafter
from jaxsys.rl import grpo, policy as pol, tasks
from jaxsys.rl.tlt import TLTConfig, make_tlt_trainer, warm_up_drafter
from jaxsys.speculative.bandit import Strategy
from jaxsys.speculative.engine import RolloutConfig, RolloutEngine
from jaxsys.speculative.pool import ExecutablePool

PCFG = pol.policy_config(hidden=16, layers=1)


def test_tlt_step_trains_policy_and_drafter_and_baseline_does_not_draft():
  policy = random_model(PCFG, 0)
  drafter = EagleDrafter(DrafterConfig.for_target(PCFG), rngs=nnx.Rngs(1))
  rollout = RolloutConfig(strategies=(Strategy.chain(2),), max_new=6, max_prompt=8,
                          batch_buckets=(8,), spec_threshold=9, stop_tokens=(tasks.EOS,),
                          sampling=SamplingParams(1.0))
  pool = ExecutablePool()
  warm_engine = RolloutEngine(policy, drafter, RolloutConfig(**{**rollout.__dict__, "speculative": False}),
                              pool=pool)
  sampler = tasks.TaskSampler(seed=0)
  warm = [warm_engine.generate([list(e.prompt) for e in sampler.sample(8)], seed=k) for k in range(1)]
  cfg = TLTConfig(grpo=grpo.GRPOConfig(group_size=2, prompts_per_step=4), online_buffer=2,
                  drafter_batch=4, spot_steps=2)
  tlt = make_tlt_trainer(policy, drafter, tasks.TaskSampler(seed=1), rollout, cfg,
                         warm_rollouts=warm, pool=pool)
  assert tlt.engine.config.speculative and tlt.engine.config.vanilla_arm
  assert len(tlt.buffer) > 0 and tlt.drafter_trainer.steps_done == 0  # seeded; warm_up restored
  policy_before = jax.device_get(nnx.state(policy, nnx.Param))
  drafter_before = jax.device_get(nnx.state(drafter))
  dstate_before = jax.device_get(tlt.engine.dstate)
  m = tlt.step()
  assert np.isfinite(m["loss"]) and len(m["responses"]) == 8
  assert tlt.spot.steps_per_rollout == [2] and m["drafter_seconds"] > 0
  changed = jax.tree.map(lambda a, b: bool(np.any(a != b)), dstate_before, jax.device_get(tlt.engine.dstate))
  assert any(jax.tree.leaves(changed))  # the online drafter was swapped into the engine
  new = jax.device_get(nnx.state(tlt.trainer.policy, nnx.Param))
  assert any(jax.tree.leaves(jax.tree.map(lambda a, b: bool(np.any(a != b)), policy_before, new)))
  # the caller's policy and drafter are copies' sources only: untouched
  jax.tree.map(np.testing.assert_array_equal, policy_before, jax.device_get(nnx.state(policy, nnx.Param)))
  jax.tree.map(np.testing.assert_array_equal, drafter_before, jax.device_get(nnx.state(drafter)))

  base = make_tlt_trainer(policy, drafter, tasks.TaskSampler(seed=1), rollout, cfg,
                          speculative=False, warm_rollouts=warm, pool=pool)
  assert not base.engine.config.speculative and not base.engine.config.vanilla_arm
  assert base.spot is None and base.drafter_trainer is None and base.trainer.spot is None
  assert base.trainer.buffer is None and base.trainer.engine is base.engine


def test_warm_up_drafter_trains_on_the_policys_rollouts():
  """The warm-up samples one vanilla rollout per prompt batch (the seeds given), installs the
  reduced draft vocabulary from their response tokens, trains the drafter (new parameters: the
  given drafter's stay) and reports held-out top-1; steps=0 only samples."""
  policy = random_model(PCFG, 0)
  drafter = EagleDrafter(DrafterConfig.for_target(PCFG, draft_vocab=8), rngs=nnx.Rngs(1))
  rollout = RolloutConfig(strategies=(Strategy.chain(2),), max_new=6, max_prompt=8, batch_buckets=(4,),
                          stop_tokens=(tasks.EOS,), sampling=SamplingParams(1.0))
  sampler = tasks.TaskSampler(seed=0)
  batches = [[list(e.prompt) for e in sampler.sample(4)] for _ in range(2)]
  pool = ExecutablePool()
  w = warm_up_drafter(policy, drafter, rollout, batches, seeds=[3, 4], steps=3, batch=4, draft_vocab=True,
                      heldout=(batches[0], 9), heldout_rows=4, pool=pool)
  assert len(w.rollouts) == 2 and 0.0 <= w.metrics["heldout_top1"] <= 1.0 and np.isfinite(w.metrics["loss"])
  again = RolloutEngine(policy, drafter, RolloutConfig(**{**rollout.__dict__, "speculative": False}), pool=pool)
  assert again.generate(batches[1], seed=4).tokens == w.rollouts[1].tokens  # batch k with seeds[k]
  response = np.concatenate([np.asarray(s)[p:] for r in w.rollouts for s, p in zip(r.sequences, r.prompt_lengths)])
  assert np.asarray(w.drafter.draft_ids[...])[0] == np.bincount(response).argmax()  # most frequent first
  trained, given = jax.device_get(nnx.state(w.drafter, nnx.Param)), jax.device_get(nnx.state(drafter, nnx.Param))
  assert any(jax.tree.leaves(jax.tree.map(lambda a, b: bool(np.any(a != b)), trained, given)))
  only = warm_up_drafter(policy, drafter, rollout, batches[:1], seeds=[3], steps=0, pool=pool)
  assert only.drafter is drafter and "loss" not in only.metrics
  with pytest.raises(ConfigError, match="seeds has 1 entries for 2 prompt batches"):
    warm_up_drafter(policy, drafter, rollout, batches, seeds=[3], steps=1)


def test_config_errors():
  with pytest.raises(ConfigError, match="spot_steps"):
    TLTConfig(spot_steps=0)
  with pytest.raises(ConfigError, match="grpo"):
    TLTConfig(grpo={"group_size": 2})
  with pytest.raises(ConfigError, match="drafter"):
    make_tlt_trainer(random_model(PCFG, 0), None, tasks.TaskSampler(), RolloutConfig(
        max_prompt=8, sampling=SamplingParams(1.0)))
