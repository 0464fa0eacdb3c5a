"""GRPO variants (DAPO, Dr.GRPO, dual-clip) against losses computed by hand on tiny arrays."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsys.core.errors import ConfigError
from jaxsys.decoding.sampling import SamplingParams
from jaxsys.models.llm.decoder import random_model
from jaxsys.rl import grpo, policy as pol, tasks

# Row 0 has two loss tokens, row 1 one (its second position is padding).
MASK = np.array([[1.0, 1.0], [1.0, 0.0]], np.float32)
ADV = np.array([1.0, -1.0], np.float32)
# ratios: row 0 (1.5, 0.5), row 1 (4.0, pad)
LOG_RATIO = np.log(np.array([[1.5, 0.5], [4.0, 1.0]], np.float32))


def _loss(log_ratio, mask, adv, **kw):
  kw = {"clip_low": 0.2, "clip_high": 0.28, "kl_coef": 0.0, **kw}
  z = jnp.zeros(log_ratio.shape)
  loss, aux = grpo.policy_objective(jnp.asarray(log_ratio), z, jnp.asarray(log_ratio),
                                    jnp.asarray(mask), jnp.asarray(adv), **kw)
  return float(loss), {k: float(v) for k, v in aux.items()}


def test_dual_clip_with_clip_higher_each_aggregation():
  # Per token, clip range [0.8, 1.28]:
  #   (1.5, A=+1): min(1.5, 1.28) = 1.28;  (0.5, A=+1): min(0.5, 0.8) = 0.5
  #   (4.0, A=-1): min(-4, -1.28) = -4, dual-clip 3: max(-4, -3) = -3
  tok, aux = _loss(LOG_RATIO, MASK, ADV, dual_clip=3.0, loss_agg="token-mean")
  np.testing.assert_allclose(tok, -(1.28 + 0.5 - 3.0) / 3, rtol=1e-6)
  assert aux["clip_frac"] == 1.0  # all three ratios lie outside [0.8, 1.28]
  seq, _ = _loss(LOG_RATIO, MASK, ADV, dual_clip=3.0, loss_agg="seq-mean")
  np.testing.assert_allclose(seq, -((1.28 + 0.5) / 2 - 3.0) / 2, rtol=1e-6)
  drg, _ = _loss(LOG_RATIO, MASK, ADV, dual_clip=3.0, loss_agg="seq-mean-token-sum-norm",
                 norm_length=4)
  np.testing.assert_allclose(drg, -((1.28 + 0.5) / 4 - 3.0 / 4) / 2, rtol=1e-6)
  # without the dual clip the negative-advantage token keeps -4
  plain, _ = _loss(LOG_RATIO, MASK, ADV, loss_agg="token-mean")
  np.testing.assert_allclose(plain, -(1.28 + 0.5 - 4.0) / 3, rtol=1e-6)


def test_dr_grpo_sum_norm_is_not_length_normalised():
  # ratio 1: per-token objective = A. Row sums 2 and -1, over the constant 4, then the mean.
  z = np.zeros((2, 2), np.float32)
  loss, _ = _loss(z, MASK, ADV, loss_agg="seq-mean-token-sum-norm", norm_length=4)
  np.testing.assert_allclose(loss, -(2 / 4 - 1 / 4) / 2, rtol=1e-6)
  # a response twice as long weighs twice as much (seq-mean would give the same 1 for both)
  long_mask = np.array([[1.0, 1.0], [1.0, 0.0]], np.float32)
  one, _ = _loss(z, long_mask, np.array([1.0, 0.0], np.float32), loss_agg="seq-mean-token-sum-norm",
                 norm_length=4)
  two, _ = _loss(z, long_mask, np.array([0.0, 1.0], np.float32), loss_agg="seq-mean-token-sum-norm",
                 norm_length=4)
  np.testing.assert_allclose([one, two], [-2 / 4 / 2, -1 / 4 / 2], rtol=1e-6)
  with pytest.raises(ConfigError, match="norm_length"):
    _loss(z, MASK, ADV, loss_agg="seq-mean-token-sum-norm")


def test_rows_without_loss_tokens_leave_the_mean():
  # a dropped group's rows have an all-zero mask: the mean runs over the remaining response only
  z = np.zeros((2, 2), np.float32)
  mask = np.array([[1.0, 1.0], [0.0, 0.0]], np.float32)
  adv = np.array([1.0, 5.0], np.float32)
  for agg in ("seq-mean", "token-mean"):
    np.testing.assert_allclose(_loss(z, mask, adv, loss_agg=agg)[0], -1.0, rtol=1e-6)
  np.testing.assert_allclose(_loss(z, mask, adv, loss_agg="seq-mean-token-sum-norm",
                                   norm_length=4)[0], -0.5, rtol=1e-6)


def test_advantage_normalisation():
  r = np.array([[1.0, 0.0, 0.0, 0.0], [3.0, 3.0, 1.0, 1.0]])
  centred = np.array([[0.75, -0.25, -0.25, -0.25], [1.0, 1.0, -1.0, -1.0]])
  np.testing.assert_allclose(np.asarray(grpo.group_advantages(r, norm="none")), centred, rtol=1e-6)
  std = np.array([[np.sqrt(0.1875)], [1.0]])
  np.testing.assert_allclose(np.asarray(grpo.group_advantages(r)), centred / (std + 1e-6), rtol=1e-5)
  with pytest.raises(ConfigError, match="norm"):
    grpo.group_advantages(r, norm="max")


def test_zero_variance_groups_and_overlong_reward():
  r = np.array([[1.0, 1.0, 1.0], [0.0, 1.0, 0.0], [0.5, 0.5, 0.5]])
  assert grpo.zero_variance_groups(r).tolist() == [True, False, True]
  # L_max 10, L_cache 4: free up to 6, then -(|y| - 6) / 4, -1 at 10 and beyond
  got = grpo.overlong_reward([5, 6, 7, 8, 10, 12], 10, 4)
  np.testing.assert_allclose(got, [0, 0, -0.25, -0.5, -1, -1])
  np.testing.assert_allclose(grpo.overlong_reward(9, 10, 4, penalty=0.5), -0.375)
  with pytest.raises(ConfigError, match="buffer"):
    grpo.overlong_reward(3, 10, 0)


def test_presets_and_config_errors():
  d = grpo.GRPOConfig.dapo()
  assert (d.clip_range, d.loss_agg, d.dynamic_sampling, d.kl_coef) == ((0.2, 0.28), "token-mean", True, 0.0)
  assert d.overlong_buffer == 0.2 and d.max_resample == 2
  assert grpo.GRPOConfig.preset("dapo", max_resample=5).max_resample == 5
  dr = grpo.GRPOConfig.preset("dr_grpo")
  assert (dr.adv_norm, dr.loss_agg, dr.kl_coef) == ("none", "seq-mean-token-sum-norm", 0.0)
  assert grpo.GRPOConfig(norm_length=7).objective_kwargs()["norm_length"] == 7
  for kw, match in [({"adv_norm": "max"}, "adv_norm"), ({"overlong_buffer": 1.0}, "overlong_buffer"),
                    ({"overlong_penalty": -1.0}, "overlong_penalty"), ({"max_resample": 2}, "dynamic_sampling"),
                    ({"dynamic_sampling": True, "max_resample": -1}, "max_resample"),
                    ({"norm_length": 0}, "norm_length"), ({"overlong_max_length": 0}, "overlong_max_length")]:
    with pytest.raises(ConfigError, match=match):
      grpo.GRPOConfig(**kw)
  with pytest.raises(ConfigError, match="preset"):
    grpo.GRPOConfig.preset("ppo")


class ScriptedEngine:
  """Stands in for the rollout engine: fixed responses (row i: token 1 + i % 3, 1 + i % 4 times),
  so the trainer's dynamic-sampling logic runs without compiling a decoder loop."""

  def __init__(self, max_new=6, max_prompt=8):
    self.config = types.SimpleNamespace(sampling=SamplingParams(1.0), max_new=max_new,
                                        max_prompt=max_prompt)
    self.seeds = []

  def set_weights(self, model):
    pass

  def generate(self, prompts, seed=0, on_long_tail=None):
    self.seeds.append(seed)
    toks = [[1 + i % 3] * (1 + i % 4) for i in range(len(prompts))]
    stats = {"mean_accepted": float("nan"), "spec_steps": 0, "vanilla_steps": 0}
    return types.SimpleNamespace(tokens=toks, sequences=None, features=None, prompt_lengths=None,
                                 stats=stats)


def test_trainer_dynamic_sampling_and_overlong_shaping():
  policy = random_model(pol.policy_config(hidden=16, layers=1), 0)
  engine = ScriptedEngine()
  # Rewards by call order (P=4 prompts x G=2). Step 1, round 0: groups 0 and 2 are flat;
  # round 1: only group 3 has a signal -> 3 kept, 5 dropped, one dropped group fills the batch.
  # Step 2: every group flat in both rounds -> no update at all.
  table = [1, 1, 0, 1, 0, 0, 1, 0] + [1, 1, 1, 1, 0, 0, 0, 1] + [0.5] * 16
  it = iter(table)
  cfg = grpo.GRPOConfig(group_size=2, prompts_per_step=4, minibatches=2, dynamic_sampling=True,
                        max_resample=1, seed=3)
  tr = grpo.GRPOTrainer(policy, engine, tasks.TaskSampler(seed=0), cfg,
                        reward_fn=lambda ex, r: float(next(it)))
  before = jax.device_get(tr.params)
  m = tr.step()
  assert (m["groups_dropped"], m["groups_kept"], m["resample_rounds"]) == (5, 3, 1)
  assert engine.seeds == [3 * 100003, 3 * 100003 + 1000003]  # round 0 keeps the plain seed
  assert m["reward_mean"] == 0.5 and len(m["responses"]) == 16  # round 0's reward; both rounds
  changed = jax.tree.map(lambda a, b: bool(np.any(a != b)), before, jax.device_get(tr.params))
  assert any(jax.tree.leaves(changed))
  mid = jax.device_get(tr.params)
  m = tr.step()
  assert (m["groups_dropped"], m["groups_kept"], m["train_tokens"]) == (8, 0, 0)
  assert np.isnan(m["loss"])
  jax.tree.map(np.testing.assert_array_equal, mid, jax.device_get(tr.params))
  # overlong shaping: L_max = max_new = 6, L_cache = 0.5 * 6 = 3; free up to 3 tokens
  tr2 = grpo.GRPOTrainer(policy, engine, tasks.TaskSampler(seed=0),
                         grpo.GRPOConfig(group_size=2, prompts_per_step=4, overlong_buffer=0.5),
                         reward_fn=lambda ex, r: 1.0)
  ex = tasks.add_example(1, 2)
  # KL weight 0 (DAPO, Dr.GRPO): the reference pass is skipped
  toks = jnp.zeros((2, 6), jnp.int32)
  old, ref = grpo.GRPOTrainer(policy, engine, tasks.TaskSampler(seed=0), grpo.GRPOConfig.dapo(
      group_size=2, prompts_per_step=4))._logps(toks)
  assert ref is old and tr._logps(toks)[1] is not tr._logps(toks)[0]
  np.testing.assert_allclose(tr2.rewards([ex] * 3, [[1] * 3, [1] * 4, [1] * 6]), [1, 2 / 3, 0], rtol=1e-6)
