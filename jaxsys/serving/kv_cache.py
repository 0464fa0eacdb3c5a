"""Contiguous KV cache for the decoder LM: one ``[batch, max_len, kv_heads, head_dim]`` buffer
per layer for keys and one for values, plus ``lengths int32[batch]`` (tokens held per row).

Row ``b`` holds its tokens at cache indices ``0 .. lengths[b]-1`` (right-padded batches: each
sequence at its own length). A model call with ``cache=`` writes the new keys/values at
``lengths + arange(seq)`` with a scatter that XLA performs in place when the cache is donated
(``jax.jit(..., donate_argnums=...)``), attends over rows ``< lengths + seq`` and returns the
cache with ``lengths + seq``.

Usage::

  cache = KVCache.init(model.config, batch=2, max_len=128)
  out = model(prompt_tokens, cache=cache)          # DecoderOutput(logits, cache, hidden)
  cache = out.cache.with_lengths(true_prompt_lengths)
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from jaxsys.core.errors import ConfigError, ShapeError


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
  k: tuple[Any, ...]   # per layer [batch, max_len, kv_heads, head_dim]
  v: tuple[Any, ...]
  lengths: Any         # int32[batch]

  @classmethod
  def init(cls, config, batch: int, max_len: int, dtype=None) -> "KVCache":
    """Zeros for ``config`` (a DecoderConfig); ``dtype`` defaults to the activation dtype."""
    if batch < 1 or max_len < 1:
      raise ConfigError(f"{batch=} and {max_len=} must be >= 1")
    dtype = jnp.dtype(dtype or config.dtype)
    shape = (batch, max_len, config.num_kv_heads, config.head_dim)
    zeros = tuple(jnp.zeros(shape, dtype) for _ in range(config.num_layers))
    zeros_v = tuple(jnp.zeros(shape, dtype) for _ in range(config.num_layers))
    return cls(zeros, zeros_v, jnp.zeros((batch,), jnp.int32))

  @property
  def batch(self) -> int:
    return self.k[0].shape[0]

  @property
  def max_len(self) -> int:
    return self.k[0].shape[1]

  @property
  def num_layers(self) -> int:
    return len(self.k)

  def replace(self, **changes) -> "KVCache":
    return dataclasses.replace(self, **changes)

  def with_lengths(self, lengths) -> "KVCache":
    """Sets the valid length of every row (e.g. true prompt lengths after a padded prefill)."""
    lengths = jnp.asarray(lengths, jnp.int32)
    if lengths.shape != (self.batch,):
      raise ShapeError(f"lengths must be int[batch={self.batch}], got shape {lengths.shape}")
    return self.replace(lengths=lengths)

  def nbytes(self) -> int:
    return sum(x.size * x.dtype.itemsize for x in self.k + self.v)
