"""Decoder LM: KV-cache decode vs full recompute, layer-by-layer pieces, hooks, sharding."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxsys.models as M
from jaxsys.core.errors import ConfigError, ShapeError
from jaxsys.nn import RopeConfig
from jaxsys.ops import attention
from jaxsys.decoding.cache import KVCache

CFG = M.DecoderConfig(vocab_size=61, hidden_size=32, intermediate_size=48, num_layers=2,
                      num_heads=4, num_kv_heads=2, qkv_bias=True, sliding_window=5,
                      layer_types=("full_attention", "sliding_attention"), arch="qwen2")


@pytest.fixture(scope="module")
def model():
  return M.random_model(CFG, seed=0)


def test_cached_decode_equals_full_recompute(model):
  rng = np.random.default_rng(0)
  lengths = np.array([9, 4])
  total = 14
  seqs = rng.integers(0, 61, (2, total))
  # jitted: one compile per shape instead of one per eager op (the math is the same)
  run = nnx.jit(lambda m, tokens, cache: m(tokens, cache=cache))
  full = np.asarray(nnx.jit(lambda m, tokens: m(tokens))(model, jnp.asarray(seqs)))
  # right-padded prefill of different lengths, then one token at a time per row
  cache = KVCache.init(CFG, 2, 32)
  prompt = np.where(np.arange(10)[None] < lengths[:, None], seqs[:, :10], 0)
  out = run(model, jnp.asarray(prompt), cache)
  cache = out.cache.with_lengths(lengths)
  for b in range(2):
    np.testing.assert_allclose(np.asarray(out.logits)[b, :lengths[b]], full[b, :lengths[b]], atol=1e-5)
  pos = lengths.copy()
  for _ in range(total - 9):
    tok = seqs[np.arange(2), pos][:, None]
    out = run(model, jnp.asarray(tok), cache)
    cache = out.cache
    np.testing.assert_allclose(np.asarray(out.logits)[:, 0], full[np.arange(2), pos], atol=1e-5)
    pos += 1
  np.testing.assert_array_equal(np.asarray(cache.lengths), pos)


def test_layer_by_layer_pieces_match_call(model):
  tokens = jnp.asarray(np.random.default_rng(1).integers(0, 61, (2, 7)))
  positions = jnp.broadcast_to(jnp.arange(7), (2, 7))
  x = model.embed(tokens)
  for layer in model.layers:
    q, k, v = layer.attn.project_qkv(layer.attn_norm(x), positions)
    assert q.shape == (2, 7, 4, 8) and k.shape == v.shape == (2, 7, 2, 8)
    o = attention(q, k, v, mask=layer.attn.mask)
    h = x + layer.attn.project_out(o)
    x = h + layer.mlp(layer.mlp_norm(h))
  logits = model.logits(model.final_norm(x))
  np.testing.assert_allclose(np.asarray(logits), np.asarray(model(tokens)), atol=1e-5)
  out = model(tokens, return_hidden=True)
  np.testing.assert_allclose(np.asarray(out.hidden), np.asarray(model.final_norm(x)), atol=1e-5)


def test_attention_fn_hook_positions_and_segments():
  calls = []

  def spy(q, k, v, **kw):
    calls.append(sorted(kw))
    return attention(q, k, v, **kw)

  model = M.random_model(CFG.replace(sliding_window=None, layer_types=None), attention_fn=spy)
  rng = np.random.default_rng(2)
  a, b = rng.integers(0, 61, (1, 5)), rng.integers(0, 61, (1, 6))
  packed = jnp.asarray(np.concatenate([a, b], 1))
  seg = jnp.asarray([[0] * 5 + [1] * 6])
  pos = jnp.asarray([list(range(5)) + list(range(6))])
  out = np.asarray(model(packed, positions=pos, segment_ids=seg))
  assert calls and calls[0] == ["mask", "segment_ids"]
  np.testing.assert_allclose(out[:, :5], np.asarray(model(jnp.asarray(a))), atol=1e-5)
  np.testing.assert_allclose(out[:, 5:], np.asarray(model(jnp.asarray(b))), atol=1e-5)
  with pytest.raises(ShapeError, match="positions"):
    model(packed, positions=pos[:, :3])


def test_replace_config_rope_shares_weights(model):
  tokens = jnp.asarray(np.arange(12)[None] % 61)
  pi = M.replace_config(model, rope=RopeConfig(theta=1e4, kind="linear", factor=4.0))
  assert pi.config.rope.kind == "linear"
  assert pi.layers[0].attn.wq[...] is not None
  np.testing.assert_array_equal(np.asarray(pi.layers[1].mlp.up[...]), np.asarray(model.layers[1].mlp.up[...]))
  assert not np.allclose(np.asarray(pi(tokens)), np.asarray(model(tokens)))
  # linear interpolation by 4 at positions 4p == the default rope at positions p
  pos4 = jnp.arange(12)[None] * 4
  np.testing.assert_allclose(np.asarray(pi(tokens, positions=pos4)), np.asarray(model(tokens)), atol=1e-5)


def test_config_validation():
  with pytest.raises(ConfigError, match="num_kv_heads"):
    M.DecoderConfig(num_heads=4, num_kv_heads=3)
  with pytest.raises(ConfigError, match="layer_types"):
    M.DecoderConfig(num_layers=2, layer_types=("full_attention",))
  with pytest.raises(ConfigError, match="kind"):
    RopeConfig(kind="dynamic")
  with pytest.raises(ConfigError, match="original_max_position_embeddings"):
    RopeConfig(kind="yarn", factor=2.0)


def test_logical_sharding_on_mesh():
  from jaxsys.core import make_mesh
  from jaxsys.nn import shard_params
  mesh = make_mesh({"data": 2, "model": 2}, jax.devices()[:4])
  model = M.random_model(CFG.replace(vocab_size=64), seed=5)
  sharded = M.replace_config(model)
  shard_params(sharded, mesh)
  wq = sharded.layers[0].attn.wq[...]
  assert wq.sharding.spec == jax.sharding.PartitionSpec(None, "model", None)
  tokens = jnp.asarray(np.random.default_rng(3).integers(0, 64, (2, 8)))

  @nnx.jit
  def f(m, t):
    return m(t)

  with jax.set_mesh(mesh):
    out = f(sharded, tokens)
  np.testing.assert_allclose(np.asarray(out), np.asarray(model(tokens)), atol=1e-5)


def test_remat_gradients_match():
  # reference attention: the blockwise "xla" attention does not yet trace under jax.checkpoint
  base = CFG.replace(attention_impl="reference")
  cfg = base.replace(remat=True)
  m1, m2 = M.random_model(cfg, seed=4), M.random_model(base, seed=4)
  tokens = jnp.asarray(np.random.default_rng(4).integers(0, 61, (1, 6)))

  def loss(m):
    return jnp.mean(m(tokens) ** 2)

  g1 = nnx.grad(loss)(m1)
  g2 = nnx.grad(loss)(m2)
  np.testing.assert_allclose(np.asarray(g1.layers[0].mlp.up[...]), np.asarray(g2.layers[0].mlp.up[...]),
                             rtol=1e-4, atol=1e-7)
  assert dataclasses.asdict(cfg)["remat"]


def test_shipped_tiny_lm(tmp_path):
  from jaxsys.core.errors import InputError
  from jaxsys.data import synthetic as S
  files = list(M.TINY_LM_PATH.glob("*.safetensors"))
  assert files and sum(f.stat().st_size for f in files) < 5e6
  tiny = M.load_tiny_lm()
  assert tiny.config.vocab_size == S.VOCAB.size
  exs = S.examples("recall", seed=0, count=8, length=256, n_keys=4)  # at the training length
  assert M.exact_match(tiny, exs) >= 0.75  # associative recall is what the recipe teaches best
  with pytest.raises(InputError, match="train_tiny_lm"):
    M.load_tiny_lm(tmp_path)


@pytest.mark.parametrize("chunk", [3, 4, 64])   # ragged last chunk, exact chunks, one chunk
def test_target_logprobs_chunked_equals_log_softmax(model, chunk):
  tokens = jnp.asarray(np.random.default_rng(5).integers(0, 61, (2, 12)))

  def naive(m):
    logp = jax.nn.log_softmax(m(tokens)[:, :-1], axis=-1)
    return jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]

  def chunked(m):
    h, _ = m.forward_hidden(tokens)
    return m.target_logprobs(h[:, :-1], tokens[:, 1:], chunk=chunk)

  want, got = naive(model), chunked(model)
  assert got.shape == (2, 11)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
  w = jnp.asarray(np.random.default_rng(6).normal(size=(2, 11)), jnp.float32)
  g1 = nnx.grad(lambda m: jnp.sum(naive(m) * w))(model)
  g2 = nnx.grad(lambda m: jnp.sum(chunked(m) * w))(model)
  for a, b in zip(jax.tree.leaves(g2), jax.tree.leaves(g1), strict=True):   # every parameter
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)
  with pytest.raises(ConfigError, match="chunk=0 must be >= 1"):
    model.target_logprobs(jnp.zeros((1, 2, 32)), jnp.zeros((1, 2), jnp.int32), chunk=0)
  with pytest.raises(ShapeError, match="targets"):
    model.target_logprobs(jnp.zeros((1, 2, 32)), jnp.zeros((1, 3), jnp.int32))
