"""Decoder-only language model of the Llama / Qwen2 / Mistral family (Flax NNX).

Each block is pre-norm: ``h = x + attn(norm(x)); out = h + mlp(norm(h))`` with GQA attention,
RoPE (default / linear / llama3 / YaRN scaling), optional qkv bias (Qwen2), optional sliding
window (Mistral), SwiGLU MLP and RMSNorm; embeddings may be tied to the LM head.

Calling ``model(tokens)`` on ``int[batch, seq]`` returns ``logits [batch, seq, vocab]``. Keyword
arguments carry the rest: ``positions`` (``int[batch, seq]``, for packed or zigzag-reordered
sequences; default ``arange``), ``segment_ids`` (packed sequences), ``embeds`` (input embeddings
instead of tokens, e.g. from a vision tower), ``cache`` (a KV cache or any cache of the protocol in
``jaxsys.decoding.cache``) and ``return_hidden``. With a cache or ``return_hidden`` the
result is a :class:`DecoderOutput` ``(logits, cache, hidden)``.

Other attention and caches plug in through the cache protocol (``jaxsys.decoding.cache``), never by
running the blocks outside the model; ``model.embed``, ``model.final_norm`` and ``model.logits``
are the pieces around :meth:`Decoder.forward_hidden`.

Usage::

  cfg = DecoderConfig(vocab_size=256, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2)
  model = Decoder(cfg, rngs=nnx.Rngs(0))
  logits = model(jnp.zeros((1, 8), jnp.int32))            # [1, 8, 256]
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jaxsys.core.errors import ConfigError, ShapeError
from jaxsys.models.llm._decoder_config import DecoderConfig
from jaxsys.nn.attention import Attention, default_attention_fn
from jaxsys.nn.explicit import explicit_ok
from jaxsys.nn.layers import DECODE_FORMATS, DecodeWeight, Embed, RMSNorm, SwiGLU, constrain, param

__all__ = ["DecoderConfig", "Decoder", "CausalLM", "DecoderLayer", "DecoderOutput",
           "replace_config", "default_positions", "pack_for_decode"]


class DecoderOutput(NamedTuple):
  logits: Any        # [batch, seq, vocab] float32
  cache: Any         # the updated cache (or None)
  hidden: Any        # [batch, seq, embed] final hidden states after the final norm (or None)


class DecoderLayer(nnx.Module):
  """One pre-norm block: attention and SwiGLU MLP, each with a residual."""

  def __init__(self, config: DecoderConfig, layer: int, *, attention_fn: Callable | None,
               rngs: nnx.Rngs):
    c = config
    dt, pdt = c.jnp_dtype, c.jnp_param_dtype
    self.attn_norm = RMSNorm(c.hidden_size, eps=c.rms_norm_eps, param_dtype=pdt)
    self.attn = Attention(c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, rope=c.rope,
                          qkv_bias=c.qkv_bias, o_bias=c.o_bias, sliding_window=c.window(layer),
                          attention_fn=attention_fn, dtype=dt, param_dtype=pdt, rngs=rngs)
    self.mlp_norm = RMSNorm(c.hidden_size, eps=c.rms_norm_eps, param_dtype=pdt)
    self.mlp = SwiGLU(c.hidden_size, c.intermediate_size, dtype=dt, param_dtype=pdt, rngs=rngs)

  def __call__(self, x, positions, *, segment_ids=None, cache=None, layer: int = 0):
    """``x [batch, seq, embed]`` -> ``(out [batch, seq, embed], cache)``; ``cache`` follows the
    protocol of ``jaxsys.decoding.cache`` (``layer`` is this block's index in it)."""
    if cache is None:
      a = self.attn(self.attn_norm(x), positions, segment_ids=segment_ids)
    else:
      a, cache = self.attn(self.attn_norm(x), positions, segment_ids=segment_ids, cache=cache,
                           layer=layer)
    h = x + a
    return h + self.mlp(self.mlp_norm(h)), cache


def default_positions(batch: int, seq: int, offsets=None):
  """``int32[batch, seq]`` positions ``offsets[b] + arange(seq)`` (offsets default 0)."""
  pos = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (batch, seq))
  return pos if offsets is None else pos + jnp.asarray(offsets, jnp.int32)[:, None]


class Decoder(nnx.Module):
  """Causal decoder LM; see the module docstring."""

  def __init__(self, config: DecoderConfig, *, rngs: nnx.Rngs,
               attention_fn: Callable | None = None):
    c = config
    self.config = c
    self.custom_attention_fn = attention_fn  # None: jaxsys.ops.attention(impl=config.attention_impl)
    self.decode_weights: str | None = None   # set by pack_for_decode
    attention_fn = attention_fn or default_attention_fn(c.attention_impl)
    dt, pdt = c.jnp_dtype, c.jnp_param_dtype
    self.embed_tokens = Embed(c.vocab_size, c.hidden_size, dtype=dt, param_dtype=pdt, rngs=rngs)
    self.layers = nnx.List([DecoderLayer(c, i, attention_fn=attention_fn, rngs=rngs)
                            for i in range(c.num_layers)])
    self.final_norm = RMSNorm(c.hidden_size, eps=c.rms_norm_eps, param_dtype=pdt)
    self.lm_head = None if c.tie_embeddings else param(
        rngs, (c.hidden_size, c.vocab_size), ("embed", "vocab"), dtype=pdt)

  # ---- pieces -------------------------------------------------------------------------------
  def embed(self, tokens):
    """``int[batch, seq] -> [batch, seq, embed]``."""
    return self.embed_tokens(tokens)

  def logits(self, h):
    """Final hidden states (after ``final_norm``) ``[batch, seq, embed]`` -> float32 logits."""
    if self.lm_head is None:
      out = self.embed_tokens.attend(h)
    elif isinstance(self.lm_head, DecodeWeight):
      out = self.lm_head(h)
    else:
      out = jnp.einsum("bsd,dv->bsv", h, self.lm_head[...].astype(h.dtype))  # [batch, seq, vocab]
    return constrain(out.astype(jnp.float32), ("batch", "seq", "vocab"))

  def target_logprobs(self, h, targets, *, chunk: int = 128):
    """``log softmax(logits(h))[targets]``: float32 ``[batch, seq]`` from hidden states ``h
    [batch, seq, embed]`` and ``targets int[batch, seq]``.

    The head runs ``chunk`` positions at a time under ``jax.checkpoint`` (a ``lax.map`` over
    chunks), so neither the forward nor the backward pass holds the ``[batch, seq, vocab]``
    logits: at SmolLM2's 49152-token vocabulary a batch of 8 x 512 positions would be 805 MB per
    copy, ~4 copies with the softmax and its gradient. Each chunk is ``jax.nn.log_softmax``.
    """
    if h.ndim != 3 or targets.shape != h.shape[:2]:
      raise ShapeError(f"h must be [batch, seq, embed] and targets [batch, seq]; got {h.shape} "
                       f"and {targets.shape}")
    if chunk < 1:
      raise ConfigError(f"{chunk=} must be >= 1")
    b, s, d = h.shape

    def one(hc, tc):                                              # [b, c, embed], int[b, c]
      logp = jax.nn.log_softmax(self.logits(hc), axis=-1)         # [b, c, vocab] float32
      return jnp.take_along_axis(logp, tc[..., None], axis=-1)[..., 0]

    if s <= chunk:
      return one(h, targets)
    pad = -s % chunk
    hc = jnp.pad(h, ((0, 0), (0, pad), (0, 0))).reshape(b, -1, chunk, d).swapaxes(0, 1)
    tc = jnp.pad(targets, ((0, 0), (0, pad))).reshape(b, -1, chunk).swapaxes(0, 1)
    out = jax.lax.map(lambda xs: jax.checkpoint(one)(*xs), (hc, tc))   # [n_chunks, b, chunk]
    return out.swapaxes(0, 1).reshape(b, -1)[:, :s]

  # ---- full model ---------------------------------------------------------------------------
  @explicit_ok
  def __call__(self, tokens=None, *, positions=None, segment_ids=None, cache=None,
               return_hidden: bool = False, embeds=None):
    h, cache_out = self.forward_hidden(tokens, positions=positions, segment_ids=segment_ids,
                                       cache=cache, embeds=embeds)
    logits = self.logits(h)
    if cache is None and not return_hidden:
      return logits
    return DecoderOutput(logits, cache_out, h if return_hidden else None)

  @explicit_ok
  def forward_hidden(self, tokens=None, *, positions=None, segment_ids=None, cache=None,
                     embeds=None):
    """Runs the blocks and the final norm; returns ``(hidden [batch, seq, embed], cache)``.

    This is the library's only loop over the blocks: prefill, decode, paged LServe decode,
    speculative verification and the streaming-gate distillation all run through it with their
    own ``cache`` (the protocol of ``jaxsys.decoding.cache``). Callers apply :meth:`logits` to
    the positions they need (e.g. the last prompt token). On Explicit mesh axes it runs through
    ``jaxsys.nn.explicit.call_on_auto_axes``, as ``__call__`` does.
    """
    x = self._inputs(tokens, embeds)
    b, s = x.shape[:2]
    lengths = None if cache is None else cache.lengths
    if positions is None:
      positions = default_positions(b, s, lengths)
    elif positions.shape != (b, s):
      raise ShapeError(f"positions must have shape {(b, s)}, got {positions.shape}")
    if cache is not None and hasattr(cache, "check_layers"):
      cache.check_layers(len(self.layers))
    for i, layer in enumerate(self.layers):
      call = _maybe_remat(layer, self.config.remat and cache is None)
      x, cache = call(x, positions, segment_ids=segment_ids, cache=cache, layer=i)
    if cache is not None:
      cache = cache.advance(s)
    return self.final_norm(x), cache

  def _inputs(self, tokens, embeds):
    if (tokens is None) == (embeds is None):
      raise ShapeError("pass exactly one of tokens int[batch, seq] or embeds [batch, seq, embed]")
    if embeds is not None:
      if embeds.ndim != 3 or embeds.shape[-1] != self.config.hidden_size:
        raise ShapeError(f"embeds must be [batch, seq, {self.config.hidden_size}], got {embeds.shape}")
      return embeds.astype(self.config.jnp_dtype)
    tokens = jnp.asarray(tokens)
    if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
      raise ShapeError(f"tokens must be int[batch, seq], got {tokens.dtype} {tokens.shape}")
    return self.embed(tokens)


CausalLM = Decoder


def _maybe_remat(layer, remat: bool):
  """The layer itself, or a rematerialised call (activations recomputed in the backward pass)."""
  if not remat:
    return layer

  def call(x, positions, *, segment_ids=None, **kwargs):
    fn = nnx.remat(lambda lyr, x_, p_, s_: lyr(x_, p_, segment_ids=s_, **kwargs))
    return fn(layer, x, positions, segment_ids)

  return call


def replace_config(model: Decoder, *, attention_fn: Callable | None = None, **changes) -> Decoder:
  """A new model sharing ``model``'s parameters with config fields changed (and optionally a
  new ``attention_fn``; by default the model's own hook is kept).

  For changes that keep parameter shapes, e.g. RoPE scaling for long context::

    longer = replace_config(model, rope=dataclasses.replace(model.config.rope, kind="linear", factor=4.0))
  """
  config = dataclasses.replace(model.config, **changes)
  attention_fn = attention_fn or model.custom_attention_fn
  fmt = model.decode_weights
  new = nnx.eval_shape(lambda: _pack(Decoder(config, rngs=nnx.Rngs(0), attention_fn=attention_fn), fmt))
  nnx.update(new, nnx.state(model))
  return new


def pack_for_decode(model: Decoder, weights: str = "float32") -> Decoder:
  """A copy of ``model`` whose matrices are stored for memory-bound decode (``model`` is kept).

  Batch-1 decode reads every weight once per token, so its speed is weight bytes over memory
  bandwidth. Each layer's q|k|v and gate|up are fused into one matrix (fewer, larger matmuls per
  step) and, with ``weights``:

  * ``"float32"``: the same numbers (outputs equal the model's up to summation order);
  * ``"bfloat16"``: bf16 weights, half the bytes;
  * ``"int8"``: weight-only int8 with one f32 scale per output channel, a quarter of the bytes.

  bf16/int8 matrices are dequantised inside the matmul (:func:`jaxsys.nn.layers.row_matmul`);
  norms, activations, the KV cache and the logits stay in the config's dtypes. The embedding
  table (and a tied head) takes the same format. The result is for inference: it has no
  ``wq``/``gate``/... parameters, so it is not a checkpoint to save or train.
  """
  if weights not in DECODE_FORMATS:
    raise ConfigError(f"{weights=} must be one of {DECODE_FORMATS}")
  if model.decode_weights is not None:
    raise ConfigError(f"the model is already packed (decode_weights={model.decode_weights!r}); "
                      "pack the original model")
  return _pack(replace_config(model), weights)


def _pack(model: Decoder, weights: str | None) -> Decoder:
  """Packs ``model`` in place (nothing for None)."""
  if weights is None:
    return model
  for layer in model.layers:
    layer.attn.pack(weights)
    layer.mlp.pack(weights)
  model.embed_tokens.pack(weights)
  if model.lm_head is not None:
    model.lm_head = nnx.data(DecodeWeight(model.lm_head[...], weights, logical=("embed", "vocab")))
  model.decode_weights = weights
  return model


def random_model(config: DecoderConfig, seed: int = 0, attention_fn=None) -> Decoder:
  """A model with random weights (normal(0, 0.02) matrices, unit norms)."""
  return Decoder(config, rngs=nnx.Rngs(seed), attention_fn=attention_fn)

