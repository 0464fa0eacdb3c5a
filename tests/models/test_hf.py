"""Hugging Face interop: parity with transformers (torch, CPU), round trips, bad input."""

import json
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
import _hf_utils as U  # noqa: E402

import jaxsys.models as M  # noqa: E402
from jaxsys.core.errors import ConfigError, InputError, ShapeError  # noqa: E402

pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TOKENS = np.random.default_rng(0).integers(0, 97, (2, 13))  # longer than every sliding window


@pytest.mark.parametrize("name", list(U.CONFIGS))
def test_parity_and_round_trip(name, tmp_path):
  hf = U.hf_model(name)
  ref = U.torch_logits(hf, TOKENS)
  hf.save_pretrained(tmp_path / "hf")
  model = M.from_pretrained(tmp_path / "hf", dtype="float32")
  ours = np.asarray(model(jnp.asarray(TOKENS)))
  assert ours.shape == (2, 13, 97)
  np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=0)
  # jaxsys -> disk -> transformers gives the same logits.
  M.save_pretrained(model, tmp_path / "ours")
  back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours", dtype="float32")
  back.eval()
  assert type(back) is type(hf)
  np.testing.assert_allclose(U.torch_logits(back, TOKENS), ref, atol=1e-5, rtol=0)


def test_from_hf_model_and_sharded_checkpoint(tmp_path):
  hf = U.hf_model("qwen2_bias_yarn_swa", seed=3)
  model = M.from_hf_model(hf)
  ref = U.torch_logits(hf, TOKENS)
  np.testing.assert_allclose(np.asarray(model(jnp.asarray(TOKENS))), ref, atol=1e-4, rtol=0)
  M.save_pretrained(model, tmp_path, max_shard_bytes=20_000)
  assert (tmp_path / "model.safetensors.index.json").exists()
  assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
  again = M.from_pretrained(tmp_path)
  np.testing.assert_allclose(np.asarray(again(jnp.asarray(TOKENS))), ref, atol=1e-4, rtol=0)
  bf16 = M.from_pretrained(tmp_path, dtype="bfloat16")
  assert bf16.layers[0].attn.wq[...].dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(bf16(jnp.asarray(TOKENS))), ref, atol=0.1, rtol=0)


def _write_llama(tmp_path):
  hf = U.hf_model("llama_gqa_llama3")
  hf.save_pretrained(tmp_path)
  return json.loads((tmp_path / "config.json").read_text())


@pytest.mark.parametrize("field,value,match", [
    ("model_type", "gpt2", "model_type"),
    ("hidden_act", "gelu", "hidden_act"),
    ("mlp_bias", True, "mlp_bias"),
    ("rope_parameters", {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}, "rope_type"),
    ("rope_parameters", {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5},
     "partial_rotary_factor"),
    ("logit_softcapping", 30.0, "logit_softcapping"),
])
def test_unsupported_config_fields_raise(tmp_path, field, value, match):
  cfg = _write_llama(tmp_path)
  cfg[field] = value
  (tmp_path / "config.json").write_text(json.dumps(cfg))
  with pytest.raises(ConfigError, match=match):
    M.from_pretrained(tmp_path)


def test_bad_weights_name_the_key(tmp_path):
  from jaxsys.models.llm.interop import _safetensors as st
  hf = U.hf_model("llama_gqa_llama3")
  model = M.from_hf_model(hf)
  good = M.hf_state_dict(model)
  cases = {
      "missing": ({k: v for k, v in good.items() if k != "model.layers.1.mlp.up_proj.weight"},
                  InputError, "model.layers.1.mlp.up_proj.weight"),
      "extra": ({**good, "model.layers.0.self_attn.q_norm.weight": np.ones(8, np.float32)},
                InputError, "q_norm"),
      "shape": ({**good, "model.layers.0.self_attn.k_proj.weight": np.zeros((8, 32), np.float32)},
                ShapeError, "k_proj"),
      "dtype": ({**good, "model.norm.weight": np.ones(32, np.int32)}, ShapeError, "model.norm.weight"),
  }
  for case, (tensors, err, match) in cases.items():
    d = tmp_path / case
    d.mkdir()
    hf.config.save_pretrained(d)
    st.write_file(d / "model.safetensors", tensors)
    with pytest.raises(err, match=match):
      M.from_pretrained(d)
  with pytest.raises(InputError, match="config.json"):
    M.from_pretrained(tmp_path / "nowhere")


def test_unrepresentable_config_on_save(tmp_path):
  cfg = M.DecoderConfig(arch="llama", sliding_window=4)
  with pytest.raises(ConfigError, match="sliding_window"):
    M.save_pretrained(M.random_model(cfg), tmp_path)
  cfg = M.DecoderConfig(arch="qwen2", qkv_bias=False)
  with pytest.raises(ConfigError, match="qkv"):
    M.save_pretrained(M.random_model(cfg), tmp_path)


def test_random_model_from_transformers_config():
  cfg = transformers.Qwen2Config(vocab_size=50, hidden_size=32, intermediate_size=64,
                                 num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)
  model = M.random_model(cfg, seed=1)
  assert model.config.qkv_bias and not model.config.o_bias and model.config.num_kv_heads == 2
  assert model(jnp.zeros((1, 4), jnp.int32)).shape == (1, 4, 50)
