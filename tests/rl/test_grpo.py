"""GRPO pieces: advantages, clipped surrogate, k3 KL, tasks/rewards, and one trainer step."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxsys.core.bench import compile_count
from jaxsys.core.errors import ConfigError
from jaxsys.models.llm.decoder import random_model
from jaxsys.models.llm.drafter import DrafterConfig, EagleDrafter
from jaxsys.rl import grpo, policy as pol, tasks
from jaxsys.speculative import online
from jaxsys.speculative.bandit import Strategy
from jaxsys.speculative.engine import RolloutConfig, RolloutEngine
from jaxsys.decoding.sampling import GREEDY, SamplingParams

PCFG = pol.policy_config(hidden=16, layers=1)


def test_group_advantages():
  r = np.array([[1.0, 0.0, 0.5, 0.5], [2.0, 2.0, 2.0, 2.0]])
  a = np.asarray(grpo.group_advantages(r))
  np.testing.assert_allclose(a[0], (r[0] - 0.5) / (r[0].std() + 1e-6), rtol=1e-5)
  np.testing.assert_allclose(a[1], 0.0)


def test_surrogate_clipping_and_kl():
  model = random_model(PCFG, 0)
  tokens = jax.random.randint(jax.random.key(0), (2, 6), 0, tasks.VOCAB)
  mask = jnp.ones((2, 5))
  logp = nnx.jit(grpo.token_logprobs)(model, tokens)
  adv = jnp.array([1.0, -2.0])
  loss_fn = nnx.jit(grpo.grpo_loss, static_argnums=(6, 7))
  # ratio 1, reference == policy: objective = mean advantage, KL = 0.
  loss, aux = loss_fn(model, tokens, mask, adv, logp, logp, 0.2, 0.1)
  np.testing.assert_allclose(float(loss), -float(adv.mean()), rtol=1e-5)
  assert abs(float(aux["kl"])) < 1e-6
  # ratio e (old much less likely): clipped at 1.2 for A > 0, unclipped e * A for A < 0 (min).
  loss, aux = loss_fn(model, tokens, mask, adv, logp - 1.0, logp, 0.2, 0.0)
  np.testing.assert_allclose(float(loss), -(1.2 * 1.0 + np.e * -2.0) / 2, rtol=1e-5)
  assert float(aux["clip_frac"]) == 1.0
  # k3 KL is positive when the reference differs.
  _, aux = loss_fn(model, tokens, mask, adv, logp, logp + 0.3, 0.2, 0.1)
  np.testing.assert_allclose(float(aux["kl"]), np.exp(0.3) - 0.3 - 1, rtol=1e-5)


def test_tasks_and_rewards():
  s = tasks.TaskSampler(long_fraction=0.5, seed=0)
  exs = s.sample(200)
  spans = [len(e.answer) for e in exs if e.kind == "count"]
  assert max(spans) >= 24 and min(spans) <= 6  # long tail present
  ex = tasks.count_example(3, 6)
  assert tasks.reward(ex, [3, 4, 5, 6, tasks.EOS]) == 1.0
  assert tasks.reward(ex, [3, 4, 9, 6, tasks.EOS]) == 0.8
  assert tasks.reward(ex, [3, 4, 5, 6, 7, 8]) == pytest.approx(4 / 6)
  assert tasks.reward(tasks.add_example(3, 4), [7, tasks.EOS]) == 1.0
  with pytest.raises(ConfigError, match="count task"):
    tasks.count_example(5, 2)
  tok, mask = tasks.sft_batch([ex], 10)
  assert mask[0].sum() == 5 and tok[0, 3] == tasks.SEP


def test_config_errors():
  with pytest.raises(ConfigError, match="group_size"):
    grpo.GRPOConfig(group_size=1)
  with pytest.raises(ConfigError, match="clip_eps"):
    grpo.GRPOConfig(clip_eps=1.5)
  with pytest.raises(ConfigError, match="minibatches"):
    grpo.GRPOConfig(group_size=3, prompts_per_step=1, minibatches=2)


@pytest.mark.parametrize("synchronous", [False, True], ids=["background", "between_rollouts"])
def test_trainer_steps_with_spot_drafter_training(synchronous):
  policy = random_model(PCFG, 0)
  drafter = EagleDrafter(DrafterConfig.for_target(PCFG), rngs=nnx.Rngs(1))
  engine = RolloutEngine(policy, drafter, RolloutConfig(
      strategies=(Strategy.chain(2),), max_new=6, max_prompt=8, batch_buckets=(8,), spec_threshold=9,
      stop_tokens=(tasks.EOS,), sampling=SamplingParams(1.0)))
  buffer = online.DrafterBuffer()
  dtr = online.DrafterTrainer(drafter, batch=4, seq_len=16)
  if synchronous:  # warm_up compiles the update and leaves parameters and sample stream as they were
    buffer.add(-1, [np.arange(6)], [np.ones((6, PCFG.hidden_size), np.float32)], [2])
    params, rng_state = jax.device_get(dtr.params), buffer.rng.bit_generator.state
    dtr.warm_up(policy, buffer)
    jax.tree.map(np.testing.assert_array_equal, params, jax.device_get(dtr.params))
    assert dtr.steps_done == 0 and buffer.rng.bit_generator.state == rng_state
  spot = online.SpotTrainer(dtr, buffer, max_steps=2, synchronous=synchronous)
  tr = grpo.GRPOTrainer(policy, engine, tasks.TaskSampler(seed=0), grpo.GRPOConfig(group_size=2, prompts_per_step=4),
                        buffer=buffer, spot=spot)
  before = jax.device_get(tr.params)
  dstate_before = jax.device_get(engine.dstate)
  m1 = tr.step()
  m2 = tr.step()
  assert len(m1["responses"]) == 8 and np.isfinite(m2["loss"])
  assert m1["spec_steps"] + m2["spec_steps"] > 0  # the long tail was speculative
  changed = jax.tree.map(lambda a, b: bool(np.any(a != b)), before, jax.device_get(tr.params))
  assert any(jax.tree.leaves(changed))  # policy updated
  # weights were synced into the engine
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(nnx.state(tr.policy, nnx.Param)),
               jax.device_get(nnx.state(nnx.merge(engine.gdef, engine.tstate), nnx.Param)))
  # the drafter trained (during the long tail, or 2 steps after each rollout) and was swapped in
  if synchronous:
    assert spot.steps_per_rollout == [2, 2] and m1["drafter_seconds"] > 0
  assert sum(spot.steps_per_rollout) > 0
  dchanged = jax.tree.map(lambda a, b: bool(np.any(a != b)), dstate_before, jax.device_get(engine.dstate))
  assert any(jax.tree.leaves(dchanged))
  with pytest.raises(ConfigError, match="sampled rollouts"):
    grpo.GRPOTrainer(policy, RolloutEngine(policy, drafter, RolloutConfig(max_prompt=8, sampling=GREEDY)),
                     tasks.TaskSampler(), grpo.GRPOConfig())


def test_long_tail_mix_for_the_tiny_lm():
  from jaxsys.data import synthetic
  mix = tasks.LongTailMix(long_fraction=0.25, long_copy=(40, 50), seed=0)
  exs = mix.sample(200)
  long = [e for e in exs if e.task == "copy"]
  assert 25 <= len(long) <= 75 and {e.task for e in exs} == {"copy", "arith", "recall"}
  assert all(41 <= len(e.answer) <= 51 for e in long)  # copied tokens + EOS
  assert max(len(e.answer) for e in exs if e.task != "copy") <= 4  # short answers
  assert max(len(e.prompt) for e in exs) <= mix.max_prompt
  assert max(len(e.answer) for e in exs) <= mix.max_response
  assert synthetic.reward(long[0], list(long[0].answer)) == 1.0
  assert tasks.LongTailMix(seed=3).sample(5) == tasks.LongTailMix(seed=3).sample(5)  # by seed
  with pytest.raises(ConfigError, match="long_fraction"):
    tasks.LongTailMix(long_fraction=2.0)


def test_build_batch_pad_and_custom_reward():
  from jaxsys.data import synthetic
  ex = synthetic.make_example("arith", np.random.default_rng(0))
  tok, mask = grpo.build_batch([ex], [list(ex.answer)], 16, pad=synthetic.VOCAB.pad)
  n = len(ex.prompt) + len(ex.answer)
  assert (tok[0, n:] == synthetic.VOCAB.pad).all() and mask[0].sum() == len(ex.answer)


def test_length_grouped_minibatches_are_exact_and_precompiled():
  policy = random_model(PCFG, 0)
  engine = RolloutEngine(policy, None, RolloutConfig(max_new=6, max_prompt=8, batch_buckets=(8,),
                                                    stop_tokens=(tasks.EOS,), sampling=SamplingParams(1.0),
                                                    speculative=False))
  cfg = grpo.GRPOConfig(group_size=2, prompts_per_step=4, minibatches=2, length_bucket=8)
  tr = grpo.GRPOTrainer(policy, engine, tasks.TaskSampler(seed=0), cfg)
  lengths = np.array([3, 14, 5, 9, 4, 13, 6, 7])
  groups = tr._minibatches(lengths)
  assert sorted(np.concatenate([g for g, _ in groups]).tolist()) == list(range(8))  # a partition
  widths = {tuple(sorted(lengths[g])): w for g, w in groups}
  assert widths == {(3, 4, 5, 6): 8, (7, 9, 13, 14): 14}  # length-sorted; rounded up to 8, capped at 14
  # Cutting padding off is exact: the loss of a short batch is the same at its width and at 14.
  tokens = jax.random.randint(jax.random.key(1), (4, 14), 0, tasks.VOCAB)
  mask = jnp.zeros((4, 13)).at[:, 2:7].set(1.0)
  adv = jnp.array([1.0, -1.0, 0.5, 0.0])
  loss_fn = nnx.jit(grpo.grpo_loss, static_argnums=(6, 7))
  logp = nnx.jit(grpo.token_logprobs)(policy, tokens)
  full = loss_fn(policy, tokens, mask, adv, logp - 0.1, logp, 0.2, 0.1)[0]
  cut = loss_fn(policy, tokens[:, :8], mask[:, :7], adv, logp[:, :7] - 0.1, logp[:, :7], 0.2, 0.1)[0]
  np.testing.assert_allclose(float(cut), float(full), rtol=1e-5)
  # After precompile() no step compiles the update again (any width).
  assert tr.precompile() == 2  # widths 8 and 14
  engine.precompile()
  tr.step()
  n0 = compile_count()
  tr.step()
  tr.step()
  n_compiles = compile_count() - n0
  assert not n_compiles
  with pytest.raises(ConfigError, match="length_bucket"):
    grpo.GRPOConfig(length_bucket=-1)


def test_remat_update_equals_plain_update():
  """``GRPOConfig.remat`` changes memory, not numbers: the same step from the same weights."""
  def trainer(remat):
    policy = random_model(PCFG, 0)
    engine = RolloutEngine(policy, None, RolloutConfig(max_new=6, max_prompt=8, batch_buckets=(8,),
                                                      stop_tokens=(tasks.EOS,),
                                                      sampling=SamplingParams(1.0), speculative=False))
    cfg = grpo.GRPOConfig(group_size=2, prompts_per_step=4, length_bucket=8, kl_coef=0.0, remat=remat)
    return grpo.GRPOTrainer(policy, engine, tasks.TaskSampler(seed=0), cfg)

  plain, remat = trainer(False), trainer(True)
  assert plain.ref_params is None            # kl_coef = 0: no reference copy is kept
  assert plain.train_gdef is plain.gdef and remat.train_gdef is not remat.gdef
  tokens = jax.random.randint(jax.random.key(2), (4, 14), 0, tasks.VOCAB)
  mask = jnp.zeros((4, 13)).at[:, 5:].set(1.0)
  adv = jnp.array([1.0, -1.0, 0.5, -0.5])
  out = []
  for tr in (plain, remat):
    old, ref = tr._logps(tokens)
    params, _, aux = tr._update(tr.train_gdef, tr.params, tr.rest, tr.opt_state, tokens, mask, adv,
                                old - 0.05, ref)
    out.append((params, float(aux["loss"])))
  assert out[0][1] == pytest.approx(out[1][1], rel=1e-5)
  moved = 0.0
  for a, b, c in zip(jax.tree.leaves(out[0][0]), jax.tree.leaves(out[1][0]),
                     jax.tree.leaves(plain.params), strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)
    moved = max(moved, float(jnp.abs(a - c).max()))
  assert moved > 0                           # the update did move the weights
  plain.step()                               # and a whole step runs with a rematerialised update
  remat.step()


def test_sharded_grpo_with_tp_rollouts_equals_one_device():
  """The update on an FSDP data=4 x model=2 mesh, rollouts on a TP=2 engine: the same responses,
  losses and weights as one device (2 steps, sampled rollouts)."""
  from jaxsys.core.mesh import make_mesh

  def run(mesh, engine_mesh):
    policy = random_model(PCFG, 0)
    engine = RolloutEngine(policy, None, RolloutConfig(max_new=6, max_prompt=8, batch_buckets=(8,),
                           stop_tokens=(tasks.EOS,), sampling=SamplingParams(1.0), speculative=False),
                           mesh=engine_mesh)
    tr = grpo.GRPOTrainer(policy, engine, tasks.TaskSampler(seed=0),
                          grpo.GRPOConfig(group_size=2, prompts_per_step=4, kl_coef=0.05), mesh=mesh)
    steps = [tr.step() for _ in range(2)]
    devices = {len(x.sharding.device_set) for x in jax.tree.leaves(tr.params)}
    assert devices == ({1} if mesh is None else {8})  # the update's state lies on the whole mesh
    return steps, jax.device_get(nnx.to_pure_dict(tr.params))

  ref, ref_params = run(None, None)
  got, params = run(jax.make_mesh((4, 2), ("data", "model")), make_mesh({"model": 2}))
  for a, b in zip(ref, got):
    assert a["responses"] == b["responses"]
    np.testing.assert_allclose(b["loss"], a["loss"], rtol=1e-4, atol=1e-6)
  jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, atol=1e-5), params, ref_params)
  with pytest.raises(ConfigError, match="does not divide over the mesh's data=8"):
    grpo.GRPOTrainer(random_model(PCFG, 0), RolloutEngine(random_model(PCFG, 0), None, RolloutConfig(
        max_new=6, max_prompt=8, batch_buckets=(8,), sampling=SamplingParams(1.0), speculative=False)),
        tasks.TaskSampler(seed=0), grpo.GRPOConfig(group_size=2, prompts_per_step=2), mesh=make_mesh({"data": 8}))
