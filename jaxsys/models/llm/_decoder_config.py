"""``DecoderConfig``: the architecture of a Llama / Qwen2 / Mistral-family decoder LM."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jaxsys.core.errors import ConfigError, check_divisible, check_min, check_one_of, check_positive
from jaxsys.nn.rope import RopeConfig

__all__ = ["ARCHS", "DecoderConfig", "DTYPES", "LAYER_TYPES"]

ARCHS = ("llama", "qwen2", "mistral")
LAYER_TYPES = ("full_attention", "sliding_attention")
DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
  """Decoder-only transformer: pre-norm blocks of GQA attention with RoPE and a SwiGLU MLP.

  ``sliding_window`` applies to the layers whose ``layer_types`` entry is "sliding_attention"
  (all layers when ``layer_types`` is None, as in Mistral). ``dtype`` is the activation dtype,
  ``param_dtype`` the stored parameter dtype. ``arch`` picks the Hugging Face class written by
  ``save_pretrained`` (the math is fully described by the other fields).
  """
  vocab_size: int = 256
  hidden_size: int = 64
  intermediate_size: int = 128
  num_layers: int = 2
  num_heads: int = 4
  num_kv_heads: int | None = None
  head_dim: int | None = None
  rms_norm_eps: float = 1e-6
  rope: RopeConfig = RopeConfig()
  qkv_bias: bool = False
  o_bias: bool = False
  tie_embeddings: bool = False
  sliding_window: int | None = None
  layer_types: tuple[str, ...] | None = None
  max_position_embeddings: int = 2048
  arch: str = "llama"
  bos_token_id: int | None = None
  eos_token_id: int | tuple[int, ...] | None = None
  pad_token_id: int | None = None
  dtype: str = "float32"
  param_dtype: str = "float32"
  attention_impl: str = "auto"
  remat: bool = False

  def __post_init__(self):
    if self.num_kv_heads is None:
      object.__setattr__(self, "num_kv_heads", self.num_heads)
    if self.head_dim is None:
      if self.num_heads > 0 and self.hidden_size % self.num_heads:
        raise ConfigError(f"hidden_size={self.hidden_size} must be divisible by num_heads="
                          f"{self.num_heads} when head_dim is not given")
      object.__setattr__(self, "head_dim", self.hidden_size // max(self.num_heads, 1))
    check_positive(self, "vocab_size", "hidden_size", "intermediate_size", "num_layers",
                   "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings", integer=True)
    check_divisible("num_heads", self.num_heads, "num_kv_heads", self.num_kv_heads)
    if self.head_dim % 2:
      raise ConfigError(f"head_dim={self.head_dim} must be even for RoPE")
    check_positive(self, "rms_norm_eps")
    if not isinstance(self.rope, RopeConfig):
      raise ConfigError(f"rope={self.rope!r} must be a jaxsys.nn.RopeConfig")
    check_one_of("arch", self.arch, ARCHS)
    if self.sliding_window is not None:
      check_min(self, 1, "sliding_window", note=" or None")
    if self.layer_types is not None:
      object.__setattr__(self, "layer_types", tuple(self.layer_types))
      if len(self.layer_types) != self.num_layers:
        raise ConfigError(f"layer_types has {len(self.layer_types)} entries but num_layers={self.num_layers}")
      bad = [t for t in self.layer_types if t not in LAYER_TYPES]
      if bad:
        raise ConfigError(f"layer_types entries {bad} must be in {LAYER_TYPES}")
      if "sliding_attention" in self.layer_types and self.sliding_window is None:
        raise ConfigError("layer_types has sliding_attention layers but sliding_window is None")
    for name in ("dtype", "param_dtype"):
      if getattr(self, name) not in DTYPES:
        raise ConfigError(f"{name}={getattr(self, name)!r} must be one of {DTYPES}")
    if isinstance(self.eos_token_id, list):
      object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))

  def window(self, layer: int) -> int | None:
    """Sliding window of ``layer`` (None: full causal attention)."""
    if self.sliding_window is None:
      return None
    if self.layer_types is None or self.layer_types[layer] == "sliding_attention":
      return self.sliding_window
    return None

  @property
  def jnp_dtype(self):
    return jnp.dtype(self.dtype)

  @property
  def jnp_param_dtype(self):
    return jnp.dtype(self.param_dtype)

  @property
  def eos_ids(self) -> tuple[int, ...]:
    e = self.eos_token_id
    return () if e is None else (e,) if isinstance(e, int) else tuple(e)

  def replace(self, **changes) -> "DecoderConfig":
    return dataclasses.replace(self, **changes)

  def num_params(self) -> int:
    d, f, v = self.hidden_size, self.intermediate_size, self.vocab_size
    hd, h, kv = self.head_dim, self.num_heads, self.num_kv_heads
    attn = d * hd * (h + 2 * kv) + h * hd * d
    attn += (h + 2 * kv) * hd * self.qkv_bias + d * self.o_bias
    layer = attn + 3 * d * f + 2 * d
    return self.num_layers * layer + v * d * (1 if self.tie_embeddings else 2) + d
