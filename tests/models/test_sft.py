"""SFT on chats (``jaxsys.models.llm.sft``) and ``jaxsys finetune``: the assistant-only loss mask with
SmolLM2's real chat template, packing, malformed lines named, and the command end to end (LoRA,
resume, HF export with tokenizer files that ``jaxsys chat``'s loader reads back)."""

import json

import numpy as np
import pytest

from jaxsys.core.errors import InputError
from jaxsys.models.llm import sft

CHATS = [
    [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Capital of France?"},
     {"role": "assistant", "content": "Paris."}, {"role": "user", "content": "And Spain?"},
     {"role": "assistant", "content": "Madrid."}],
]


@pytest.fixture(scope="module")
def tokenizer():
  from jaxsys.models.llm.interop.gguf import load_tokenizer
  from jaxsys.models.llm.interop.pretrained import model_path
  return load_tokenizer(model_path("smollm2-135m-instruct"))


def test_loss_mask_covers_the_assistant_replies_only(tokenizer):
  ids, mask = sft.tokenize_chat(tokenizer, CHATS[1])
  target = tokenizer.decode(ids[mask == 1])
  assert "Paris." in target and "Madrid." in target
  assert "France" not in target and "Be brief" not in target and "assistant" not in target
  context = tokenizer.decode(ids[mask == 0])
  assert "Capital of France?" in context and "Paris" not in context
  assert ids.tolist() == list(tokenizer.apply_chat_template(CHATS[1]))


def test_packing_keeps_every_token_and_refuses_overlong_chats():
  seqs = [(np.arange(n, dtype=np.int32) + 1, np.ones(n, np.int8)) for n in (5, 3, 4, 2)]
  data = sft.pack(seqs, 8)
  assert data.tokens.shape == (2, 8) and data.targets == 14
  for r in range(2):  # positions restart in each segment; padding is segment 0
    for s in set(data.segment_ids[r]) - {0}:
      pos = data.positions[r][data.segment_ids[r] == s]
      assert pos.tolist() == list(range(len(pos)))
  batch = sft.batches(data, 3, seed=1)
  assert batch(0)["tokens"].shape == (3, 8)
  np.testing.assert_array_equal(batch(5)["tokens"], sft.batches(data, 3, seed=1)(5)["tokens"])
  with pytest.raises(InputError, match="line 9 has 5 tokens, more than --seq-len 4"):
    sft.pack(seqs, 4, names=["line 9", "b", "c", "d"])


@pytest.mark.parametrize("line,match", [
    ("{not json", "line 2: not valid JSON"),
    ('{"messages": []}', "line 2: expected an object with a non-empty 'messages' list"),
    ('{"messages": [{"role": "bot", "content": "x"}]}', r"line 2: messages\[0\].role='bot'"),
    ('{"messages": [{"role": "user", "content": 3}]}', r"line 2: messages\[0\].content must be a string"),
    ('{"messages": [{"role": "user", "content": "hi"}]}', "line 2: the chat has no assistant message"),
])
def test_a_malformed_line_is_named(tmp_path, line, match):
  path = tmp_path / "chats.jsonl"
  path.write_text(json.dumps({"messages": CHATS[0]}) + "\n" + line + "\n")
  with pytest.raises(InputError, match=match):
    sft.read_chats(path)


def test_finetune_command_with_lora_resumes_and_exports(tmp_path, tokenizer, capsys):
  """A small random decoder with SmolLM2's tokenizer (an HF folder), LoRA, 3 steps; then 2 more
  by rerunning with --steps 5 (resume); the export reloads through the CLI's model loader."""
  import jax.numpy as jnp

  from jaxsys.models import DecoderConfig, random_model
  from jaxsys.models.llm.interop.hf import save_pretrained
  from jaxsys.serving import finetune_cli
  from jaxsys.serving.cli_common import load_model
  cfg = DecoderConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_layers=2,
                      num_heads=4, num_kv_heads=2, max_position_embeddings=256, tie_embeddings=True)
  save_pretrained(random_model(cfg, seed=0), tmp_path / "base", tokenizer=tokenizer)
  data = tmp_path / "chats.jsonl"
  data.write_text("".join(json.dumps({"messages": CHATS[i % 2]}) + "\n" for i in range(20)))
  argv = ["--model", str(tmp_path / "base"), "--data", str(data), "--out", str(tmp_path / "run"),
          "--lora", "r=4,alpha=8", "--lr", "1e-2", "--batch-size", "2", "--seq-len", "128",
          "--checkpoint-every", "1", "--gguf-dtype", "none", "--no-progress"]
  assert finetune_cli.main(argv + ["--steps", "4"]) == 0
  rows = [json.loads(x) for x in (tmp_path / "run/work/metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in rows] == [1, 2, 3, 4] and rows[-1]["loss"] < rows[0]["loss"]
  assert finetune_cli.main(argv + ["--steps", "4"]) == 0   # resumes at step 4: nothing left to run
  assert "no step left to run" in capsys.readouterr().out
  assert len((tmp_path / "run/work/metrics.jsonl").read_text().splitlines()) == 4
  assert finetune_cli.main(argv + ["--steps", "6"]) == 2   # a different schedule is refused
  assert "total_steps=6 (checkpoint: 4)" in capsys.readouterr().err
  summary = json.loads((tmp_path / "run/summary.json").read_text())
  assert summary["lora_merged"] == 2 * 7 and summary["chats"] == 20
  # the adapters alone, in PEFT's layout: base + (alpha/r) lora_B @ lora_A is the merged export
  from safetensors.numpy import load_file
  adapters = load_file(tmp_path / "run/adapters/adapter_model.safetensors")
  peft = json.loads((tmp_path / "run/adapters/adapter_config.json").read_text())
  assert peft["r"] == 4 and peft["lora_alpha"] == 8 and "q_proj" in peft["target_modules"]
  merged_w = load_file(tmp_path / "run/hf/model.safetensors")
  base_w = load_file(tmp_path / "base/model.safetensors")
  for name in ("model.layers.1.self_attn.o_proj", "model.layers.0.mlp.down_proj"):
    a, b = adapters[f"base_model.model.{name}.lora_A.weight"], adapters[f"base_model.model.{name}.lora_B.weight"]
    np.testing.assert_allclose(merged_w[f"{name}.weight"], base_w[f"{name}.weight"] + 2.0 * b @ a, atol=1e-6)
  model, tok = load_model(str(tmp_path / "run/hf"))
  assert tok is not None and tok.apply_chat_template(CHATS[0]) == tokenizer.apply_chat_template(CHATS[0])
  base, _ = load_model(str(tmp_path / "base"))
  x = jnp.asarray([tokenizer.apply_chat_template(CHATS[0])])
  assert float(jnp.max(jnp.abs(model(x) - base(x)))) > 0  # the merged adapters changed it
  bad = tmp_path / "bad.jsonl"
  bad.write_text(json.dumps({"messages": CHATS[0]}) + "\n" + '{"messages": [{"role": "user"}]}\n')
  assert finetune_cli.main(["--data", str(bad), "--out", str(tmp_path / "x"), "--no-progress"]) == 2
  assert "bad.jsonl line 2: messages[0].content must be a string" in capsys.readouterr().err
