"""LoRA adapters (``jaxsys.nn.lora``) and freezing by path through the one train loop: W' = W at
step 0, only adapters trained (optimizer state for them alone), merge equals the adapter model,
adapters saved and loaded alone, FSDP on an Explicit mesh equals one device, clear errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxsys.models as M
from jaxsys import train as T
from jaxsys.core.errors import ConfigError
from jaxsys.data import synthetic as S
from jaxsys.nn.lora import (LoRAConfig, LoRAParam, LoRAWeight, apply_lora, load_lora_state, lora_state,
                            merge_lora, trainable_filter)

CFG = M.DecoderConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2,
                      num_heads=8, num_kv_heads=4, max_position_embeddings=64)
TRAIN = T.TrainConfig(learning_rate=1e-2, warmup_steps=0, total_steps=4, log_every=1)
TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, 128, (2, 12)), jnp.int32)


def batches(step):
  return S.training_batch({"copy": 1.0}, seed=0, step=step, batch_size=8, length=24)


def _lora_model(seed=3, **kw):
  model = M.random_model(CFG, seed=seed)
  names = apply_lora(model, LoRAConfig(rank=4, alpha=8, **kw), rngs=nnx.Rngs(1))
  return model, names


def _params(model, kind=nnx.Param):
  return jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model, kind)))


def test_adapters_start_at_the_base_model_and_merge_exactly():
  base = M.random_model(CFG, seed=3)
  model, names = _lora_model()
  # every projection of both layers: q, k, v, o and the three MLP maps
  assert len(names) == 2 * 7 and not any("embed" in n for n in names), names
  np.testing.assert_array_equal(model(TOKENS), base(TOKENS))  # B = 0
  for _, m in nnx.iter_graph(model):  # a non-zero update, as after training
    if isinstance(m, LoRAWeight):
      m.lora_b[...] = 0.05 * jax.random.normal(jax.random.key(2), m.lora_b[...].shape)
  adapted = model(TOKENS)
  assert float(jnp.max(jnp.abs(adapted - base(TOKENS)))) > 1e-3
  assert merge_lora(model) == len(names)
  assert not nnx.state(model, LoRAParam)
  np.testing.assert_allclose(model(TOKENS), adapted, atol=1e-5)


def test_training_updates_the_adapters_only():
  model, _ = _lora_model()
  before = _params(model)
  res = T.train(model, batches, TRAIN, progress=False)
  assert res.history[-1]["loss"] < res.history[0]["loss"]
  after = _params(model)
  flat_b, flat_a = jax.tree_util.tree_flatten_with_path(before)[0], jax.tree.leaves(after)
  changed = {jax.tree_util.keystr(p) for (p, x), y in zip(flat_b, flat_a) if not np.array_equal(x, y)}
  assert changed and all("lora_" in c for c in changed), sorted(changed)[:4]
  # optimizer state: two AdamW moments of the adapters, a few percent of full fine-tuning's
  n_lora = sum(x.size for x in jax.tree.leaves(_params(model, LoRAParam)))
  n_all = sum(x.size for x in jax.tree.leaves(after))
  assert n_lora < 0.2 * n_all
  opt = T.make_optimizer(TRAIN).init(nnx.to_pure_dict(nnx.state(model, trainable_filter(model))))
  moments = sum(x.size for x in jax.tree.leaves(opt) if x.ndim)
  assert moments == 2 * n_lora


def test_adapters_alone_round_trip():
  model, _ = _lora_model()
  T.train(model, batches, T.TrainConfig(**{**TRAIN.__dict__, "total_steps": 2}), progress=False)
  saved = jax.tree.map(np.asarray, lora_state(model))
  fresh, _ = _lora_model()
  load_lora_state(fresh, saved)
  np.testing.assert_array_equal(fresh(TOKENS), model(TOKENS))
  other, _ = _lora_model(targets=(r"attn/wq",))
  with pytest.raises(ConfigError, match="do not match"):
    load_lora_state(other, saved)


def test_freeze_by_path():
  model = M.random_model(CFG, seed=3)
  before = _params(model)
  cfg = T.TrainConfig(**{**TRAIN.__dict__, "total_steps": 2, "freeze": (r"^embed_tokens", r"layers/0/")})
  T.train(model, batches, cfg, progress=False)
  after = _params(model)
  np.testing.assert_array_equal(after["embed_tokens"]["embedding"], before["embed_tokens"]["embedding"])
  for a, b in zip(jax.tree.leaves(after["layers"][0]), jax.tree.leaves(before["layers"][0])):
    np.testing.assert_array_equal(a, b)
  assert not np.array_equal(after["layers"][1]["attn"]["wq"], before["layers"][1]["attn"]["wq"])


def test_clear_errors():
  model = M.random_model(CFG, seed=3)
  with pytest.raises(ConfigError, match="matches no trainable parameter"):
    trainable_filter(model, (r"no_such_layer",))
  with pytest.raises(ConfigError, match="freezes every trainable parameter"):
    trainable_filter(model, (r".",))
  with pytest.raises(ConfigError, match="matches no parameter"):
    apply_lora(model, LoRAConfig(targets=("nope",)), rngs=nnx.Rngs(0))
  with pytest.raises(ConfigError, match="rank"):
    LoRAConfig(rank=0)
  with pytest.raises(ConfigError, match="--lora item"):
    LoRAConfig.parse("r=4,beta=2")
  assert LoRAConfig.parse("r=16,alpha=32,targets=wq|wv") == LoRAConfig(16, 32.0, ("wq|wv",))


def test_lora_fsdp_on_an_explicit_mesh_equals_one_device():
  def losses(mesh):
    model, _ = _lora_model()
    cfg = T.TrainConfig(**{**TRAIN.__dict__, "rules": "fsdp"})
    return np.array([r["loss"] for r in T.train(model, batches, cfg, mesh=mesh, progress=False).history])

  mesh = jax.make_mesh((4, 2), ("data", "model"))   # Explicit axes
  np.testing.assert_allclose(losses(mesh), losses(None), rtol=1e-4)


def test_a_users_own_layer_gets_adapters():
  """Any layer that reads its weight with ``w[...]`` and names its axes gets adapters."""
  from jaxsys.nn.layers import param

  class Proj(nnx.Module):
    def __init__(self, rngs):
      self.w = param(rngs, (16, 8), ("embed", "mlp"))

    def __call__(self, x):
      return x @ self.w[...]

  layer = Proj(nnx.Rngs(0))
  x = jnp.ones((3, 16))
  y0 = layer(x)
  assert apply_lora(layer, LoRAConfig(rank=2), rngs=nnx.Rngs(1)) == ["w"]
  np.testing.assert_array_equal(layer(x), y0)
  grads = nnx.grad(lambda m: jnp.sum(m(x) ** 2), argnums=nnx.DiffState(0, LoRAParam))(layer)
  assert set(nnx.to_pure_dict(grads)["w"]) == {"lora_a", "lora_b"}
