"""Hugging Face ``config.json`` <-> :class:`DecoderConfig`, refusing anything that changes the math.

Supported: ``LlamaForCausalLM``, ``Qwen2ForCausalLM``, ``MistralForCausalLM`` with SiLU SwiGLU,
RoPE types default / linear / llama3 / yarn, GQA, explicit ``head_dim``, qkv (and Llama's o)
bias, tied embeddings, sliding windows (Mistral: every layer; Qwen2: per ``layer_types``).
A field that would change the computation and is not supported (another activation,
``mlp_bias``, dynamic or longrope RoPE, partial rotary, quantization, an unknown key) raises
``ConfigError`` naming it.

Policy, as transformers reads the same file: the architecture fields ``vocab_size``,
``hidden_size``, ``intermediate_size``, ``num_hidden_layers`` and ``num_attention_heads`` are
required positive ints (transformers would fill in class defaults; here a missing one is an
error, since the weights' shapes would be checked against a guess); ``num_key_value_heads``,
``head_dim`` and ``max_position_embeddings`` are positive ints or absent/null. RoPE parameters
are required where transformers requires them (``factor`` for linear / llama3 / yarn, and the
llama3 frequency factors and original length) and must be positive numbers. Metadata that
transformers keeps but that never reaches the forward pass (token ids, names and paths,
versions, dtypes, output flags, generation defaults, dropout, ``quantization_config`` with
``quant_method: "gguf"``, which transformers sets on a model it dequantized from a GGUF file)
is accepted and ignored.
"""

from __future__ import annotations

import numbers
from typing import Any

from jaxsys.core.errors import ConfigError
from jaxsys.models.llm._decoder_config import DecoderConfig
from jaxsys.nn.rope import RopeConfig

__all__ = ["ARCH_CLASSES", "config_from_hf", "config_to_hf"]

ARCH_CLASSES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                "mistral": "MistralForCausalLM"}

# Fields that never change the forward computation (bookkeeping, generation defaults,
# training-only dropout, generic PretrainedConfig attributes of transformers 4.x and 5.x).
_HARMLESS = {
    "_name_or_path", "_model_name_or_path", "name_or_path", "model_name", "_commit_hash",
    "_attn_implementation", "_attn_implementation_autoset", "architectures", "model_type",
    "transformers_version", "torch_dtype", "dtype", "use_cache", "initializer_range",
    "attention_dropout", "hidden_dropout", "embedding_dropout", "bos_token_id", "eos_token_id",
    "pad_token_id", "unk_token_id", "sep_token_id", "cls_token_id", "mask_token_id",
    "decoder_start_token_id", "output_attentions", "max_new_tokens", "min_new_tokens",
    "output_hidden_states", "return_dict", "id2label", "label2id", "problem_type",
    "chunk_size_feed_forward", "is_encoder_decoder", "is_decoder", "torchscript", "pruned_heads",
    "tie_encoder_decoder", "add_cross_attention", "cross_attention_hidden_size",
    "task_specific_params", "finetuning_task", "tokenizer_class", "prefix", "bad_words_ids",
    "begin_suppress_tokens", "diversity_penalty", "do_sample", "early_stopping",
    "encoder_no_repeat_ngram_size", "exponential_decay_length_penalty", "forced_bos_token_id",
    "forced_eos_token_id", "length_penalty", "max_length", "min_length", "no_repeat_ngram_size",
    "num_beam_groups", "num_beams", "num_return_sequences", "output_scores",
    "remove_invalid_values", "repetition_penalty", "return_dict_in_generate", "suppress_tokens",
    "temperature", "top_k", "top_p", "typical_p", "use_bfloat16", "tf_legacy_loss",
    "max_position_embeddings", "pretraining_tp", "embd_pdrop", "resid_pdrop",
}
_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
             "num_attention_heads")
_HANDLED = {
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "rms_norm_eps", "hidden_act", "tie_word_embeddings",
    "rope_parameters", "rope_theta", "rope_scaling", "attention_bias", "mlp_bias",
    "sliding_window", "use_sliding_window", "max_window_layers", "layer_types",
}


def _check_count(key: str, value) -> int:
  if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value <= 0:
    raise ConfigError(f"{key}={value!r} must be a positive int")
  return int(value)


def _number(d: dict[str, Any], key: str, default: float, where: str = "", *,
            zero_ok: bool = False) -> float:
  value = d.get(key)
  if value is None:
    return default
  if isinstance(value, bool) or not isinstance(value, numbers.Real) or not (
      (0 <= value if zero_ok else 0 < value) and value < float("inf")):
    raise ConfigError(f"{where}{key}={value!r} must be a {'non-negative' if zero_ok else 'positive'} "
                      "finite number")
  return float(value)


# Parameters each RoPE type requires (transformers' rope validation refuses a config without them).
_ROPE_REQUIRED = {"default": (), "linear": ("factor",), "yarn": ("factor",),
                  "llama3": ("factor", "original_max_position_embeddings", "low_freq_factor",
                             "high_freq_factor")}


def _rope_from_hf(d: dict[str, Any]) -> RopeConfig:
  params = d.get("rope_parameters")
  src = "rope_parameters"
  if params is None:  # transformers 4.x layout: rope_theta + rope_scaling
    src = "rope_scaling"
    params = d.get("rope_scaling") or {}
    if not isinstance(params, dict):
      raise ConfigError(f"rope_scaling={params!r} must be an object or null")
    params = dict(params)
    params.setdefault("rope_theta", d.get("rope_theta", 10000.0))
  if not isinstance(params, dict):
    raise ConfigError(f"rope_parameters={params!r} must be an object")
  params = dict(params)
  if "type" in params and "rope_type" not in params:
    params["rope_type"] = params.pop("type")
  kind = params.get("rope_type", "default")
  if kind not in ("default", "linear", "llama3", "yarn"):
    raise ConfigError(f"{src}.rope_type={kind!r} is not supported (default, linear, "
                      "llama3, yarn); it would change the model's positions")
  prf = params.get("partial_rotary_factor", 1.0)
  if prf != 1.0:
    raise ConfigError(f"{src}.partial_rotary_factor={prf} is not supported (must be 1.0)")
  known = {"rope_type", "rope_theta", "factor", "original_max_position_embeddings",
           "low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow", "attention_factor",
           "mscale", "mscale_all_dim", "truncate", "partial_rotary_factor"}
  unknown = sorted(set(params) - known)
  if unknown:
    raise ConfigError(f"{src} fields {unknown} are not understood")
  missing = [k for k in _ROPE_REQUIRED[kind] if params.get(k) is None]
  if missing:
    raise ConfigError(f"{src} with rope_type={kind!r} needs {missing}")
  where = f"{src}."
  orig = params.get("original_max_position_embeddings")
  if orig is not None:
    orig = _check_count(where + "original_max_position_embeddings", orig)
  if kind == "yarn" and orig is None:
    orig = d.get("max_position_embeddings")
  kw = dict(theta=_number(params, "rope_theta", 10000.0, where), kind=kind,
            factor=_number(params, "factor", 1.0, where), original_max_position_embeddings=orig)
  for name in ("low_freq_factor", "high_freq_factor", "attention_factor", "beta_fast", "beta_slow",
               "mscale", "mscale_all_dim"):  # yarn: 0 betas / mscales are meaningful
    if params.get(name) is not None:
      kw[name] = _number(params, name, 0.0, where, zero_ok=name.startswith(("beta", "mscale")))
  if params.get("truncate") is not None:
    kw["truncate"] = bool(params["truncate"])
  return RopeConfig(**kw)


def config_from_hf(d: dict[str, Any], *, strict: bool = True) -> DecoderConfig:
  """Converts a Hugging Face config dict; raises ``ConfigError`` naming any unsupported field."""
  d = dict(d)
  arch = d.get("model_type")
  archs = d.get("architectures") or []
  if arch not in ARCH_CLASSES:
    raise ConfigError(f"model_type={arch!r} is not supported; jaxsys decoders load "
                      f"{sorted(ARCH_CLASSES)}")
  bad_cls = [a for a in archs if a not in ARCH_CLASSES.values()]
  if bad_cls:
    raise ConfigError(f"architectures={archs} is not supported; expected one of "
                      f"{sorted(ARCH_CLASSES.values())}")
  if d.get("hidden_act", "silu") not in ("silu", "swish"):
    raise ConfigError(f"hidden_act={d['hidden_act']!r} is not supported (SwiGLU with silu only)")
  if d.get("mlp_bias"):
    raise ConfigError("mlp_bias=True is not supported")
  quant = d.pop("quantization_config", None)
  if quant and not (isinstance(quant, dict) and quant.get("quant_method") == "gguf"):
    # A GGUF marker only says where dense weights came from; packed GGUF blocks would still
    # fail the weight shape / dtype checks. Any other method needs its own dequantization.
    raise ConfigError(f"quantization_config={quant!r:.200} is not supported: load an unquantized "
                      "(or GGUF-dequantized) checkpoint")
  unknown = sorted(set(d) - _HARMLESS - _HANDLED)
  if unknown and strict:
    raise ConfigError(f"config fields {unknown} are not understood and may change the math; "
                      "pass strict=False to ignore them")
  for key in _REQUIRED:
    if key not in d:
      raise ConfigError(f"config has no {key!r}: the {sorted(_REQUIRED)} fields are required")
    d[key] = _check_count(key, d[key])
  for key in ("num_key_value_heads", "head_dim", "max_position_embeddings"):
    if d.get(key) is not None:
      d[key] = _check_count(key, d[key])
  heads = d["num_attention_heads"]
  qkv_bias = o_bias = False
  if arch == "qwen2":
    qkv_bias = True
  elif arch == "llama":
    qkv_bias = o_bias = bool(d.get("attention_bias", False))
  window, layer_types = _window_from_hf(arch, d)
  return DecoderConfig(
      vocab_size=d["vocab_size"], hidden_size=d["hidden_size"],
      intermediate_size=d["intermediate_size"], num_layers=d["num_hidden_layers"],
      num_heads=heads, num_kv_heads=d.get("num_key_value_heads") or heads,
      head_dim=d.get("head_dim") or d["hidden_size"] // heads,
      rms_norm_eps=_number(d, "rms_norm_eps", 1e-6), rope=_rope_from_hf(d),
      qkv_bias=qkv_bias, o_bias=o_bias, tie_embeddings=bool(d.get("tie_word_embeddings", False)),
      sliding_window=window, layer_types=layer_types,
      max_position_embeddings=int(d.get("max_position_embeddings") or 2048), arch=arch,
      bos_token_id=d.get("bos_token_id"), eos_token_id=d.get("eos_token_id"),
      pad_token_id=d.get("pad_token_id"))


def _window_from_hf(arch: str, d: dict[str, Any]):
  if arch == "llama":
    if d.get("sliding_window") is not None:
      raise ConfigError("sliding_window is not a Llama field; use model_type 'mistral' or 'qwen2'")
    return None, None
  if arch == "mistral":
    if d.get("layer_types") is not None and set(d["layer_types"]) != {"full_attention"} and \
        d.get("sliding_window") is None:
      raise ConfigError(f"layer_types={d['layer_types']} need sliding_window")
    return d.get("sliding_window"), None
  # qwen2: the window applies only to "sliding_attention" layers, and only with use_sliding_window.
  if not d.get("use_sliding_window", False) or d.get("sliding_window") is None:
    return None, None
  n = d["num_hidden_layers"]
  types = d.get("layer_types") or [
      "sliding_attention" if i >= d.get("max_window_layers", 28) else "full_attention"
      for i in range(n)]
  if "sliding_attention" not in types:
    return None, None
  return d["sliding_window"], tuple(types)


def config_to_hf(c: DecoderConfig, *, torch_dtype: str = "float32") -> dict[str, Any]:
  """The ``config.json`` of ``c.arch``; ``ConfigError`` if ``c`` cannot be written as that class."""
  rope: dict[str, Any] = {"rope_type": c.rope.kind, "rope_theta": c.rope.theta}
  if c.rope.kind != "default":
    rope["factor"] = c.rope.factor
  if c.rope.kind in ("llama3", "yarn"):
    rope["original_max_position_embeddings"] = c.rope.original_max_position_embeddings
  if c.rope.kind == "llama3":
    rope.update(low_freq_factor=c.rope.low_freq_factor, high_freq_factor=c.rope.high_freq_factor)
  if c.rope.kind == "yarn":
    rope.update(beta_fast=c.rope.beta_fast, beta_slow=c.rope.beta_slow, truncate=c.rope.truncate)
    for name in ("attention_factor", "mscale", "mscale_all_dim"):
      if getattr(c.rope, name) is not None:
        rope[name] = getattr(c.rope, name)
  d: dict[str, Any] = {
      "architectures": [ARCH_CLASSES[c.arch]], "model_type": c.arch,
      "vocab_size": c.vocab_size, "hidden_size": c.hidden_size,
      "intermediate_size": c.intermediate_size, "num_hidden_layers": c.num_layers,
      "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads,
      "head_dim": c.head_dim, "hidden_act": "silu", "rms_norm_eps": c.rms_norm_eps,
      "max_position_embeddings": c.max_position_embeddings, "rope_parameters": rope,
      "tie_word_embeddings": c.tie_embeddings, "bos_token_id": c.bos_token_id,
      "eos_token_id": list(c.eos_token_id) if isinstance(c.eos_token_id, tuple) else c.eos_token_id,
      "pad_token_id": c.pad_token_id, "dtype": torch_dtype, "use_cache": True,
  }
  if c.arch == "llama":
    if c.qkv_bias != c.o_bias:
      raise ConfigError(f"llama has one attention_bias for q/k/v/o; {c.qkv_bias=} != {c.o_bias=} "
                        "(use arch='qwen2' for qkv-only bias)")
    if c.sliding_window is not None:
      raise ConfigError(f"llama cannot represent sliding_window={c.sliding_window}; use arch='mistral' or 'qwen2'")
    d.update(attention_bias=c.qkv_bias, mlp_bias=False)
  elif c.arch == "qwen2":
    if not c.qkv_bias or c.o_bias:
      raise ConfigError(f"qwen2 has qkv bias and no o bias; got {c.qkv_bias=}, {c.o_bias=}")
    types = c.layer_types or (("sliding_attention",) * c.num_layers if c.sliding_window else None)
    d.update(use_sliding_window=c.sliding_window is not None,
             sliding_window=c.sliding_window, max_window_layers=c.num_layers,
             layer_types=list(types) if types else ["full_attention"] * c.num_layers)
  else:  # mistral
    if c.qkv_bias or c.o_bias:
      raise ConfigError(f"mistral has no attention bias; got {c.qkv_bias=}, {c.o_bias=}")
    if c.layer_types is not None and len(set(c.layer_types)) > 1:
      raise ConfigError(f"mistral applies sliding_window to every layer; layer_types={c.layer_types} "
                        "needs arch='qwen2'")
    d.update(sliding_window=c.sliding_window)
  return d
