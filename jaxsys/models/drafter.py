"""EAGLE-style draft head (Li et al., 2024) that shares the target's embedding and LM head.

At position ``t`` the drafter sees the target's feature ``f_t`` (final hidden state after the
final norm, the input of the LM head) and the embedding of the *next* token ``x_{t+1}``:

    z_t = W_fc [e(x_{t+1}) ; f_t] + b            # [batch, seq, 2*embed] -> [batch, seq, embed]
    f^_{t+1} = norm(DecoderLayer(z_t))            # one causal pre-norm block
    q(x_{t+2}) = softmax(LMHead_target(f^_{t+1})) # the target's frozen LM head

and is trained with ``SmoothL1(f^_{t+1}, f_{t+1}) + ce_weight * CE(p_target(x_{t+2}), q)``, both
masked to response positions. The target's embedding and head are read from the target model
passed to every call, never copied, so they stay frozen and follow weight updates of the policy.

Usage::

  drafter = EagleDrafter(DrafterConfig.for_target(target.config), rngs=nnx.Rngs(0))
  check_compatible(drafter, target)
  feats_next = drafter(target, next_tokens, feats, positions)       # training / full sequences
  loss, metrics = drafter_loss(drafter, target, tokens, feats, mask)
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxsys.core.errors import ConfigError, ShapeError
from jaxsys.models._decoder_config import DecoderConfig
from jaxsys.models.decoder import DecoderLayer
from jaxsys.nn.layers import RMSNorm, param
from jaxsys.nn.rope import RopeConfig


@dataclasses.dataclass(frozen=True)
class DrafterConfig:
  vocab_size: int
  hidden_size: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  intermediate_size: int
  rope: RopeConfig = RopeConfig()
  rms_norm_eps: float = 1e-6
  ce_weight: float = 0.1
  smooth_l1_beta: float = 1.0

  def __post_init__(self):
    for name in ("vocab_size", "hidden_size", "num_heads", "num_kv_heads", "head_dim",
                 "intermediate_size"):
      value = getattr(self, name)
      if not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{name}={value!r} must be a positive int")
    if self.num_heads % self.num_kv_heads:
      raise ConfigError(f"num_heads={self.num_heads} must be divisible by num_kv_heads={self.num_kv_heads}")
    if self.ce_weight < 0:
      raise ConfigError(f"ce_weight={self.ce_weight} must be >= 0")
    if self.smooth_l1_beta <= 0:
      raise ConfigError(f"smooth_l1_beta={self.smooth_l1_beta} must be > 0")

  @classmethod
  def for_target(cls, target_config: DecoderConfig, **overrides) -> "DrafterConfig":
    c = target_config
    kw = dict(vocab_size=c.vocab_size, hidden_size=c.hidden_size, num_heads=c.num_heads,
              num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
              intermediate_size=c.intermediate_size, rope=c.rope, rms_norm_eps=c.rms_norm_eps)
    kw.update(overrides)
    return cls(**kw)

  def layer_config(self) -> DecoderConfig:
    return DecoderConfig(vocab_size=self.vocab_size, hidden_size=self.hidden_size,
                         intermediate_size=self.intermediate_size, num_layers=1,
                         num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                         head_dim=self.head_dim, rope=self.rope, rms_norm_eps=self.rms_norm_eps)


class EagleDrafter(nnx.Module):
  """fc([embedding ; feature]) -> one decoder layer -> norm; see the module docstring."""

  def __init__(self, config: DrafterConfig, *, rngs: nnx.Rngs):
    self.config = config
    d = config.hidden_size
    self.fc = param(rngs, (2 * d, d), ("mlp", "embed"))
    self.fc_bias = param(rngs, (d,), ("embed",), init="zeros")
    self.layer = DecoderLayer(config.layer_config(), 0, attention_fn=None, rngs=rngs)
    self.out_norm = RMSNorm(d, eps=config.rms_norm_eps)

  def fuse(self, target, tokens, feats):
    """``z = W_fc [e(tokens) ; feats] + b``: ``[b, s] , [b, s, embed] -> [b, s, embed]``."""
    e = jax.lax.stop_gradient(target.embed(tokens)).astype(feats.dtype)
    x = jnp.concatenate([e, feats], axis=-1)  # [batch, seq, 2*embed]
    return jnp.einsum("bsc,cd->bsd", x, self.fc[...].astype(x.dtype)) + self.fc_bias[...]

  def __call__(self, target, tokens, feats, positions=None):
    """Predicted next features ``[b, s, embed]`` for full sequences (causal, no cache)."""
    b, s = tokens.shape
    if positions is None:
      positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    x, _ = self.layer(self.fuse(target, tokens, feats), positions)
    return self.out_norm(x)

  def logits(self, target, feats):
    """Draft logits through the target's frozen LM head (float32 ``[b, s, vocab]``)."""
    return target.logits(feats)


def check_compatible(drafter: EagleDrafter, target):
  """Raises ``ShapeError`` if the drafter cannot share the target's embedding / head."""
  dc, tc = drafter.config, target.config
  if dc.vocab_size != tc.vocab_size:
    raise ShapeError(f"drafter vocab_size={dc.vocab_size} must equal the target's vocab_size={tc.vocab_size}")
  if dc.hidden_size != tc.hidden_size:
    raise ShapeError(f"drafter hidden_size={dc.hidden_size} must equal the target's hidden_size={tc.hidden_size}")


def drafter_loss(drafter: EagleDrafter, target, tokens, feats, mask):
  """EAGLE loss on full sequences.

  Args:
    tokens: ``int[b, S]`` the whole sequence (prompt + response).
    feats: ``[b, S, embed]`` target features ``f_t`` (after the final norm).
    mask: ``[b, S]`` 1 where position ``t``'s next token is a response token (what drafting
      predicts); the prediction ``f^_t`` made from position ``t-1`` is counted where ``mask[t]``.
  Returns ``(loss, {"feature_loss", "ce_loss", "top1"})``.
  """
  if tokens.ndim != 2 or feats.shape[:2] != tokens.shape or mask.shape != tokens.shape:
    raise ShapeError(f"tokens {tokens.shape}, feats {feats.shape} and mask {mask.shape} must share [batch, seq]")
  cfg = drafter.config
  feats = jax.lax.stop_gradient(feats)
  pred = drafter(target, tokens[:, 1:], feats[:, :-1])  # f^_{t+1}: [b, S-1, embed]
  want = feats[:, 1:]
  m = mask[:, 1:].astype(jnp.float32)
  denom = jnp.maximum(m.sum(), 1.0)
  l1 = optax.huber_loss(pred, want, delta=cfg.smooth_l1_beta).mean(-1) / cfg.smooth_l1_beta
  p = jax.lax.stop_gradient(jax.nn.softmax(target.logits(want), axis=-1))
  logq = jax.nn.log_softmax(target.logits(pred), axis=-1)
  ce = -(p * logq).sum(-1)
  feature_loss = (l1 * m).sum() / denom
  ce_loss = (ce * m).sum() / denom
  top1 = ((jnp.argmax(logq, -1) == jnp.argmax(p, -1)) * m).sum() / denom
  return feature_loss + cfg.ce_weight * ce_loss, {"feature_loss": feature_loss, "ce_loss": ce_loss,
                                                  "top1": top1}
