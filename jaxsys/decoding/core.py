"""The decoding core: request checks, bucketing, prefill, step and the on-device loop.

``jaxsys.serving.generate``, the paged ``ServingEngine`` and the speculative ``RolloutEngine``
are thin layers over these pieces; the model is always run through ``Decoder.forward_hidden``
with a cache of the protocol in ``jaxsys.decoding.cache``.

* :func:`check_prompts`, :func:`check_fits`: one validation of token-id prompts (clear errors
  naming the prompt and the bound).
* :func:`bucket`, :func:`bucket_of`, :func:`pad_batch`: one bucketing of batch and lengths, so a
  new request size inside a bucket reuses the compiled executables.
* :func:`prefill_hidden` / :func:`prefill`: a right-padded prompt batch (token ids, or input
  ``embeds``) into an empty contiguous cache (static causal layout: blocks above the diagonal
  are skipped); :func:`jit_prefill_embeds` prefills each prompt once and shares the cache with
  its group of rollouts (``KVCache.repeat``).
* :func:`step`: one forward over a few new tokens per row, the cache updated in place.
* :func:`decode_loop`: ``generate``'s whole decode as one ``lax.while_loop``; :func:`while_running`
  is the loop every on-device decode phase runs (``generate``, the rollout engine's vanilla and
  speculative phases): steps while enough rows run, bounded by a step budget.
* :func:`emit`: appends a step's tokens to per-row outputs, stopping at stop tokens / ``max_new``.

The ``jit_*`` functions are the compiled entry points (``graphdef`` static, cache donated); each
counts its traces in ``jaxsys.core.bench.TRACE_COUNTS`` (``"decoding.prefill"`` ...).
"""

from __future__ import annotations

import bisect
import contextlib
import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import io_callback

from jaxsys.core.bench import count_trace
from jaxsys.core.errors import ConfigError, InputError
from jaxsys.decoding.cache import KVCache, Prefill
from jaxsys.decoding.sampling import penalize, sample_logits

__all__ = [
    "bucket", "bucket_of", "check_fits", "check_prompts", "context_length", "decode_loop",
    "describe_context", "emit", "jit_decode_loop", "jit_prefill", "jit_prefill_embeds", "jit_step",
    "pad_batch", "prefill", "prefill_hidden", "step", "streaming", "while_running",
]

# ---- requests --------------------------------------------------------------------------------


def check_prompts(prompts, vocab: int, *, max_len: int | None = None,
                  limit: str = "max_len") -> list[np.ndarray]:
  """Token-id prompts (a non-empty list of non-empty 1-D integer lists inside ``[0, vocab)``,
  each at most ``max_len`` tokens) -> ``int32`` arrays."""
  if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) or not prompts:
    raise InputError("prompts must be a non-empty list of token-id lists")
  out = []
  for i, p in enumerate(prompts):
    arr = np.asarray(p)
    if arr.ndim != 1 or arr.size == 0:
      raise InputError(f"prompts[{i}] must be a non-empty 1-D list of token ids, got shape {arr.shape}")
    if not np.issubdtype(arr.dtype, np.integer):
      raise InputError(f"prompts[{i}] must hold integer token ids, got dtype {arr.dtype}")
    if max_len is not None and arr.size > max_len:
      raise InputError(f"prompts[{i}] has {arr.size} tokens > {limit}={max_len}")
    if arr.min() < 0 or arr.max() >= vocab:
      raise InputError(f"prompts[{i}] has token ids outside [0, vocab_size={vocab})")
    out.append(arr.astype(np.int32))
  return out


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


def check_fits(arrs, max_new_tokens: int, cfg) -> None:
  """The longest prompt + ``max_new_tokens`` must fit the model's :func:`context_length`
  (checked before any cache is allocated)."""
  if not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
    raise ConfigError(f"{max_new_tokens=} must be a positive int")
  i = int(np.argmax([len(a) for a in arrs]))
  if len(arrs[i]) + max_new_tokens > context_length(cfg):
    raise InputError(f"prompts[{i}] has {len(arrs[i])} tokens: + {max_new_tokens=} = "
                     f"{len(arrs[i]) + max_new_tokens} exceeds {describe_context(cfg)}")


# ---- bucketing -------------------------------------------------------------------------------


def bucket(n: int, minimum: int = 16) -> int:
  """The smallest power of two >= max(n, minimum)."""
  return max(minimum, 1 << max(0, int(n) - 1).bit_length())


def bucket_of(n: int, buckets: Sequence[int]) -> int:
  """The smallest of ``buckets`` (sorted ascending) holding ``n``."""
  i = bisect.bisect_left(buckets, n)
  if i == len(buckets):
    raise ConfigError(f"batch size {n} exceeds the largest bucket {buckets[-1]}")
  return buckets[i]


def pad_batch(arrs, batch: int, length: int) -> tuple[np.ndarray, np.ndarray]:
  """Right-pads prompts into ``tokens int32[batch, length]``; ``lengths int32[batch]`` (padding
  rows get length 1 so that their last-token index is valid)."""
  tokens = np.zeros((batch, length), np.int32)
  lengths = np.ones((batch,), np.int32)
  for i, a in enumerate(arrs):
    tokens[i, :len(a)] = a
    lengths[i] = len(a)
  return tokens, lengths


# ---- model passes ----------------------------------------------------------------------------


def prefill_hidden(model, tokens, lengths, cache: KVCache, *, embeds=None):
  """Right-padded prompts ``tokens int[b, T]`` (true ``lengths int[b]``) into the empty ``cache``.

  With ``embeds [b, T, embed]`` (and ``tokens=None``) the prompt enters as input embeddings
  instead of token ids (a VLM's interleaved text + frame tokens).
  Returns ``(hidden [b, T, embed] after the final norm, cache with lengths)``."""
  h, cache = model.forward_hidden(tokens, cache=Prefill(cache), embeds=embeds)
  return h, cache.with_lengths(lengths)


def prefill(model, tokens, lengths, cache: KVCache, with_hidden: bool = False, *, embeds=None):
  """:func:`prefill_hidden`, then the logits of each row's last prompt token.

  Returns ``(logits float32[b, vocab], hidden [b, embed] or None, cache)``."""
  h, cache = prefill_hidden(model, tokens, lengths, cache, embeds=embeds)
  h_last = h[jnp.arange(h.shape[0]), lengths - 1][:, None]  # [b, 1, embed]
  logits = model.logits(h_last)[:, 0]
  return logits, (h_last[:, 0] if with_hidden else None), cache


def step(model, cache, tokens):
  """``tokens int[b, s]`` after the cache -> ``(logits [b, s, vocab], hidden [b, s, embed], cache)``."""
  h, cache = model.forward_hidden(tokens, cache=cache)
  return model.logits(h), h, cache


# ---- outputs and loops -----------------------------------------------------------------------


def emit(out, n_out, done, tokens, n_new, *, max_new: int, stop_tokens: tuple[int, ...] = ()):
  """Appends ``tokens int32[b, W]`` (the first ``n_new[b]`` valid) to ``out int32[b, max_new]``.

  Stops a row at its first stop token (kept) or at ``max_new``; rows already ``done`` are left
  alone. Returns ``(out, n_out, done, hit)``, ``hit`` = the row emitted a stop token now."""
  b, w = tokens.shape
  idx = jnp.arange(w)[None]
  valid = (idx < n_new[:, None]) & (idx < (max_new - n_out)[:, None])
  if stop_tokens:
    is_stop = jnp.isin(tokens, jnp.asarray(stop_tokens, jnp.int32)) & valid
    first = jnp.where(is_stop.any(-1), jnp.argmax(is_stop, -1), w)
    valid = valid & (idx <= first[:, None])
    hit = is_stop.any(-1)
  else:
    hit = jnp.zeros((b,), bool)
  valid = valid & ~done[:, None]
  n = valid.sum(-1).astype(jnp.int32)
  rows = jnp.where(valid, n_out[:, None] + idx, max_new)
  out = out.at[jnp.arange(b)[:, None], rows].set(tokens, mode="drop")
  n_out = n_out + n
  hit = hit & (n > 0)
  return out, n_out, done | ((hit | (n_out >= max_new)) & (n > 0)), hit


def while_running(body: Callable, state, *, running: Callable, max_steps: int, min_running=1):
  """``state = body(state)`` while ``running(state) >= max(min_running, 1)`` rows run, at most
  ``max_steps`` times (each step emits >= 1 token per running row, so the output budget bounds
  the loop). Returns ``(state, steps int32)``."""
  def cond(carry):
    s, n = carry
    r = running(s)
    return (r > 0) & (r >= min_running) & (n < max_steps)

  def loop_body(carry):
    s, n = carry
    return body(s), n + 1

  return jax.lax.while_loop(cond, loop_body, (state, jnp.int32(0)))


_STREAM: list = []  # the active on_token callbacks (innermost last), see streaming()


@contextlib.contextmanager
def streaming(on_token):
  """While active, a loop compiled with ``stream=True`` hands each step's tokens to ``on_token``.

  The compiled loop calls one fixed host function (so every streaming call shares one
  executable); that function forwards to the callback installed here."""
  if on_token is None:
    yield
    return
  _STREAM.append(on_token)
  try:
    yield
  finally:
    _STREAM.pop()


def _stream_sink(step, tokens):
  if _STREAM:
    _STREAM[-1](int(step), np.asarray(tokens))


def _stream(step, tokens):
  io_callback(_stream_sink, None, step, tokens, ordered=True)


def decode_loop(model, cache, logits0, hidden0, params, *, greedy: bool, top_k: int,
                use_top_p: bool, num_steps: int, with_hidden: bool, stream: bool = False,
                use_min_p: bool = False):
  """Samples up to ``num_steps`` (static bucket) tokens per row, stopping at ``params['max_new']``
  or when every row hit one of ``params['stops']``; one :func:`step` per token.

  ``params``: traced ``seed``, ``temperature``, ``top_p``, ``min_p``, ``max_new``, ``stops
  int32[n]`` and, with penalties or bias, ``pen`` (``jaxsys.decoding.sampling.loop_params``
  builds them with the static mode; the penalties' token history is carried in the loop).
  Returns ``(tokens int32[b, num_steps], logprobs f32[b, num_steps], hidden or None,
  counts int32[b], finished bool[b], cache)``; ``logprobs`` are the model's (temperature 1, before
  penalties and top-k/top-p) log-probabilities of the chosen tokens."""
  b = logits0.shape[0]
  key = jax.random.key(params["seed"])
  stops = params["stops"]

  def pick(logits, i, pen):
    x = logits if pen is None else penalize(logits, pen)
    tok = sample_logits(jax.random.fold_in(key, i), x, greedy=greedy,
                        temperature=params["temperature"], top_k=top_k,
                        top_p=params["top_p"] if use_top_p else None,
                        min_p=params["min_p"] if use_min_p else None)
    logp = jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), tok[:, None], axis=-1)[:, 0]
    return tok, logp

  pen = params.get("pen")
  tok0, logp0 = pick(logits0, 0, pen)
  if stream:
    _stream(jnp.int32(0), tok0)
  out_tok = jnp.zeros((b, num_steps), jnp.int32).at[:, 0].set(tok0)
  out_logp = jnp.zeros((b, num_steps), jnp.float32).at[:, 0].set(logp0)
  out_h = None
  if with_hidden:
    out_h = jnp.zeros((b, num_steps, hidden0.shape[-1]), hidden0.dtype).at[:, 0].set(hidden0)
  done = jnp.isin(tok0, stops)
  n_done = jnp.where(done, 1, num_steps + 1)  # step count where each row stopped
  if pen is not None:
    pen = pen.record(tok0, jnp.ones((b,), bool))

  def body(c):
    i, cache, tok, done, n_done, out_tok, out_logp, out_h, pen = c
    logits, h, cache = step(model, cache, tok[:, None])
    nxt, logp = pick(logits[:, 0], i, pen)
    if pen is not None:
      pen = pen.record(nxt, ~done)
    if stream:  # rows already done still step; the host keeps each row to its count
      _stream(i, nxt)
    out_tok = out_tok.at[:, i].set(nxt)
    out_logp = out_logp.at[:, i].set(logp)
    if out_h is not None:
      out_h = out_h.at[:, i].set(h[:, 0])
    stop = jnp.isin(nxt, stops) & ~done
    n_done = jnp.where(stop, i + 1, n_done)
    return i + 1, cache, nxt, done | stop, n_done, out_tok, out_logp, out_h, pen

  carry = (jnp.int32(1), cache, tok0, done, n_done, out_tok, out_logp, out_h, pen)
  carry, _ = while_running(body, carry, running=lambda c: jnp.sum(~c[3]),
                           max_steps=params["max_new"] - 1)
  i, cache, _, _, n_done, out_tok, out_logp, out_h, _ = carry
  # The cache goes back out so its donated buffer is reused for the loop carry.
  return out_tok, out_logp, out_h, jnp.minimum(n_done, i), n_done <= num_steps, cache


# ---- compiled entry points -------------------------------------------------------------------


@functools.partial(jax.jit, static_argnums=(0, 5), donate_argnums=(4,))
def jit_prefill(graphdef, state, tokens, lengths, cache, with_hidden):
  count_trace("decoding.prefill")
  return prefill(nnx.merge(graphdef, state), tokens, lengths, cache, with_hidden)


@functools.partial(jax.jit, static_argnums=(0, 5, 6))  # no donation: the cache comes back G times larger
def jit_prefill_embeds(graphdef, state, embeds, lengths, cache, group, with_hidden=False):
  """Prefill from input embeddings ``[n, T, embed]`` once per prompt, then the cache, logits and
  hidden states repeated to ``n * group`` rows (row ``i * group + j`` = rollout ``j`` of prompt
  ``i``): a group of rollouts shares one prefill. ``cache`` has ``n`` rows."""
  count_trace("decoding.prefill_embeds")
  logits, hidden, cache = prefill(nnx.merge(graphdef, state), None, lengths, cache, with_hidden,
                                  embeds=embeds)
  rep = lambda x: None if x is None else jnp.repeat(x, group, axis=0)  # noqa: E731
  return rep(logits), rep(hidden), cache.repeat(group)


@functools.partial(jax.jit, static_argnums=(0, 6, 7, 8, 9), donate_argnums=(2,))
def jit_decode_loop(graphdef, state, cache, logits0, hidden0, params, mode, num_steps, with_hidden,
                    stream=False):
  count_trace("decoding.decode")
  greedy, top_k, use_top_p, use_min_p = mode  # sampling.loop_params (penalties: params["pen"])
  return decode_loop(nnx.merge(graphdef, state), cache, logits0, hidden0, params, greedy=greedy,
                     top_k=top_k, use_top_p=use_top_p, num_steps=num_steps, with_hidden=with_hidden,
                     stream=stream, use_min_p=use_min_p)


@functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(2,))
def jit_step(graphdef, state, cache, tokens):
  count_trace("decoding.step")
  return step(nnx.merge(graphdef, state), cache, tokens)
