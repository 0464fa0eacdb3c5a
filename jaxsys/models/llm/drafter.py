"""EAGLE-style draft head (Li et al., 2024) that shares the target's embedding and LM head.

At position ``t`` the drafter sees the target's feature ``f_t`` (final hidden state after the
final norm, the input of the LM head) and the embedding of the *next* token ``x_{t+1}``:

    z_t = W_fc [e(x_{t+1}) ; f_t] + b            # [batch, seq, 2*embed] -> [batch, seq, embed]
    f^_{t+1} = norm(DecoderLayer(z_t))            # one causal pre-norm block
    q(x_{t+2}) = softmax(LMHead_target(f^_{t+1})) # the target's frozen LM head

and is trained with ``SmoothL1(f^_{t+1}, f_{t+1}) + ce_weight * CE(p_target(x_{t+2}), q)``, both
masked to response positions. The target's embedding and head are read from the target model
passed to every call, never copied, so they stay frozen and follow weight updates of the policy.

Reduced draft vocabulary (FR-Spec, Zhao et al. 2025; EAGLE-3): with ``draft_vocab=K`` the draft
head projects only to the K most frequent target tokens (``top_token_ids`` on the policy's own
rollouts, installed with ``set_draft_vocab``): their K rows of the target's head are gathered at
every call (``[K, embed]`` instead of ``[vocab, embed]`` read per draft step), and draft index
``i`` is target token ``draft_ids[i]``. Verification is untouched (the target's full
distribution), so decoding stays lossless; a token outside the K set is just never proposed. The
CE term is then over the K set (both distributions renormalised there), as EAGLE-3 trains it.

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

import numpy as np

from jaxsys.core.errors import ConfigError, ShapeError, check_min, check_positive, check_range
from jaxsys.models.llm._decoder_config import DecoderConfig
from jaxsys.models.llm.decoder import DecoderLayer
from jaxsys.nn.layers import RMSNorm, param

__all__ = ["check_compatible", "drafter_loss", "DrafterConfig", "DraftVocab", "EagleDrafter",
           "TARGET_FIELDS", "top_token_ids"]


# The target fields the draft block takes over; every other ``DecoderConfig`` field keeps its
# default, so the block is a plain pre-norm layer whatever the target's biases, windows or dtypes.
TARGET_FIELDS = ("vocab_size", "hidden_size", "num_heads", "num_kv_heads", "head_dim",
                 "intermediate_size", "rope", "rms_norm_eps")


def _from_layer(name):
  return property(lambda self: getattr(self.layer, name), doc=f"``layer.{name}``")


@dataclasses.dataclass(frozen=True)
class DrafterConfig:
  """Draft-head settings: ``layer`` configures its one decoder block (``num_layers=1``).

  Build it from the target with ``for_target``, which copies nothing by hand: the block's
  shapes are the target's ``TARGET_FIELDS`` (overridable, e.g. to test a mismatch). The shape
  fields read through (``config.head_dim`` is ``config.layer.head_dim``).
  """
  layer: DecoderConfig
  ce_weight: float = 0.1
  smooth_l1_beta: float = 1.0
  draft_vocab: int | None = None   # K: reduced draft vocabulary (module docstring); None = all

  vocab_size = _from_layer("vocab_size")
  hidden_size = _from_layer("hidden_size")
  num_heads = _from_layer("num_heads")
  num_kv_heads = _from_layer("num_kv_heads")
  head_dim = _from_layer("head_dim")
  intermediate_size = _from_layer("intermediate_size")
  rope = _from_layer("rope")
  rms_norm_eps = _from_layer("rms_norm_eps")

  def __post_init__(self):
    if not isinstance(self.layer, DecoderConfig):
      raise ConfigError(f"layer={self.layer!r} must be a DecoderConfig "
                        "(use DrafterConfig.for_target)")
    if self.layer.num_layers != 1:
      raise ConfigError(f"layer.num_layers={self.layer.num_layers} must be 1: "
                        "the draft head is one block")
    check_min(self, 0, "ce_weight")
    check_positive(self, "smooth_l1_beta")
    if self.draft_vocab is not None:
      check_range("draft_vocab", self.draft_vocab, 1, self.layer.vocab_size,
                  note=f" (the target's vocab_size={self.layer.vocab_size})")

  @classmethod
  def for_target(cls, target_config: DecoderConfig, *, ce_weight: float = 0.1,
                 smooth_l1_beta: float = 1.0, draft_vocab: int | None = None,
                 **overrides) -> "DrafterConfig":
    """The target's ``TARGET_FIELDS`` (then ``overrides``) in a one-block ``DecoderConfig``."""
    unknown = sorted(set(overrides) - set(TARGET_FIELDS))
    if unknown:
      raise ConfigError(f"overrides {unknown} are not drafter fields; "
                        f"expected some of {TARGET_FIELDS}")
    kw = {name: getattr(target_config, name) for name in TARGET_FIELDS}
    kw.update(overrides)
    return cls(DecoderConfig(num_layers=1, **kw), ce_weight, smooth_l1_beta, draft_vocab)

  def layer_config(self) -> DecoderConfig:
    return self.layer


class DraftVocab(nnx.Variable):
  """``int32[K]`` target ids of the reduced draft vocabulary (not trained: no ``nnx.Param``)."""


def top_token_ids(sequences, k: int, vocab: int, prompt_lengths=None) -> np.ndarray:
  """The ``k`` most frequent ids (``int32[k]``, most frequent first; ties to the lower id) among
  the response tokens of ``sequences`` (each cut after its ``prompt_lengths`` entry)."""
  check_range("k", k, 1, vocab, note=f" (vocab={vocab})")
  counts = np.zeros(vocab, np.int64)
  for i, s in enumerate(sequences):
    s = np.asarray(s, np.int64)[0 if prompt_lengths is None else int(prompt_lengths[i]):]
    counts += np.bincount(s[(s >= 0) & (s < vocab)], minlength=vocab)
  return np.argsort(-counts, kind="stable")[:k].astype(np.int32)


def _head_rows(target, ids):
  """The target's LM-head rows for token ``ids`` (``[K, embed]``), or None for a packed head."""
  if target.lm_head is None:
    emb = target.embed_tokens
    return None if getattr(emb, "packed", None) is not None else emb.embedding[...][ids]
  if isinstance(target.lm_head, nnx.Variable):
    return target.lm_head[...][:, ids].T  # [embed, vocab] -> [K, embed]
  return None


class EagleDrafter(nnx.Module):
  """fc([embedding ; feature]) -> one decoder layer -> norm; see the module docstring."""

  def __init__(self, config: DrafterConfig, *, rngs: nnx.Rngs):
    self.config = config
    d = config.hidden_size
    self.fc = param(rngs, (2 * d, d), ("mlp", "embed"))
    self.fc_bias = param(rngs, (d,), ("embed",), init="zeros")
    self.layer = DecoderLayer(config.layer, 0, attention_fn=None, rngs=rngs)
    self.out_norm = RMSNorm(d, eps=config.rms_norm_eps)
    if config.draft_vocab is not None:  # placeholder ids until ``set_draft_vocab``
      self.draft_ids = DraftVocab(jnp.arange(config.draft_vocab, dtype=jnp.int32))

  def set_draft_vocab(self, ids):
    """Installs the reduced vocabulary: ``ids int[K]`` distinct target ids (``top_token_ids``)."""
    k = self.config.draft_vocab
    ids = np.asarray(ids)
    if k is None:
      raise ConfigError("set_draft_vocab needs DrafterConfig.draft_vocab (it is None)")
    if ids.shape != (k,) or len(np.unique(ids)) != k:
      raise ConfigError(f"ids {ids.shape} must be {k} distinct token ids (draft_vocab={k})")
    if ids.min() < 0 or ids.max() >= self.config.vocab_size:
      raise ConfigError(f"ids must be in [0, {self.config.vocab_size})")
    self.draft_ids[...] = jnp.asarray(ids, jnp.int32)

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

  def draft_logits(self, target, feats):
    """Logits over the draft vocabulary: float32 ``[b, s, K]`` (``[b, s, vocab]`` without a
    reduced one); index ``i`` is target token ``to_target(i)``."""
    if self.config.draft_vocab is None:
      return target.logits(feats)
    ids = self.draft_ids[...]
    w = _head_rows(target, ids)
    if w is None:  # packed head: no row gather, take the K columns of the full logits
      return target.logits(feats)[..., ids]
    w = jax.lax.stop_gradient(w)
    return jnp.einsum("bsd,kd->bsk", feats, w.astype(feats.dtype)).astype(jnp.float32)

  def to_target(self, idx):
    """Draft-vocabulary indices -> target token ids (identity without a reduced vocabulary)."""
    return idx if self.config.draft_vocab is None else self.draft_ids[...][idx]


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
  # Over the draft vocabulary: the K-set renormalised target distribution when it is reduced.
  p = jax.lax.stop_gradient(jax.nn.softmax(drafter.draft_logits(target, want), axis=-1))
  logq = jax.nn.log_softmax(drafter.draft_logits(target, pred), axis=-1)
  ce = -(p * logq).sum(-1)
  feature_loss = (l1 * m).sum() / denom
  ce_loss = (ce * m).sum() / denom
  top1 = ((jnp.argmax(logq, -1) == jnp.argmax(p, -1)) * m).sum() / denom
  return feature_loss + cfg.ce_weight * ce_loss, {"feature_loss": feature_loss, "ce_loss": ce_loss,
                                                  "top1": top1}
