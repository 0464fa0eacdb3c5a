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

Text in, text out: with ``tokenizer=`` (a ``transformers`` tokenizer, e.g. the one
``jaxsys.models.load_pretrained`` returns), ``prompts`` may also be a string, a list of strings,
one chat (a list of ``{"role", "content"}`` messages, rendered with the tokenizer's chat template
and its generation prompt) or a list of chats; ``result.text`` holds the decoded replies. Stop
tokens default to the model config's and the tokenizer's EOS ids; ``stop=["\n\n", ...]`` ends a
reply at the first stop string (cut from the text, as in the OpenAI API; the tokens keep the one
that completed it). ``on_token(step, tokens int32[batch])`` streams each step's tokens to the host
from inside the compiled loop (a terminal chat prints them as they come).

Embeddings: :func:`embed` runs prompts once through the model (no cache) and returns each one's
final hidden states (after the final norm) averaged over its tokens, float32 ``[n, hidden]`` (what
the server's ``/v1/embeddings`` answers).

For a Python-driven loop :func:`decode_step` is a jitted single step that donates the cache, so
XLA updates it in place.

Usage::

  res = generate(model, [[1, 2, 3], [4, 5]], max_new_tokens=16,
                 sampling=SamplingParams(0.8, top_p=0.9))
  res.tokens[0], res.logprobs[0]
  model, tok = jaxsys.models.load_pretrained("smollm2-135m-instruct")
  generate(model, [{"role": "user", "content": "Capital of France?"}], tokenizer=tok,
           max_new_tokens=32).text[0]                     # 'The capital of France is Paris.'
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxsys.core.bench import TRACE_COUNTS  # noqa: F401  (compile counts: "decoding.prefill", ...)
from jaxsys.core.errors import ConfigError, InputError
from jaxsys.decoding import core
from jaxsys.decoding.cache import KVCache
from jaxsys.decoding.core import bucket, context_length, describe_context  # noqa: F401
from jaxsys.decoding.sampling import GREEDY, SamplingParams, loop_params

__all__ = [
    "bucket", "context_length", "decode_step", "default_stop_tokens", "describe_context", "embed", "encode_prompts",
    "generate", "GenerationResult", "TRACE_COUNTS",
]


@dataclasses.dataclass
class GenerationResult:
  tokens: list[list[int]]            # new tokens of prompt i (up to and including a stop token)
  logprobs: list[np.ndarray]         # float32[len(tokens[i])]
  hidden: list[np.ndarray] | None    # [len(tokens[i]), embed] when return_hidden
  finished: list[bool]               # True where a stop token (or stop string) ended the row
  prefill_seconds: float = 0.0
  decode_seconds: float = 0.0
  text: list[str] | None = None      # decoded replies (with a tokenizer), cut at a stop string


def decode_step(model, cache: KVCache, tokens):
  """One jitted step: ``tokens int[batch, s]`` -> ``(logits, hidden, cache)``; donates ``cache``
  (do not reuse the cache passed in)."""
  graphdef, state = nnx.split(model)
  return core.jit_step(graphdef, state, cache, jnp.asarray(tokens, jnp.int32))


def generate(model, prompts, *, max_new_tokens: int, sampling: SamplingParams | None = None,
             stop_tokens: Sequence[int] | None = None, return_hidden: bool = False,
             cache_dtype=None, min_bucket: int = 16, tokenizer=None,
             stop: Sequence[str] | str | None = None,
             on_token: Callable[[int, np.ndarray], None] | None = None) -> GenerationResult:
  """Generates up to ``max_new_tokens`` for each prompt (see the module docstring).

  ``stop_tokens`` default to the config's ``eos_token_id`` and the tokenizer's EOS (pass ``()``
  to never stop early); the stop token is included in ``tokens[i]``. The longest prompt +
  ``max_new_tokens`` must fit the model's :func:`context_length`.
  """
  cfg = model.config
  stop = _check_stop(stop, tokenizer)
  if tokenizer is not None:
    prompts = encode_prompts(tokenizer, prompts)
  arrs = core.check_prompts(prompts, cfg.vocab_size)
  # max_new_tokens is a positive int and prompt + new tokens (the bucketed cache) fit the model's
  # context: checked before anything is allocated.
  core.check_fits(arrs, max_new_tokens, cfg)
  s = GREEDY if sampling is None else sampling
  if not isinstance(s, SamplingParams):
    raise ConfigError(f"sampling must be a SamplingParams or None (greedy), got {type(s).__name__}")
  s.check_vocab(cfg.vocab_size)
  stops = tuple(default_stop_tokens(cfg, tokenizer) if stop_tokens is None else stop_tokens)
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
  mode, params = loop_params(s, max_new=max_new_tokens, stops=stops, prompts=arrs, vocab=cfg.vocab_size,
                             batch=b)
  with core.streaming(on_token):
    out_tok, out_logp, out_h, counts, finished, _ = core.jit_decode_loop(
        graphdef, state, cache, logits0, h0, params, mode, n_steps, return_hidden,
        on_token is not None)
    out_tok, out_logp, counts, finished = jax.device_get((out_tok, out_logp, counts, finished))
  t2 = time.perf_counter()
  out_h = None if out_h is None else np.asarray(out_h)
  res = GenerationResult(
      tokens=[out_tok[i, :counts[i]].tolist() for i in range(n)],
      logprobs=[out_logp[i, :counts[i]] for i in range(n)],
      hidden=None if out_h is None else [out_h[i, :counts[i]] for i in range(n)],
      finished=[bool(finished[i]) for i in range(n)],
      prefill_seconds=t1 - t0, decode_seconds=t2 - t1)
  if tokenizer is not None:
    res.text = [tokenizer.decode(t, skip_special_tokens=True) for t in res.tokens]
    if stop:
      _apply_stop_strings(res, tokenizer, stop)
  return res


@functools.partial(jax.jit, static_argnums=0)
def _mean_hidden(graphdef, state, tokens, lengths):
  """Mean of each row's final hidden states over its first ``lengths[i]`` positions: ``tokens
  int32[b, T]`` right-padded (causal attention: padding never reaches a real position) ->
  float32 ``[b, hidden]``."""
  h, _ = nnx.merge(graphdef, state).forward_hidden(tokens)                 # [b, T, hidden]
  mask = (jnp.arange(tokens.shape[1])[None] < lengths[:, None]).astype(jnp.float32)
  return jnp.einsum("bt,bth->bh", mask, h.astype(jnp.float32)) / lengths[:, None].astype(jnp.float32)


def embed(model, prompts, *, tokenizer=None, min_bucket: int = 16) -> tuple[np.ndarray, list[int]]:
  """``(embeddings float32[n, hidden], token counts)``: each prompt's final hidden states (after the
  final norm) mean-pooled over its tokens. ``prompts`` as :func:`generate` takes them (strings and
  chats with a ``tokenizer``); each must fit the model's :func:`context_length`. Shapes are bucketed
  to powers of two (batch, length), so similar batches reuse one executable."""
  if tokenizer is not None:
    prompts = encode_prompts(tokenizer, prompts)
  arrs = core.check_prompts(prompts, model.config.vocab_size, max_len=context_length(model.config),
                            limit="context_length")
  tokens, lengths = core.pad_batch(arrs, bucket(len(arrs), 1), bucket(max(map(len, arrs)), min_bucket))
  graphdef, state = nnx.split(model)
  out = _mean_hidden(graphdef, state, jnp.asarray(tokens), jnp.asarray(lengths))
  return np.asarray(out)[:len(arrs)], [len(a) for a in arrs]


# ---- text ------------------------------------------------------------------------------------


def _is_chat(x) -> bool:
  return isinstance(x, Sequence) and not isinstance(x, str) and len(x) > 0 and all(
      isinstance(m, Mapping) for m in x)


def encode_prompts(tokenizer, prompts) -> list[list[int]]:
  """Strings, one chat, chats, or token-id lists -> token-id lists (chats through the tokenizer's
  chat template with the generation prompt; strings as the tokenizer encodes them)."""
  if isinstance(prompts, str) or _is_chat(prompts):
    prompts = [prompts]
  if isinstance(prompts, (bytes, Mapping)) or not isinstance(prompts, Sequence) or not prompts:
    raise InputError("prompts must be a string, a chat (list of messages), or a non-empty list of "
                     "strings, chats or token-id lists")
  out = []
  for i, p in enumerate(prompts):
    if isinstance(p, str):
      out.append(list(tokenizer(p)["input_ids"]))
    elif _is_chat(p):
      for j, m in enumerate(p):
        if "role" not in m or "content" not in m:
          raise InputError(f"prompts[{i}][{j}] must be a message with 'role' and 'content', got "
                           f"keys {sorted(m)}")
      ids = tokenizer.apply_chat_template(list(p), add_generation_prompt=True, tokenize=True)
      out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))  # a BatchEncoding or ids
    else:
      out.append(p)  # token ids, checked by check_prompts
  return out


def default_stop_tokens(cfg, tokenizer=None) -> tuple[int, ...]:
  """The model config's EOS ids, plus the tokenizer's EOS when one is given."""
  ids = list(cfg.eos_ids)
  eos = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
  for e in ([] if eos is None else [eos] if isinstance(eos, int) else list(eos)):
    if e not in ids:
      ids.append(int(e))
  return tuple(ids)


def _check_stop(stop, tokenizer) -> tuple[str, ...]:
  if stop is None:
    return ()
  stop = (stop,) if isinstance(stop, str) else tuple(stop)
  if any(not isinstance(x, str) or not x for x in stop):
    raise InputError(f"stop must be a non-empty string or a list of them, got {stop!r}")
  if tokenizer is None:
    raise ConfigError("stop strings need a tokenizer (tokenizer=...); use stop_tokens for ids")
  return stop


def _apply_stop_strings(res: GenerationResult, tokenizer, stop: tuple[str, ...]) -> None:
  """Cuts each reply at its first stop string: the text before it, the tokens up to the one that
  completed it (a stop string inside a token keeps that token)."""
  for i, text in enumerate(res.text):
    cut = min((k for k in (text.find(x) for x in stop) if k >= 0), default=-1)
    if cut < 0:
      continue
    res.text[i] = text[:cut]
    toks = res.tokens[i]
    has = lambda j: any(x in tokenizer.decode(toks[:j], skip_special_tokens=True) for x in stop)
    lo, hi = 1, len(toks)  # the shortest prefix holding a stop string (has() is monotone)
    while lo < hi:
      mid = (lo + hi) // 2
      lo, hi = (lo, mid) if has(mid) else (mid + 1, hi)
    end = hi
    res.tokens[i] = toks[:end]
    res.logprobs[i] = res.logprobs[i][:end]
    if res.hidden is not None:
      res.hidden[i] = res.hidden[i][:end]
    res.finished[i] = True
