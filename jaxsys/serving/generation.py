"""Batched autoregressive generation with a contiguous KV cache: a thin layer over the decoding core.

``generate(model, prompts, max_new_tokens=...)`` takes prompts of different lengths (lists of
token ids), right-pads them into one batch (each row keeps its own positions and cache length),
runs one prefill over the padded prompts (``jaxsys.decoding.core.prefill``) and then the whole
decode loop inside one jitted ``lax.while_loop`` whose carry holds the cache (updated in place,
stopping early once every row hit a stop token). Shapes are bucketed to powers of two (batch,
prompt length, new tokens), so a new prompt length or ``max_new_tokens`` inside a bucket reuses
the compiled executables.

Sampling: ``sampling=None`` (greedy) or a ``jaxsys.decoding.SamplingParams`` (temperature 0 is
greedy; temperature / top-k / top-p, reproducible by ``seed``). ``logprobs`` are the model's
log-probabilities (temperature 1, before top-k/top-p) of the chosen tokens. With
``return_hidden=True`` the result carries, for every new token, the final hidden state (after
the final norm) at the position whose logits produced it (what an EAGLE-style drafter trains on).

For a Python-driven loop :func:`decode_step` is a jitted single step that donates the cache, so
XLA updates it in place.

Usage::

  res = generate(model, [[1, 2, 3], [4, 5]], max_new_tokens=16,
                 sampling=SamplingParams(0.8, top_p=0.9))
  res.tokens[0], res.logprobs[0]
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxsys.core.bench import TRACE_COUNTS  # noqa: F401  (compile counts: "decoding.prefill", ...)
from jaxsys.decoding import core
from jaxsys.decoding.cache import KVCache
from jaxsys.decoding.core import bucket, context_length, describe_context  # noqa: F401
from jaxsys.decoding.sampling import GREEDY, SamplingParams


@dataclasses.dataclass
class GenerationResult:
  tokens: list[list[int]]            # new tokens of prompt i (up to and including a stop token)
  logprobs: list[np.ndarray]         # float32[len(tokens[i])]
  hidden: list[np.ndarray] | None    # [len(tokens[i]), embed] when return_hidden
  finished: list[bool]               # True where a stop token ended the row
  prefill_seconds: float = 0.0
  decode_seconds: float = 0.0


def decode_step(model, cache: KVCache, tokens):
  """One jitted step: ``tokens int[batch, s]`` -> ``(logits, hidden, cache)``; donates ``cache``
  (do not reuse the cache passed in)."""
  graphdef, state = nnx.split(model)
  return core.jit_step(graphdef, state, cache, jnp.asarray(tokens, jnp.int32))


def generate(model, prompts, *, max_new_tokens: int, sampling: SamplingParams | None = None,
             stop_tokens: Sequence[int] | None = None, return_hidden: bool = False,
             cache_dtype=None, min_bucket: int = 16) -> GenerationResult:
  """Generates up to ``max_new_tokens`` for each prompt (see the module docstring).

  ``stop_tokens`` default to the config's ``eos_token_id`` (pass ``()`` to never stop early);
  the stop token is included in ``tokens[i]``. The longest prompt + ``max_new_tokens`` must fit
  the model's :func:`context_length`.
  """
  cfg = model.config
  if not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
    raise core.ConfigError(f"{max_new_tokens=} must be a positive int")
  arrs = core.check_prompts(prompts, cfg.vocab_size)
  # The cache holds prompt + new tokens (bucketed): bound them before allocating anything.
  core.check_fits(arrs, max_new_tokens, cfg)
  s = GREEDY if sampling is None else sampling
  if not isinstance(s, SamplingParams):
    raise core.ConfigError(f"sampling must be a SamplingParams or None (greedy), got {type(s).__name__}")
  s.check_vocab(cfg.vocab_size)
  stops = tuple(cfg.eos_ids if stop_tokens is None else stop_tokens)
  n = len(arrs)
  b = bucket(n, 1)
  p_len = bucket(max(len(a) for a in arrs), min_bucket)
  n_steps = bucket(max_new_tokens, min_bucket)
  tokens, lengths = core.pad_batch(arrs, b, p_len)
  graphdef, state = nnx.split(model)
  cache = KVCache.init(cfg, b, p_len + n_steps, cache_dtype)
  t0 = time.perf_counter()
  logits0, h0, cache = core.jit_prefill(graphdef, state, jnp.asarray(tokens), jnp.asarray(lengths),
                                        cache, return_hidden)
  logits0.block_until_ready()
  t1 = time.perf_counter()
  params = {"seed": jnp.uint32(s.seed), "temperature": jnp.float32(max(s.temperature, 1e-6)),
            "top_p": jnp.float32(s.top_p), "max_new": jnp.int32(max_new_tokens),
            "stops": jnp.asarray(stops if stops else (-1,), jnp.int32)}
  out_tok, out_logp, out_h, counts, finished, _ = core.jit_decode_loop(
      graphdef, state, cache, logits0, h0, params, (s.greedy, s.top_k, s.top_p < 1.0), n_steps,
      return_hidden)
  out_tok, out_logp, counts, finished = jax.device_get((out_tok, out_logp, counts, finished))
  t2 = time.perf_counter()
  out_h = None if out_h is None else np.asarray(out_h)
  return GenerationResult(
      tokens=[out_tok[i, :counts[i]].tolist() for i in range(n)],
      logprobs=[out_logp[i, :counts[i]] for i in range(n)],
      hidden=None if out_h is None else [out_h[i, :counts[i]] for i in range(n)],
      finished=[bool(finished[i]) for i in range(n)],
      prefill_seconds=t1 - t0, decode_seconds=t2 - t1)
