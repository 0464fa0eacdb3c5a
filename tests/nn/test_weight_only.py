"""The small-M decode path: fused f32, bf16 and weight-only int8 weights (per-output-channel
scales) vs float32, and decode attention over the cache in place."""

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsys.ops.attn.api import ATTENTION
from flax import nnx

import jaxsys.models as M
from jaxsys.core.errors import ConfigError, ShapeError
from jaxsys.models.llm.decoder import pack_for_decode
from jaxsys.nn.layers import SMALL_M, DecodeWeight, quantize_rows_int8, row_matmul
from jaxsys.ops import attention, masks
from jaxsys.decoding.cache import KVCache

CFG = M.DecoderConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_layers=2,
                      num_heads=4, num_kv_heads=2, qkv_bias=True)
TIED = CFG.replace(tie_embeddings=True, qkv_bias=False)


@pytest.fixture(scope="module")
def models():
  return {"untied": M.random_model(CFG, seed=0), "tied": M.random_model(TIED, seed=1)}


def test_int8_rows_error_is_at_most_half_a_step():
  rows = np.random.default_rng(0).standard_normal((7, 33)).astype(np.float32)
  rows[3] = 0.0
  q, scale = quantize_rows_int8(rows)
  q, scale = np.asarray(q), np.asarray(scale)
  assert q.dtype == np.int8 and scale.shape == (7,)
  err = np.abs(q * scale[:, None] - rows)
  assert np.all(err <= scale[:, None] / 2 + 1e-7)
  assert np.all(np.abs(q).max(axis=1)[[0, 1, 2, 4, 5, 6]] == 127)   # each row uses the full range
  assert scale[3] == 1.0 and not q[3].any()


@pytest.mark.parametrize("fmt", ["float32", "bfloat16", "int8"])
def test_decode_weight_equals_its_dense_matrix_on_both_paths(fmt):
  rng = np.random.default_rng(1)
  w = jnp.asarray(rng.standard_normal((24, 40)).astype(np.float32))
  dw = DecodeWeight(w, fmt)
  dense = np.asarray(dw.dense())
  if fmt == "float32":
    np.testing.assert_array_equal(dense, np.asarray(w))
  # 1 row (padded to 2), a few rows (multiply-reduce) and a prefill-sized block (dot)
  for m in (1, 3, SMALL_M + 5):
    x = jnp.asarray(rng.standard_normal((2, m, 24)).astype(np.float32))
    np.testing.assert_allclose(np.asarray(dw(x)), np.asarray(x) @ dense, rtol=1e-5, atol=1e-5)
  idx = jnp.asarray([[0, 39], [5, 5]])
  np.testing.assert_allclose(np.asarray(dw.rows_at(idx)), dense.T[np.asarray(idx)], rtol=1e-6)


@pytest.mark.parametrize("kind", ["untied", "tied"])
@pytest.mark.parametrize("fmt", ["float32", "bfloat16", "int8"])
def test_packed_model_logits_vs_float32(models, kind, fmt):
  model = models[kind]
  cfg = model.config
  tokens = jnp.asarray(np.random.default_rng(2).integers(0, cfg.vocab_size, (2, 12)))
  ref = np.asarray(model(tokens))
  packed = pack_for_decode(model, fmt)
  assert packed.decode_weights == fmt and model.decode_weights is None
  assert packed.layers[0].attn.wq is None and model.layers[0].attn.wq is not None
  run = nnx.jit(lambda m, t, c: m(t, cache=c))
  full = np.asarray(run(packed, tokens[:, :11], KVCache.init(cfg, 2, 16)).logits)  # M = 22: dot
  out = run(packed, tokens[:, :11], KVCache.init(cfg, 2, 16))
  step = np.asarray(run(packed, tokens[:, 11:], out.cache).logits[:, 0])             # M = 2
  err = max(np.abs(full - ref[:, :11]).max(), np.abs(step - ref[:, 11]).max())
  scale = np.abs(ref).max()
  if fmt == "float32":
    assert err < 1e-5
  else:  # half / quarter the bytes: small but real differences
    assert 0 < err < {"bfloat16": 0.02, "int8": 0.05}[fmt] * scale


def test_packed_float32_generates_the_same_tokens(models):
  gen = importlib.import_module("jaxsys.serving.generation")
  model = models["untied"]
  prompts = [[1, 2, 3, 4, 5], [7, 8]]
  ref = gen.generate(model, prompts, max_new_tokens=6, stop_tokens=())
  out = gen.generate(pack_for_decode(model, "float32"), prompts, max_new_tokens=6, stop_tokens=())
  assert out.tokens == ref.tokens


def test_bf16_tied_head_reads_the_table_in_bf16():
  # The embedding table feeds the token lookup and the tied head; XLA must fuse the head's
  # bf16 -> f32 convert into its matmul instead of writing the table out in f32 every step.
  cfg = TIED.replace(vocab_size=2048, hidden_size=64, num_layers=1)
  packed = pack_for_decode(M.random_model(cfg, seed=0), "bfloat16")
  gd, st = nnx.split(packed)

  def step(st, cache, tokens):
    h, cache = nnx.merge(gd, st).forward_hidden(tokens, cache=cache)
    return nnx.merge(gd, st).logits(h), cache

  hlo = jax.jit(step).lower(st, KVCache.init(cfg, 1, 16), jnp.ones((1, 1), jnp.int32))
  entry = hlo.compile().as_text().split("ENTRY", 1)[1]   # top-level ops (fusion bodies excluded)
  assert "bf16[2048,64]" in entry and "f32[2048,64]" not in entry


def test_bad_formats_and_shapes(models):
  with pytest.raises(ConfigError, match="fmt"):
    DecodeWeight(jnp.ones((4, 4)), "int4")
  with pytest.raises(ShapeError, match=r"\[in, out\]"):
    DecodeWeight(jnp.ones((2, 4, 4)), "int8")
  with pytest.raises(ShapeError, match="8 features"):
    DecodeWeight(jnp.ones((8, 4)), "int8")(jnp.ones((1, 7)))
  with pytest.raises(ConfigError, match="weights"):
    pack_for_decode(models["untied"], "fp8")
  with pytest.raises(ConfigError, match="already packed"):
    pack_for_decode(pack_for_decode(models["untied"], "int8"), "int8")
  with pytest.raises(ShapeError):
    row_matmul(jnp.ones((2, 3)), jnp.ones((4, 5), jnp.int8))


@pytest.mark.parametrize("mask", [masks.Causal(), masks.Local(7)])
@pytest.mark.parametrize("s", [1, 3])
def test_decode_attention_equals_the_reference(mask, s):
  rng = np.random.default_rng(3)
  b, t = 2, 40
  q = jnp.asarray(rng.standard_normal((b, s, 6, 8)).astype(np.float32))
  k, v = (jnp.asarray(rng.standard_normal((b, t, 2, 8)).astype(np.float32)) for _ in range(2))
  off = jnp.asarray([5, t - s], jnp.int32)
  ref = attention(q, k, v, mask=mask, q_offset=off, kv_lengths=off + s, impl="reference")
  out, lse = attention(q, k, v, mask=mask, q_offset=off, kv_lengths=off + s, impl="xla_decode",
                       return_lse=True)
  ref_out, ref_lse = attention(q, k, v, mask=mask, q_offset=off, kv_lengths=off + s, impl="reference",
                               return_lse=True)
  np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=1e-6)
  np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), atol=1e-5)
  with pytest.raises(NotImplementedError, match="at most 16"):   # a prefill: the blockwise path's
    attention(jnp.zeros((1, 17, 6, 8)), k[:1], v[:1], mask=mask, impl="xla_decode")
  assert ATTENTION.order("auto") == ("xla_decode", "xla")         # CPU: the short path first


def test_cached_step_does_not_transpose_the_cache(models):
  # the GQA contraction over [batch, T, kv_heads, d] caches used to copy both caches to
  # [batch, kv_heads, T, d] in every layer of every step
  model = models["untied"]
  gd, st = nnx.split(model)
  cache = KVCache.init(model.config, 2, 64)

  def step(st, cache, tokens):
    return nnx.merge(gd, st)(tokens, cache=cache).logits

  entry = jax.jit(step).lower(st, cache, jnp.ones((2, 1), jnp.int32)).compile().as_text()
  entry = entry.split("ENTRY", 1)[1]
  assert "f32[2,64,2,8]" in entry and "f32[2,2,64,8]" not in entry and "f32[2,2,8,64]" not in entry
