"""Tiny random transformers models shared by the decoder tests (no downloads)."""

from __future__ import annotations

import numpy as np

CONFIGS = {
    # GQA, llama3 rope scaling, untied embeddings
    "llama_gqa_llama3": ("llama", dict(
        num_attention_heads=4, num_key_value_heads=2,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500.0, "factor": 4.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 16})),
    # tied embeddings, attention bias (q/k/v/o), linear rope
    "llama_tied_linear": ("llama", dict(
        num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True, attention_bias=True,
        rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0})),
    # qkv bias, tied embeddings, yarn rope, sliding window on the second layer only
    "qwen2_bias_yarn_swa": ("qwen2", dict(
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
        use_sliding_window=True, sliding_window=5, max_window_layers=1,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 64})),
    # sliding window on every layer, GQA 4:1
    "mistral_swa": ("mistral", dict(num_attention_heads=4, num_key_value_heads=1, sliding_window=6)),
}


def hf_model(name: str, seed: int = 0):
  import torch
  import transformers
  arch, extra = CONFIGS[name]
  cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
         "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
         "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM)}[arch]
  cfg = cls[0](vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
               max_position_embeddings=256, head_dim=8, rms_norm_eps=1e-5, **extra)
  cfg._attn_implementation = "eager"
  torch.manual_seed(seed)
  model = cls[1](cfg).eval().to(torch.float32)
  with torch.no_grad():  # non-trivial norms and biases so every weight matters
    for k, v in model.state_dict().items():
      if k.endswith("norm.weight") or k.endswith(".bias"):
        v.copy_(torch.randn_like(v) * 0.1 + (1.0 if "norm" in k else 0.0))
  return model


def torch_logits(model, tokens):
  import torch
  with torch.no_grad():
    return model(torch.as_tensor(np.asarray(tokens), dtype=torch.long)).logits.float().numpy()
