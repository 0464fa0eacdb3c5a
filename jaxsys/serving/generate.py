"""Batched autoregressive generation with a contiguous KV cache (prefill + decode).

``generate(model, prompts, max_new_tokens=...)`` takes prompts of different lengths (lists of
token ids), right-pads them into one batch (each row keeps its own positions and cache length),
runs one prefill over the padded prompts and then the whole decode loop inside one jitted
``lax.while_loop`` whose carry holds the cache (updated in place, stopping early once every row
hit a stop token). Shapes are bucketed to powers of two (batch, prompt length, new tokens), so
a new prompt length or ``max_new_tokens`` inside a bucket reuses the compiled executables.

Sampling: greedy (``sampling=None``) or ``Sampling(temperature, top_k, top_p, seed)``;
``logprobs`` are the model's log-probabilities (temperature 1, before top-k/top-p) of the
chosen tokens. With ``return_hidden=True`` the result carries, for every new token, the final
hidden state (after the final norm) at the position whose logits produced it (what an
EAGLE-style drafter trains on).

For a Python-driven loop (engines, speculative decoding) :func:`decode_step` is a jitted single
step that donates the cache, so XLA updates it in place.

Usage::

  res = generate(model, [[1, 2, 3], [4, 5]], max_new_tokens=16, sampling=Sampling(0.8, top_p=0.9))
  res.tokens[0], res.logprobs[0]
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxsys.core.errors import ConfigError, InputError
from jaxsys.serving.kv_cache import KVCache

#: How often each jitted function was traced (a retrace means a recompile); for tests/benchmarks.
TRACE_COUNTS: dict[str, int] = {"prefill": 0, "decode": 0, "step": 0}


@dataclasses.dataclass(frozen=True)
class Sampling:
  """Temperature / top-k / top-p sampling, reproducible by ``seed``."""
  temperature: float = 1.0
  top_k: int | None = None
  top_p: float | None = None
  seed: int = 0

  def __post_init__(self):
    if not self.temperature > 0:
      raise ConfigError(f"temperature={self.temperature} must be > 0 (use sampling=None for greedy)")
    if self.top_k is not None and self.top_k < 1:
      raise ConfigError(f"top_k={self.top_k} must be >= 1 or None")
    if self.top_p is not None and not 0 < self.top_p <= 1:
      raise ConfigError(f"top_p={self.top_p} must be in (0, 1] or None")


@dataclasses.dataclass
class GenerationResult:
  tokens: list[list[int]]            # new tokens of prompt i (up to and including a stop token)
  logprobs: list[np.ndarray]         # float32[len(tokens[i])]
  hidden: list[np.ndarray] | None    # [len(tokens[i]), embed] when return_hidden
  finished: list[bool]               # True where a stop token ended the row
  prefill_seconds: float = 0.0
  decode_seconds: float = 0.0


def bucket(n: int, minimum: int = 16) -> int:
  """The smallest power of two >= max(n, minimum)."""
  return max(minimum, 1 << max(0, int(n) - 1).bit_length())


def sample_tokens(logits, key, *, greedy: bool, temperature=1.0, top_k: int | None = None,
                  top_p=None):
  """Picks ``int32[batch]`` from ``logits float32[batch, vocab]``."""
  if greedy:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  scaled = logits / temperature
  if top_k is not None and top_k < logits.shape[-1]:
    kth = jax.lax.top_k(scaled, top_k)[0][:, -1:]  # [batch, 1]
    scaled = jnp.where(scaled < kth, -jnp.inf, scaled)
  if top_p is not None:
    order = jnp.argsort(-scaled, axis=-1)
    sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass of strictly more likely tokens
    keep_sorted = before < top_p                 # always keeps the most likely token
    keep = jnp.zeros_like(keep_sorted).at[jnp.arange(logits.shape[0])[:, None], order].set(keep_sorted)
    scaled = jnp.where(keep, scaled, -jnp.inf)
  return jax.random.categorical(key, scaled, axis=-1).astype(jnp.int32)


@functools.partial(jax.jit, static_argnums=(0, 5), donate_argnums=(4,))
def _prefill(graphdef, state, tokens, lengths, cache, with_hidden):
  TRACE_COUNTS["prefill"] += 1
  model = nnx.merge(graphdef, state)
  h, cache = model.forward_hidden(tokens, cache=cache)
  rows = jnp.arange(tokens.shape[0])
  h_last = h[rows, lengths - 1][:, None]  # [batch, 1, embed]
  logits = model.logits(h_last)[:, 0]     # [batch, vocab]
  return logits, (h_last[:, 0] if with_hidden else None), cache.with_lengths(lengths)


@functools.partial(jax.jit, static_argnums=(0, 6, 7, 8), donate_argnums=(2,))
def _decode(graphdef, state, cache, logits0, hidden0, params, mode, num_steps, with_hidden):
  """Samples up to ``num_steps`` (static bucket) tokens; stops at ``params['max_new']``."""
  TRACE_COUNTS["decode"] += 1
  greedy, top_k, use_top_p = mode
  model = nnx.merge(graphdef, state)
  b = logits0.shape[0]
  key = jax.random.key(params["seed"])
  stops = params["stops"]

  def pick(logits, step):
    tok = sample_tokens(logits, jax.random.fold_in(key, step), greedy=greedy,
                        temperature=params["temperature"], top_k=top_k,
                        top_p=params["top_p"] if use_top_p else None)
    logp = jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), tok[:, None], axis=-1)[:, 0]
    return tok, logp

  tok0, logp0 = pick(logits0, 0)
  out_tok = jnp.zeros((b, num_steps), jnp.int32).at[:, 0].set(tok0)
  out_logp = jnp.zeros((b, num_steps), jnp.float32).at[:, 0].set(logp0)
  out_h = None
  if with_hidden:
    out_h = jnp.zeros((b, num_steps, hidden0.shape[-1]), hidden0.dtype).at[:, 0].set(hidden0)
  done = jnp.isin(tok0, stops)
  n_done = jnp.where(done, 1, num_steps + 1)  # step count where each row stopped

  def cond(c):
    step, _, _, done, *_ = c
    return (step < params["max_new"]) & ~jnp.all(done)

  def body(c):
    step, cache, tok, done, n_done, out_tok, out_logp, out_h = c
    h, cache = model.forward_hidden(tok[:, None], cache=cache)
    logits = model.logits(h)[:, 0]
    nxt, logp = pick(logits, step)
    out_tok = out_tok.at[:, step].set(nxt)
    out_logp = out_logp.at[:, step].set(logp)
    if out_h is not None:
      out_h = out_h.at[:, step].set(h[:, 0])
    stop = jnp.isin(nxt, stops) & ~done
    n_done = jnp.where(stop, step + 1, n_done)
    return step + 1, cache, nxt, done | stop, n_done, out_tok, out_logp, out_h

  carry = (jnp.int32(1), cache, tok0, done, n_done, out_tok, out_logp, out_h)
  step, cache, _, _, n_done, out_tok, out_logp, out_h = jax.lax.while_loop(cond, body, carry)
  # The cache goes back out so its donated buffer is reused for the loop carry.
  return out_tok, out_logp, out_h, jnp.minimum(n_done, step), n_done <= num_steps, cache


@functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(2,))
def _step(graphdef, state, cache, tokens):
  TRACE_COUNTS["step"] += 1
  model = nnx.merge(graphdef, state)
  h, cache = model.forward_hidden(tokens, cache=cache)
  return model.logits(h), h, cache


def decode_step(model, cache: KVCache, tokens):
  """One jitted step: ``tokens int[batch, s]`` -> ``(logits, hidden, cache)``; donates ``cache``
  (do not reuse the cache passed in)."""
  graphdef, state = nnx.split(model)
  return _step(graphdef, state, cache, jnp.asarray(tokens, jnp.int32))


def context_length(cfg) -> int:
  """The longest sequence (prompt + new tokens) the model is meant to see, vLLM's rule:
  ``max_position_embeddings``, times the RoPE ``factor`` for linear interpolation (and for YaRN,
  ``original_max_position_embeddings x factor``); llama3 scaling states its extended length already."""
  n = int(cfg.max_position_embeddings)
  rope = getattr(cfg, "rope", None)
  if rope is not None and rope.kind == "linear":
    n = int(n * rope.factor)
  elif rope is not None and rope.kind == "yarn":
    n = int(rope.original_max_position_embeddings * rope.factor)
  return n


def describe_context(cfg) -> str:
  """Where :func:`context_length` comes from, for error messages."""
  n, mpe = context_length(cfg), cfg.max_position_embeddings
  if n == mpe:
    return f"the model's max_position_embeddings={mpe}"
  return f"the model's context length {n} (max_position_embeddings={mpe}, rope {cfg.rope.kind} x{cfg.rope.factor:g})"


def _check_prompts(prompts, vocab):
  if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) or not prompts:
    raise InputError("prompts must be a non-empty list of token-id lists")
  out = []
  for i, p in enumerate(prompts):
    arr = np.asarray(p)
    if arr.ndim != 1 or arr.size == 0:
      raise InputError(f"prompts[{i}] must be a non-empty 1-D list of token ids, got shape {arr.shape}")
    if not np.issubdtype(arr.dtype, np.integer):
      raise InputError(f"prompts[{i}] must hold integer token ids, got dtype {arr.dtype}")
    if arr.min() < 0 or arr.max() >= vocab:
      raise InputError(f"prompts[{i}] has token ids outside [0, vocab_size={vocab})")
    out.append(arr.astype(np.int32))
  return out


def generate(model, prompts, *, max_new_tokens: int, sampling: Sampling | None = None,
             stop_tokens: Sequence[int] | None = None, return_hidden: bool = False,
             cache_dtype=None, min_bucket: int = 16) -> GenerationResult:
  """Generates up to ``max_new_tokens`` for each prompt (see the module docstring).

  ``stop_tokens`` default to the config's ``eos_token_id`` (pass ``()`` to never stop early);
  the stop token is included in ``tokens[i]``. The longest prompt + ``max_new_tokens`` must fit
  the model's :func:`context_length`.
  """
  cfg = model.config
  if not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
    raise ConfigError(f"{max_new_tokens=} must be a positive int")
  arrs = _check_prompts(prompts, cfg.vocab_size)
  # The cache holds prompt + new tokens (bucketed): bound them before allocating anything.
  i = int(np.argmax([len(a) for a in arrs]))
  if len(arrs[i]) + max_new_tokens > context_length(cfg):
    raise InputError(f"prompts[{i}] has {len(arrs[i])} tokens: + {max_new_tokens=} = "
                     f"{len(arrs[i]) + max_new_tokens} exceeds {describe_context(cfg)}")
  stops = tuple(cfg.eos_ids if stop_tokens is None else stop_tokens)
  n = len(arrs)
  b = bucket(n, 1)
  lengths = np.array([len(a) for a in arrs] + [1] * (b - n), np.int32)
  p_len = bucket(lengths.max(), min_bucket)
  n_steps = bucket(max_new_tokens, min_bucket)
  tokens = np.zeros((b, p_len), np.int32)
  for i, a in enumerate(arrs):
    tokens[i, :len(a)] = a
  graphdef, state = nnx.split(model)
  cache = KVCache.init(cfg, b, p_len + n_steps, cache_dtype)
  t0 = time.perf_counter()
  logits0, h0, cache = _prefill(graphdef, state, jnp.asarray(tokens), jnp.asarray(lengths), cache,
                                return_hidden)
  logits0.block_until_ready()
  t1 = time.perf_counter()
  s = sampling or Sampling()
  params = {"seed": jnp.uint32(s.seed), "temperature": jnp.float32(s.temperature),
            "top_p": jnp.float32(1.0 if s.top_p is None else s.top_p),
            "max_new": jnp.int32(max_new_tokens),
            "stops": jnp.asarray(stops if stops else (-1,), jnp.int32)}
  out_tok, out_logp, out_h, counts, finished, _ = _decode(
      graphdef, state, cache, logits0, h0, params,
      (sampling is None, None if sampling is None else s.top_k, s.top_p is not None), n_steps,
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
