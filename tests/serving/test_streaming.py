"""Streaming-head identification finds planted heads; gates save/load."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxsys.core.errors import ShapeError
from jaxsys.models._decoder_config import DecoderConfig
from jaxsys.models.decoder import random_model
from jaxsys.serving.streaming import StreamingGates, gated_hidden, identify_streaming_heads


def test_planted_unused_heads_become_streaming(tmp_path):
  cfg = DecoderConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_layers=2,
                      num_heads=4, num_kv_heads=2)
  model = random_model(cfg, seed=1)
  for layer in model.layers:  # query heads 2, 3 (kv head 1) do not reach the output
    wo = layer.attn.wo[...]
    layer.attn.wo[...] = wo.at[2:].set(0.0) * 20.0
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, 32, (8, 32))
  answer = np.zeros_like(tokens, bool)
  answer[:, -4:] = True
  # gate = 1 reproduces the full model exactly
  graphdef, params = nnx.split(model)
  hidden = jax.jit(lambda p, t, a: gated_hidden(nnx.merge(graphdef, p), t, a, sink=2, window=4,
                                                impl="reference"))
  h_full = hidden(params, jnp.asarray(tokens[:2]), None)
  h_one = hidden(params, jnp.asarray(tokens[:2]), jnp.ones((2, 2)))
  np.testing.assert_allclose(h_one, h_full, atol=1e-6)
  gates = identify_streaming_heads(model, (tokens, answer), sink=2, window=4, sparsity=0.5,
                                   steps=25, lr=0.05, l1=1e-4, batch_size=4,
                                   impl="reference")
  assert np.asarray(gates.streaming).tolist() == [[False, True], [False, True]]
  alpha = np.asarray(gates.alpha)
  assert alpha[:, 1].max() < 0.1 < alpha[:, 0].min()
  path = tmp_path / "gates.json"
  gates.save(path)
  assert StreamingGates.load(path) == gates and path.stat().st_size < 2000
  assert np.asarray(gates.with_sparsity(0.25).streaming).sum() == 1
  with pytest.raises(ShapeError, match="answer_mask"):
    identify_streaming_heads(model, (tokens, answer[:, :3]))


def test_duoattention_tsv_head_pattern(tmp_path):
  """DuoAttention / omniserve ``full_attention_heads.tsv`` (one line per layer, a gate per kv
  head) loads with the sparsity rule; sink / window come from the config.json beside it."""
  alpha = np.array([[0.9, 0.1, 0.4], [0.05, 0.8, 0.7]])
  path = tmp_path / "full_attention_heads.tsv"
  path.write_text("\n".join("\t".join(f"{x:.2f}" for x in row) for row in alpha) + "\n")
  (tmp_path / "config.json").write_text('{"sink_size": 128, "recent_size": 1024}')
  g = StreamingGates.load(path, sparsity=0.5)
  assert g.streaming == ((False, True, True), (True, False, False))  # the 3 smallest gates
  assert (g.sink, g.window) == (128, 1024)
  g.save_tsv(tmp_path / "out.tsv")
  again = StreamingGates.load(tmp_path / "out.tsv", sparsity=0.5, sink=4, window=8)
  assert again.alpha == g.alpha and again.streaming == g.streaming and again.window == 8
