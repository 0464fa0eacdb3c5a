"""Streaming-head identification finds planted heads; gates save/load."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxsys.core.errors import ShapeError
from jaxsys.models.llm._decoder_config import DecoderConfig
from jaxsys.models.llm.decoder import random_model
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
  # --method attention: ranked by the far attention mass, no distillation history
  assert cli.main(args + ["--method", "attention"]) == 0
  ranked = StreamingGates.load(out)
  assert np.asarray(ranked.streaming).sum() == flags.sum() and ranked.history == ()
  assert max(max(a) for a in ranked.alpha) == 1.0
  assert "attention outside sink + window" in capsys.readouterr().err


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


def test_far_attention_scores_match_a_naive_softmax():
  """Layer 0's score equals the attention mass outside Sink | Local computed by hand from its q/k;
  a window covering every key gives 0; the ranking makes the lowest-mass heads streaming."""
  from jaxsys.models.llm.decoder import default_positions
  from jaxsys.serving.streaming import far_attention_scores, rank_streaming_heads
  cfg = DecoderConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_layers=2,
                      num_heads=4, num_kv_heads=2)
  model = random_model(cfg, seed=3)
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, 32, (2, 40))
  answer = np.zeros_like(tokens, bool)
  answer[0, [30, 35]] = True
  answer[1, 39] = True
  sink, window = 2, 8
  got = far_attention_scores(model, (tokens, answer), sink=sink, window=window, progress=False)
  assert got.shape == (2, 2) and (got > 0).all() and (got < 1).all()
  layer = model.layers[0]
  want = np.zeros(2)
  for row in range(2):
    x = model.embed(jnp.asarray(tokens[row:row + 1]))
    q, k, _ = layer.attn.project_qkv(layer.attn_norm(x), default_positions(1, 40))
    q, k = np.asarray(q[0], np.float64), np.asarray(k[0], np.float64)  # [T, heads, d], [T, kv, d]
    per_query = []
    for i in np.nonzero(answer[row])[0][:1]:  # the first answer state
      far = np.zeros(2)
      for h in range(4):
        s = k[:i + 1, h // 2] @ q[i, h] / np.sqrt(cfg.head_dim)
        p = np.exp(s - s.max())
        p /= p.sum()
        t = np.arange(i + 1)
        far[h // 2] += p[(t >= sink) & (t <= i - window)].sum() / 2
      per_query.append(far)
    want += np.mean(per_query, 0) / 2
  np.testing.assert_allclose(got[0], want, rtol=1e-4)
  assert not far_attention_scores(model, (tokens, answer), sink=0, window=64, progress=False).any()
  gates = rank_streaming_heads(model, (tokens, answer), sink=sink, window=window, sparsity=0.5,
                               progress=False)
  flat = got.reshape(-1)
  assert np.asarray(gates.streaming).reshape(-1).tolist() == (flat <= np.sort(flat)[1]).tolist()
  two = rank_streaming_heads(model, [(tokens[:1], answer[:1]), (tokens[1:], answer[1:])], sink=sink,
                             window=window, progress=False)  # equal weight per dataset
  assert two.alpha == gates.alpha
  with pytest.raises(ShapeError, match="every sequence"):
    far_attention_scores(model, (tokens, answer & False), progress=False)
