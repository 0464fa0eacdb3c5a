"""EAGLE drafter: shapes, shared frozen head, loss, online training, orbax round trip, errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxsys.core.errors import ConfigError, InputError, ShapeError
from jaxsys.models import DecoderConfig
from jaxsys.models.llm.decoder import random_model
from jaxsys.models.llm.drafter import (DrafterConfig, EagleDrafter, check_compatible, drafter_loss,
                                   top_token_ids)
from jaxsys.speculative import online

CFG = DecoderConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=2, num_heads=2)


@pytest.fixture(scope="module")
def models():
  return random_model(CFG, 0), EagleDrafter(DrafterConfig.for_target(CFG), rngs=nnx.Rngs(1))


def _data(target, b=4, s=12, seed=0):
  tokens = jax.random.randint(jax.random.key(seed), (b, s), 0, CFG.vocab_size)
  h = nnx.jit(lambda t, x: t.forward_hidden(x)[0])(target, tokens)
  mask = jnp.zeros((b, s)).at[:, 3:-1].set(1.0)
  return tokens, h, mask


_loss = nnx.jit(drafter_loss)


def test_shapes_and_shared_head(models):
  target, drafter = models
  tokens, feats, mask = _data(target)
  pred, lg, ref = nnx.jit(lambda d, t, x, f: (lambda p: (p, d.logits(t, p), t.logits(p)))(d(t, x, f)))(
      drafter, target, tokens[:, 1:], feats[:, :-1])
  assert pred.shape == feats[:, 1:].shape
  np.testing.assert_allclose(np.asarray(lg), np.asarray(ref))
  # The drafter holds no embedding / LM head of its own.
  n_params = sum(x.size for x in jax.tree.leaves(nnx.state(drafter, nnx.Param)))
  assert n_params < CFG.vocab_size * CFG.hidden_size * 2 + 6 * CFG.hidden_size ** 2 + 4 * CFG.hidden_size * 32


def test_loss_masks_and_trains(models):
  target, drafter = models
  tokens, feats, mask = _data(target)
  loss, m = _loss(drafter, target, tokens, feats, mask)
  assert np.isfinite(float(loss)) and float(m["ce_loss"]) > 0
  # Positions outside the mask do not matter.
  feats2 = feats.at[:, :2].set(0.0)  # only predictions at masked positions 3.. are scored
  loss_zero, _ = _loss(drafter, target, tokens, feats2, jnp.zeros_like(mask))
  assert float(loss_zero) == 0.0
  buffer = online.DrafterBuffer(max_steps=2)
  buffer.add(0, np.asarray(tokens), np.asarray(feats), [3] * 4)
  trainer = online.DrafterTrainer(nnx.merge(*nnx.split(drafter)), lr=1e-2, batch=4, seq_len=12)
  tstate_before = jax.device_get(nnx.state(target))
  first = trainer.train(target, buffer, 1)["loss"]
  last = trainer.train(target, buffer, 30)["loss"]
  assert last < 0.7 * first
  # The target (shared embedding / head) is untouched by drafter training.
  jax.tree.map(np.testing.assert_array_equal, tstate_before, jax.device_get(nnx.state(target)))


def test_buffer_keeps_last_steps():
  buf = online.DrafterBuffer(max_steps=2)
  for step in range(3):
    buf.add(step, [np.full(5, step)], [np.zeros((5, 4))], [2])
  assert [s for s, _ in buf.steps] == [1, 2]
  tokens, feats, mask = buf.sample(3, 8)
  assert set(np.unique(tokens[:, :5])) <= {1, 2}
  np.testing.assert_array_equal(mask[0], [0, 1, 1, 1, 0, 0, 0, 0])


def test_checkpoint_roundtrip(models, tmp_path):
  _, drafter = models
  online.save_drafter(tmp_path / "d", drafter)
  back = online.load_drafter(tmp_path / "d", drafter.config)
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(nnx.state(drafter)), jax.device_get(nnx.state(back)))
  # through the verified checkpointer: a hashed manifest, and a corrupted file is refused
  from jaxsys.core.checkpoint import Checkpointer
  assert Checkpointer(tmp_path / "d").verify(0) is None
  data = max((f for f in (tmp_path / "d" / "0").rglob("*") if f.is_file() and f.name != "MANIFEST.json"),
             key=lambda f: f.stat().st_size)
  data.write_bytes(data.read_bytes()[:-8] + b"\0" * 8)
  with pytest.raises(InputError, match="no intact checkpoint|not intact"):
    online.load_drafter(tmp_path / "d", drafter.config)


def test_non_finite_drafter_is_never_saved(models, tmp_path):
  _, drafter = models
  bad = nnx.clone(drafter)
  leaf = jax.tree.leaves(nnx.state(bad, nnx.Param))[0]
  nnx.update(bad, jax.tree.map(lambda x: x.at[...].set(jnp.nan) if x is leaf else x, nnx.state(bad, nnx.Param)))
  with pytest.raises(InputError, match="non-finite"):
    online.save_drafter(tmp_path / "nan", bad)
  assert not (tmp_path / "nan" / "0").exists()


def _abstract_drafter(**kw):
  return nnx.eval_shape(lambda: EagleDrafter(DrafterConfig.for_target(CFG, **kw), rngs=nnx.Rngs(0)))


def test_incompatible_drafter_errors(models):
  target, drafter = models
  with pytest.raises(ShapeError, match="vocab_size=31 must equal"):
    check_compatible(_abstract_drafter(vocab_size=31), target)
  with pytest.raises(ShapeError, match="hidden_size=8 must equal"):
    check_compatible(_abstract_drafter(hidden_size=8), target)
  with pytest.raises(ConfigError, match="num_heads"):
    DrafterConfig.for_target(CFG, num_heads=3)
  with pytest.raises(ShapeError, match="must share"):
    drafter_loss(drafter, target, jnp.zeros((2, 5), jnp.int32), jnp.zeros((2, 4, 16)), jnp.zeros((2, 5)))


def test_config_derives_the_block_from_the_target():
  target = DecoderConfig(vocab_size=32, hidden_size=16, intermediate_size=24, num_layers=3,
                         num_heads=4, num_kv_heads=2, qkv_bias=True, sliding_window=8, arch="qwen2")
  dc = DrafterConfig.for_target(target, ce_weight=0.5)
  assert dc.layer.num_layers == 1 and dc.ce_weight == 0.5
  for name in ("vocab_size", "hidden_size", "num_heads", "num_kv_heads", "head_dim",
               "intermediate_size", "rope", "rms_norm_eps"):
    assert getattr(dc, name) == getattr(target, name) == getattr(dc.layer, name)
  # only the shapes are taken over: the draft block is a plain pre-norm layer
  assert not dc.layer.qkv_bias and dc.layer.sliding_window is None and dc.layer.arch == "llama"
  assert DrafterConfig.for_target(target, head_dim=8).head_dim == 8
  with pytest.raises(ConfigError, match="not drafter fields"):
    DrafterConfig.for_target(target, num_layers=2)
  with pytest.raises(ConfigError, match="layer.num_layers=3 must be 1"):
    DrafterConfig(target)
  with pytest.raises(ConfigError, match="smooth_l1_beta"):
    DrafterConfig.for_target(target, smooth_l1_beta=0.0)


@pytest.mark.parametrize("tied", [False, True], ids=["own_head", "tied"])
def test_reduced_draft_vocab_maps_back_to_target_ids(tied, tmp_path):
  """draft_vocab=K: the K most frequent response tokens; draft logits are the target's logits at
  those ids (gathered head rows), draft index i is target id draft_ids[i]; checkpoints keep them."""
  import dataclasses
  target = random_model(dataclasses.replace(CFG, tie_embeddings=tied), 0)
  assert (target.lm_head is None) == tied
  seqs = [np.array([9, 9, 3, 3, 3, 7, 1]), np.array([9, 5, 3, 7])]
  ids = top_token_ids(seqs, 4, CFG.vocab_size, prompt_lengths=[2, 1])
  # responses: [3, 3, 3, 7, 1] and [5, 3, 7] -> 3 (x4), 7 (x2), then 1 and 5 (ties: lower id)
  np.testing.assert_array_equal(ids, [3, 7, 1, 5])
  drafter = EagleDrafter(DrafterConfig.for_target(CFG, draft_vocab=4), rngs=nnx.Rngs(1))
  drafter.set_draft_vocab(ids)
  _, feats, _ = _data(target)
  lg, full, back = nnx.jit(lambda d, t, f: (d.draft_logits(t, f), t.logits(f),
                                            d.to_target(jnp.arange(4))))(drafter, target, feats)
  assert lg.shape == feats.shape[:2] + (4,)
  np.testing.assert_allclose(np.asarray(lg), np.asarray(full)[..., ids], rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(np.asarray(back), ids)
  online.save_drafter(tmp_path / "d", drafter)
  np.testing.assert_array_equal(
      np.asarray(online.load_drafter(tmp_path / "d", drafter.config).draft_ids[...]), ids)
  # without a reduced vocabulary both are the identity on the full head
  plain = EagleDrafter(DrafterConfig.for_target(CFG), rngs=nnx.Rngs(1))
  np.testing.assert_allclose(np.asarray(plain.draft_logits(target, feats)), np.asarray(full))


def test_reduced_draft_vocab_errors():
  with pytest.raises(ConfigError, match="draft_vocab=33 must be in \\[1, 32\\]"):
    DrafterConfig.for_target(CFG, draft_vocab=CFG.vocab_size + 1)
  with pytest.raises(ConfigError, match="k=0 must be in"):
    top_token_ids([np.arange(4)], 0, CFG.vocab_size)
  drafter = EagleDrafter(DrafterConfig.for_target(CFG, draft_vocab=4), rngs=nnx.Rngs(1))
  with pytest.raises(ConfigError, match="4 distinct token ids"):
    drafter.set_draft_vocab([1, 1, 2, 3])
  with pytest.raises(ConfigError, match="draft_vocab"):
    EagleDrafter(DrafterConfig.for_target(CFG), rngs=nnx.Rngs(1)).set_draft_vocab([1, 2, 3, 4])
