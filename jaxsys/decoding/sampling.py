"""The one sampling module: parameters, the distribution they define, and drawing from it.

Every sampler in the library (``generate``, the serving engine, the rollout engine, speculative
acceptance) uses :class:`SamplingParams` with one convention, vLLM's: ``temperature == 0`` is
greedy, ``top_k == 0`` and ``top_p == 1`` are off. Lossless speculative sampling must reproduce
*the distribution vanilla sampling draws from*, so temperature / top-k / top-p are applied to the
target logits first (the processed distribution ``p``) and acceptance works on ``p``.

Usage::

  params = SamplingParams(temperature=0.8, top_k=20, top_p=0.95, seed=0)
  probs = target_probs(logits, params)          # float32 [..., vocab], rows sum to 1
  token = sample(key, logits, params)           # vanilla sampling from the same distribution

Inside a compiled loop whose temperature / top-p should not be compile-time constants,
:func:`sample_logits` takes them as traced values (only ``greedy`` and ``top_k`` are static).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from jaxsys.core.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """``temperature`` >= 0 (0: greedy), ``top_k`` >= 0 (0: off), ``top_p`` in (0, 1] (1: off);
  ``seed`` (an int >= 0) makes a sampled run reproducible."""
  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0
  seed: int = 0

  def __post_init__(self):
    t, k, p = self.temperature, self.top_k, self.top_p
    if not isinstance(self.seed, int) or isinstance(self.seed, bool) or self.seed < 0:
      raise ConfigError(f"seed={self.seed!r} must be an int >= 0")
    if not isinstance(t, (int, float)) or isinstance(t, bool) or not math.isfinite(t) or t < 0:
      raise ConfigError(f"temperature={t!r} must be a finite number >= 0 (0 means greedy)")
    if not isinstance(k, int) or isinstance(k, bool) or k < 0:
      raise ConfigError(f"top_k={k!r} must be an int >= 0 (0 disables top-k)")
    if not isinstance(p, (int, float)) or isinstance(p, bool) or not (0.0 < p <= 1.0):
      raise ConfigError(f"top_p={p!r} must be in (0, 1] (1 disables top-p)")

  @property
  def greedy(self) -> bool:
    return self.temperature == 0

  def check_vocab(self, vocab: int):
    if self.top_k > vocab:
      raise ConfigError(f"top_k={self.top_k} must be <= vocab size {vocab}")


GREEDY = SamplingParams(temperature=0.0)


def filtered_logits(logits, params: SamplingParams):
  """Temperature-scaled logits with filtered-out tokens at -inf (float32). Not for greedy."""
  return _filter(logits, params.temperature, params.top_k, params.top_p if params.top_p < 1.0 else None)


def _filter(logits, temperature, top_k: int, top_p):
  """``top_k`` static (0: off); ``temperature`` and ``top_p`` (None: off) may be traced."""
  x = logits.astype(jnp.float32) / temperature
  vocab = x.shape[-1]
  if top_k and top_k < vocab:
    kth = jax.lax.top_k(x, top_k)[0][..., -1:]
    x = jnp.where(x < kth, -jnp.inf, x)
  if top_p is not None:
    # Keep the smallest prefix of tokens (by probability) whose mass reaches top_p; the token
    # that crosses the threshold is kept (so at least one token always survives).
    order = jnp.argsort(-x, axis=-1)
    sorted_x = jnp.take_along_axis(x, order, axis=-1)
    sorted_p = jax.nn.softmax(sorted_x, axis=-1)
    mass_before = jnp.cumsum(sorted_p, axis=-1) - sorted_p
    keep_sorted = mass_before < top_p
    keep = jnp.take_along_axis(keep_sorted, jnp.argsort(order, axis=-1), axis=-1)
    x = jnp.where(keep, x, -jnp.inf)
  return x


def target_probs(logits, params: SamplingParams):
  """The processed distribution ``p`` (float32 ``[..., vocab]``) vanilla sampling draws from."""
  if params.greedy:
    return jax.nn.one_hot(jnp.argmax(logits, axis=-1), logits.shape[-1], dtype=jnp.float32)
  return jax.nn.softmax(filtered_logits(logits, params), axis=-1)


def sample(key, logits, params: SamplingParams):
  """Vanilla sampling from ``target_probs(logits, params)``: int32 ``[...]``."""
  if params.greedy:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  return jax.random.categorical(key, filtered_logits(logits, params), axis=-1).astype(jnp.int32)


def sample_logits(key, logits, *, greedy: bool, temperature=1.0, top_k: int = 0, top_p=None):
  """:func:`sample` with traced ``temperature`` / ``top_p`` (``top_p=None``: off; ``greedy`` and
  ``top_k`` static): ``logits float32[..., vocab] -> int32[...]``."""
  if greedy:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  return jax.random.categorical(key, _filter(logits, temperature, top_k, top_p), axis=-1).astype(jnp.int32)


def sample_probs(key, probs):
  """Samples from explicit probabilities ``[..., vocab]`` (rows need not be normalised)."""
  logp = jnp.where(probs > 0, jnp.log(jnp.where(probs > 0, probs, 1.0)), -jnp.inf)
  return jax.random.categorical(key, logp, axis=-1).astype(jnp.int32)
