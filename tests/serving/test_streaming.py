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


def test_gates_command_writes_a_file_serve_loads(tmp_path, capsys):
  """``jaxsys gates`` on the tiny LM: the JSON and TSV it writes load back to the same flags, with
  the requested share of streaming heads; bad arguments exit 2 with a message."""
  from jaxsys import cli
  from jaxsys.models import load_tiny_lm
  out, tsv = tmp_path / "gates.json", tmp_path / "full_attention_heads.tsv"
  args = ["gates", "--model", "tiny", "--out", str(out), "--tsv", str(tsv), "--steps", "2",
          "--length", "64", "--examples", "2", "--sink", "4", "--window", "8", "--no-progress"]
  assert cli.main(args) == 0
  mc = load_tiny_lm().config
  gates = StreamingGates.load(out)
  flags = np.asarray(gates.streaming)
  assert flags.shape == (mc.num_layers, mc.num_kv_heads) and flags.sum() == round(0.5 * flags.size)
  assert (gates.sink, gates.window, len(gates.history)) == (4, 8, 2)
  assert StreamingGates.load(tsv, sparsity=0.5).streaming == gates.streaming
  assert "kv heads streaming" in capsys.readouterr().err
  assert cli.main(args[:-1] + ["--sparsity", "1.5"]) == 2
  assert "sparsity=1.5" in capsys.readouterr().err


class _WordTokenizer:
  """Whitespace words as tokens (what the text passkey path needs: encode / decode)."""

  def __init__(self):
    self.vocab: dict[str, int] = {}

  def encode(self, text, add_special_tokens=False):
    return [self.vocab.setdefault(w, len(self.vocab)) for w in text.split()]

  def decode(self, ids):
    words = {i: w for w, i in self.vocab.items()}
    return " ".join(words[i] for i in ids)


def test_text_passkey_distillation_data_marks_the_key():
  from jaxsys.serving.gates_cli import distillation_data
  tok = _WordTokenizer()
  pairs, (tokens, mask) = distillation_data(3, 300, seed=4, tokenizer=tok)
  assert tokens.shape[0] == 3 and abs(tokens.shape[1] - 300) < 20
  for i, (prompt, answer) in enumerate(pairs):
    # the states at the prompt's last token and the answer's first ones predict the answer
    assert tokens[i, mask[i]].tolist() == (prompt + answer)[len(prompt) - 1:-1]
    key = tok.decode(answer)
    assert key.isdigit() and f"The pass key is {key}." in tok.decode(prompt)
    assert tok.decode(prompt).endswith("What is the pass key? The pass key is")
