"""Video GRPO (MR-SP): cached == recomputed log-probs, cached_sp == single device (log-probs and
gradients, 8 simulated devices), one encoder run per video per step, a shared rollout prefill,
and clear errors for frame counts the sharding cannot split and over-long responses."""

import jax
import numpy as np
import pytest
from flax import nnx

from jaxsys.core.errors import ConfigError, InputError, ShapeError
from jaxsys.core.mesh import make_mesh
from jaxsys.data import video
from jaxsys.models import DecoderConfig
from jaxsys.models.vlm import VLM, VLMConfig
from jaxsys.rl import video_grpo as vg
from jaxsys.rl import video_tasks as vt

CFG = VLMConfig(lm=DecoderConfig(vocab_size=vt.VOCAB, hidden_size=32, intermediate_size=64, num_layers=1,
                                 num_heads=8, num_kv_heads=8))
SPEC = video.VideoSpec()
RESP = [[1, 2, video.EOS], [3, video.EOS]]


@pytest.fixture(scope="module")
def setup():
  model = VLM(CFG, rngs=nnx.Rngs(0))
  examples = vt.VideoTaskSampler(SPEC, n_frames=8, seed=3).sample(2)
  return model, examples


def _trainer(model, mode, **kw):
  mesh = make_mesh({"ulysses": 8}) if mode == "cached_sp" else None
  return vg.VideoGRPOTrainer(model, vt.VideoTaskSampler(SPEC, n_frames=8, seed=0),
                             vg.VideoGRPOConfig(mode=mode, **kw), mesh=mesh)


def test_cached_logprobs_equal_recomputed(setup):
  model, ex = setup
  cached = np.asarray(_trainer(model, "cached").logprobs(ex, RESP))
  recomputed = np.asarray(_trainer(model, "recompute").logprobs(ex, RESP))
  np.testing.assert_allclose(cached, recomputed, atol=1e-6)
  assert cached.shape == (2, 3) and np.all(cached[0] < 0)


def test_cached_sp_logprobs_and_grads_equal_single_device(setup):
  model, ex = setup
  one, sp = _trainer(model, "cached"), _trainer(model, "cached_sp")
  r1, r8 = one.layout().response, sp.layout().response
  assert sp.layout().length % 8 == 0 and r8 > r1
  adv = np.array([1.0, -0.5], np.float32)
  old = np.full((2, r8), -2.9, np.float32)   # ratios around 1 +- 0.2: some tokens clip
  (l1, a1), g1 = one.loss_and_grads(ex, RESP, adv, old[:, :r1], old[:, :r1] + 0.1)
  (l8, a8), g8 = sp.loss_and_grads(ex, RESP, adv, old, old + 0.1)
  np.testing.assert_allclose(np.asarray(a8["logp"])[:, :r1], np.asarray(a1["logp"]), atol=1e-5)
  np.testing.assert_allclose(float(l8), float(l1), rtol=1e-5)
  assert 0 < float(a1["clip_frac"]) < 1
  errs = jax.tree.leaves(jax.tree.map(lambda a, b: float(np.max(np.abs(np.asarray(a) - np.asarray(b)))), g8, g1))
  assert max(errs) < 1e-5
  assert "encoder" not in g1 and "lm" in g1  # the vision tower is frozen: only LM parameters train
  assert float(sum(np.abs(np.asarray(x)).sum() for x in jax.tree.leaves(g1))) > 0


def test_encoder_once_per_video_and_shared_prefill(setup):
  model, _ = setup
  t = _trainer(model, "cached")
  n, g = t.config.grpo.prompts_per_step, t.config.grpo.group_size
  ex = t.tasks.sample(n)
  p0 = t.params
  m = t.step(ex)
  # the rollout (prefilled from embeddings) and the passes see the same context
  lp = np.asarray(t.logprobs(ex, m["responses"], params=p0, rows=np.repeat(np.arange(n), g)))
  for i, want in enumerate(t.rollout_logprobs):
    np.testing.assert_allclose(lp[i, :len(want)], want, atol=1e-5)
  assert m["encoded_videos"] == n           # rollout, old, ref and update passes share one encoding
  assert t.prefill_rows == [n]              # one prefill per prompt, shared by its G rollouts
  assert len(m["responses"]) == n * g and all(len(r) <= t.config.max_new for r in m["responses"])
  assert np.isfinite(m["loss"]) and 0.0 <= m["reward_mean"] <= 1.0
  # the baseline re-encodes every row in the old, reference and update passes
  sub = _trainer(model, "cached", rollout_frames=4)   # the rollout sees 4 of the 8 frames
  sub.rollout(ex, sub.encode(np.stack([e.frames for e in ex])), seed=0)
  assert sub.prefill_rows == [n] and sub.encoded_videos == n
  b = _trainer(model, "recompute")
  b.logprobs(vt.VideoTaskSampler(SPEC, n_frames=8).sample(2), RESP * 2, rows=[0, 0, 1, 1])
  assert b.encoded_videos == 4


def test_bad_input(setup):
  model, ex = setup
  sp = _trainer(model, "cached_sp")
  with pytest.raises(ShapeError, match="divisible by the sequence-parallel degree 8"):
    sp.layout(5)                              # 10 frame tokens cannot split over 8 ranks
  lay = vg.RowLayout(8, 2, max_new=3)
  with pytest.raises(InputError, match="response budget max_new=3"):
    vg.build_rows(lay, ex, [[1, 2, 3, video.EOS], [1]])
  with pytest.raises(ConfigError, match="mesh="):
    vg.VideoGRPOTrainer(model, vt.VideoTaskSampler(SPEC), vg.VideoGRPOConfig(mode="cached_sp"))
  with pytest.raises(ConfigError, match="mode"):
    vg.VideoGRPOConfig(mode="fast")


def test_tasks_and_rewards():
  s = vt.VideoTaskSampler(SPEC, n_frames=12, seed=0)
  exs = s.sample(12)
  assert {e.kind for e in exs} == set(vt.KINDS)
  for e in exs:
    assert e.frames.shape == (12, SPEC.patches, SPEC.patch_dim)
    assert vt.reward(e, list(e.target)) == pytest.approx(1.0)
    assert vt.reward(e, [9, 9, 9]) == 0.0 or e.answer == (9, 9)
  e = exs[0]
  assert vt.reward(e, list(e.answer)) == pytest.approx(0.9)   # right answer, no EOS: no format term
  wrong = [(e.answer[0] + 1) % 10] + list(e.answer[1:]) + [video.EOS]
  assert vt.reward(e, wrong) == pytest.approx(0.1)             # well formed, wrong answer
  c = [x for x in exs if x.kind == "count"][0]
  marked = np.sum(np.abs(c.frames - vt.video.haystack_frames(SPEC, np.random.default_rng(1), 12)).sum((1, 2)) > 0)
  assert 1 <= c.answer[0] <= 9 and marked >= 1


@pytest.mark.parametrize("kind", ["explicit", "auto"])
def test_cached_sp_on_jax_make_mesh(setup, kind):
  """cached_sp on meshes from ``jax.make_mesh``: Explicit axes (JAX's default) and Auto ones."""
  from jax.sharding import AxisType
  model, ex = setup
  types = {} if kind == "explicit" else {"axis_types": (AxisType.Auto,)}
  mesh = jax.make_mesh((8,), ("ulysses",), **types)
  sp = vg.VideoGRPOTrainer(model, vt.VideoTaskSampler(SPEC, n_frames=8, seed=0),
                           vg.VideoGRPOConfig(mode="cached_sp"), mesh=mesh)
  one = _trainer(model, "cached")
  r1 = one.layout().response
  np.testing.assert_allclose(np.asarray(sp.logprobs(ex, RESP))[:, :r1], np.asarray(one.logprobs(ex, RESP)),
                             atol=1e-5)


def test_cached_sp_on_one_device(setup):
  model, ex = setup
  sp = vg.VideoGRPOTrainer(model, vt.VideoTaskSampler(SPEC, n_frames=8, seed=0),
                           vg.VideoGRPOConfig(mode="cached_sp"), mesh=make_mesh({"ulysses": 1}, jax.devices()[:1]))
  one = _trainer(model, "cached")
  r1 = one.layout().response
  np.testing.assert_allclose(np.asarray(sp.logprobs(ex, RESP))[:, :r1], np.asarray(one.logprobs(ex, RESP)),
                             atol=1e-5)


def _device_bytes(tree) -> int:
  return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree))


@pytest.mark.parametrize("kind", ["explicit", "auto"])
def test_cached_sp_inside_fsdp(setup, kind):
  """MR-SP's Ulysses SP inside FSDP (``data=2 x ulysses=4``, rules "fsdp"): the LM's parameters
  and Adam moments are split over "data", the update's loss and gradients equal one device's,
  and a row count "data" does not divide is a clear error."""
  from jax.sharding import AxisType
  model, ex = setup
  types = {} if kind == "explicit" else {"axis_types": (AxisType.Auto,) * 2}
  mesh = jax.make_mesh((2, 4), ("data", "ulysses"), **types)
  fs = vg.VideoGRPOTrainer(model, vt.VideoTaskSampler(SPEC, n_frames=8, seed=0),
                           vg.VideoGRPOConfig(mode="cached_sp"), mesh=mesh)
  one = _trainer(model, "cached")
  assert fs.params["lm"]["layers"][0]["attn"]["wq"][...].sharding.spec == jax.sharding.PartitionSpec("data")
  assert _device_bytes((fs.params, fs.opt_state)) < 0.55 * _device_bytes((one.params, one.opt_state))
  r1, r4 = one.layout().response, fs.layout().response
  adv = np.array([1.0, -0.5], np.float32)
  old = np.full((2, r4), -2.9, np.float32)
  (l1, a1), g1 = one.loss_and_grads(ex, RESP, adv, old[:, :r1], old[:, :r1] + 0.1)
  (l4, a4), g4 = fs.loss_and_grads(ex, RESP, adv, old, old + 0.1)
  np.testing.assert_allclose(np.asarray(a4["logp"])[:, :r1], np.asarray(a1["logp"]), atol=1e-5)
  np.testing.assert_allclose(float(l4), float(l1), rtol=1e-5)
  errs = jax.tree.leaves(jax.tree.map(lambda a, b: float(np.max(np.abs(np.asarray(a) - np.asarray(b)))), g4, g1))
  assert max(errs) < 1e-5
  with pytest.raises(ShapeError, match="1 rows do not divide over the mesh's data=2 axis"):
    fs.logprobs(ex[:1], RESP[:1])


def test_fsdp_steps_compile_the_update_once(setup):
  """The optimizer state starts where the update leaves it (moments beside their parameters, the
  step count replicated on the mesh), so the second step reuses the first step's program."""
  model, _ = setup
  fs = vg.VideoGRPOTrainer(model, vt.VideoTaskSampler(SPEC, n_frames=8, seed=0),
                           vg.VideoGRPOConfig(mode="cached"), mesh=make_mesh({"data": 2}))
  fs.step()
  compiled = vg._update_jit._cache_size()
  m = fs.step()
  assert vg._update_jit._cache_size() == compiled and np.isfinite(m["loss"])
  assert all(isinstance(x.sharding, jax.sharding.NamedSharding) for x in jax.tree.leaves(fs.opt_state))


def test_evaluate_greedy_and_sampled(setup):
  """Greedy: one answer per example; sampled: G answers per example, ``hits`` their mean, and
  the mean reward equals the rewards of those samples (re-drawn with the same seed)."""
  model, _ = setup
  t = _trainer(model, "cached")
  held = vt.VideoTaskSampler(SPEC, n_frames=8, seed=9).sample(3)
  greedy, sampled = t.evaluate(held), t.evaluate(held, sampled=True, seed=4)
  assert greedy["hits"].shape == sampled["hits"].shape == (3,)
  assert set(np.unique(greedy["hits"])) <= {0.0, 1.0}
  resp = t.rollout(held, t.encode(np.stack([e.frames for e in held])), seed=4)
  g = t.config.grpo.group_size
  assert len(resp) == 3 * g
  want = np.mean([vt.reward(held[i // g], r) for i, r in enumerate(resp)])
  assert sampled["reward"] == pytest.approx(want)
  assert sampled["accuracy"] == pytest.approx(sampled["hits"].mean())


def test_pretrain_stops_when_until_holds():
  """``until`` is checked every ``check_every`` steps and ends the warm-up at the first True."""
  calls = []
  model = VLM(CFG, rngs=nnx.Rngs(1))
  tasks = vt.VideoTaskSampler(SPEC, n_frames=8, seed=0)
  _, loss = vg.pretrain_video_policy(model, tasks, steps=40, batch=2, check_every=3,
                                     until=lambda m: calls.append(m) or len(calls) == 2)
  assert len(calls) == 2 and isinstance(calls[0], VLM) and np.isfinite(loss)
  with pytest.raises(ConfigError, match="check_every=0 must be >= 1"):
    vg.pretrain_video_policy(model, tasks, steps=4, check_every=0)
