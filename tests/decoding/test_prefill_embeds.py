"""Prefill from input embeddings, and one prefill shared by a group of rollouts."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxsys.core.errors import ConfigError
from jaxsys.decoding import core
from jaxsys.decoding.cache import KVCache
from jaxsys.models import DecoderConfig
from jaxsys.models.llm.decoder import random_model

CFG = DecoderConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                    num_kv_heads=2, max_position_embeddings=64)


def test_prefill_from_embeds_matches_token_prefill():
  model = random_model(CFG, 0)
  gdef, state = nnx.split(model)
  tokens = jax.random.randint(jax.random.key(1), (2, 8), 0, 32)
  lengths = jnp.array([8, 5], jnp.int32)
  l_tok, _, c_tok = core.jit_prefill(gdef, state, tokens, lengths, KVCache.init(CFG, 2, 16), False)
  emb = model.embed(tokens)
  l_emb, _, c_emb = core.prefill(model, None, lengths, KVCache.init(CFG, 2, 16), embeds=emb)
  np.testing.assert_allclose(np.asarray(l_emb), np.asarray(l_tok), atol=1e-5)
  np.testing.assert_allclose(np.asarray(c_emb.k[1]), np.asarray(c_tok.k[1]), atol=1e-5)
  np.testing.assert_array_equal(np.asarray(c_emb.lengths), [8, 5])


def test_group_shares_one_prefill():
  model = random_model(CFG, 0)
  gdef, state = nnx.split(model)
  emb = jax.random.normal(jax.random.key(2), (2, 8, 32))
  lengths = jnp.array([8, 6], jnp.int32)
  logits, _, cache = core.jit_prefill_embeds(gdef, state, emb, lengths, KVCache.init(CFG, 2, 16), 3)
  assert cache.batch == 6 and logits.shape == (6, 32)
  # the same as prefilling every rollout row on its own
  want_l, _, want_c = core.prefill(model, None, jnp.repeat(lengths, 3), KVCache.init(CFG, 6, 16),
                                   embeds=jnp.repeat(emb, 3, axis=0))
  np.testing.assert_allclose(np.asarray(logits), np.asarray(want_l), atol=1e-5)
  np.testing.assert_allclose(np.asarray(cache.v[0]), np.asarray(want_c.v[0]), atol=1e-5)
  np.testing.assert_array_equal(np.asarray(cache.lengths), [8, 8, 8, 6, 6, 6])
  # decode steps continue from the shared cache row by row
  step_logits, _, _ = core.step(model, cache, jnp.zeros((6, 1), jnp.int32))
  np.testing.assert_allclose(np.asarray(step_logits[0]), np.asarray(step_logits[2]), atol=1e-6)
  with pytest.raises(ConfigError, match="group"):
    KVCache.init(CFG, 1, 4).repeat(0)
