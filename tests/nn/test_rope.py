"""RoPE frequencies and rotation vs transformers' own definitions."""

import numpy as np
import pytest

import jax.numpy as jnp

from jaxsys.nn import RopeConfig, apply_rope, inv_frequencies


@pytest.mark.parametrize("params", [
    {"rope_type": "default", "rope_theta": 500.0},
    {"rope_type": "linear", "rope_theta": 1e4, "factor": 4.0},
    {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
     "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 64},
])
def test_inv_freq_matches_transformers(params):
  transformers = pytest.importorskip("transformers")
  pytest.importorskip("torch")
  from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
  from jaxsys.models.llm.interop._hf_config import _rope_from_hf
  cfg = transformers.LlamaConfig(hidden_size=64, num_attention_heads=2, head_dim=32,
                                 max_position_embeddings=256, rope_parameters=dict(params))
  kind = params["rope_type"]
  if kind == "default":
    ref, ref_scale = type(transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(cfg)) \
        .compute_default_rope_parameters(cfg)
  else:
    ref, ref_scale = ROPE_INIT_FUNCTIONS[kind](cfg, "cpu")
  rope = _rope_from_hf(cfg.to_dict())
  inv, scale = inv_frequencies(rope, 32)
  np.testing.assert_allclose(inv, ref.numpy(), rtol=1e-6)
  assert scale == pytest.approx(float(ref_scale))


def test_rotation_is_relative():
  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.normal(size=(1, 1, 1, 16)), jnp.float32)
  k = jnp.asarray(rng.normal(size=(1, 1, 1, 16)), jnp.float32)
  rope = RopeConfig(theta=100.0)

  def score(pq, pk):
    a = apply_rope(q, jnp.asarray([[pq]]), rope)
    b = apply_rope(k, jnp.asarray([[pk]]), rope)
    return float(jnp.sum(a * b))

  assert score(7, 3) == pytest.approx(score(104, 100), rel=1e-4)
  assert score(7, 3) != pytest.approx(score(7, 4), rel=1e-3)
