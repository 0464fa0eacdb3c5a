"""The step-level scheduler of ``ServingEngine``: ``add_request`` / ``step`` / ``abort``.

One ``step()`` is one iteration of continuous batching (vLLM's scheduler, Orca's
iteration-level scheduling) under a token budget ``ServingConfig.max_num_batched_tokens``:

1. every decoding sequence gets room for one more token (a page at a page boundary); when the
   pool is out of pages the newest running sequence is **preempted by recompute**: its pages go
   back, it returns to the front of the queue with its prompt + the tokens it already generated,
   and a later prefill of those tokens resumes it where it stopped (its sampling keys depend
   only on its seed, choice and token index, so it produces the output it would have had);
2. the rest of the budget goes to **prefill chunks** (at most ``prefill_chunk`` tokens each) of
   the sequences still prefilling, oldest first, then to newly admitted ones while batch slots
   are free: a long prompt advances chunk by chunk between the others' decode steps;
3. admission looks up the prompt's full pages in the **prefix cache** (``prefix_cache.py``) and
   prefills only the tokens after the cached prefix;
4. one jitted decode step runs over all slots and draws each decoding sequence's next token in
   the same executable; each sequence whose prompt is now complete draws its first token from
   its last hidden state, each with its own parameters (``sampling.sample_rows``).

Chunked prefill across steps and prefix caching read the prefix back from the pages, which
needs every kv head to keep every token: with LServe streaming heads (whose sink + local pages
are per request) a prompt is prefilled whole at admission (``prefill.prefill``, chunked inside one
call) and nothing is shared.

Usage (through the engine)::

  engine = ServingEngine(model, ServingConfig(max_batch=8, num_pages=512), tokenizer=tok)
  engine.add_request("The capital of France is", RequestParams(max_tokens=8), "a")
  while engine.has_unfinished():
    for out in engine.step():
      print(out.request_id, out.new_text, out.finish_reason)
"""

from __future__ import annotations

import collections
import functools
import logging
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxsys.core.errors import InputError
from jaxsys.decoding.core import bucket, check_prompts
from jaxsys.decoding.sampling import Penalties, penalize, sample_rows, token_logprobs, unpack_allowed
from jaxsys.serving.structured import Constraint, ll_tokenizer
from jaxsys.serving.paged_cache import PoolExhaustedError
from jaxsys.serving.prefill import prefill_chunk
from jaxsys.serving.prefix_cache import page_keys
from jaxsys.serving.requests import (DECODE, FINISHED, MAX_TOP_LOGPROBS, PREFILL, WAITING, RequestParams,
                                     SeqState, StepOutput, TextStream, TokenLogprob)

__all__ = ["draw", "Scheduler"]

log = logging.getLogger("jaxsys.serving")


class Scheduler:
  """See the module docstring. Not thread-safe: one thread drives it (the server's engine loop)."""

  def __init__(self, engine, tokenizer=None):
    self.engine = engine
    self.tokenizer = tokenizer
    c = engine.config
    self.chunked = not engine.cache_config.streaming_flags().any()
    self.prefix_caching = self.chunked and c.prefix_caching
    self.waiting: collections.deque[SeqState] = collections.deque()
    self.running: dict = {}                 # rid -> SeqState holding pages (PREFILL / DECODE)
    self.slots: list = [None] * c.max_batch
    self.requests: dict[str, list[SeqState]] = {}
    self._arrival = 0
    self._rng = np.random.default_rng()
    self._last_decode: tuple = ()
    self.stats = collections.Counter()
    self.keep_logits = False                # each sampled row's logits go to SeqState.logits

  # -- requests -------------------------------------------------------------------------------
  def encode(self, prompt) -> np.ndarray:
    """Token ids of a prompt: ids, or (with a tokenizer) a string or a chat."""
    if isinstance(prompt, str) or (isinstance(prompt, (list, tuple)) and prompt
                                   and isinstance(prompt[0], dict)):
      if self.tokenizer is None:
        raise InputError("a text or chat prompt needs the engine's tokenizer (tokenizer=...)")
      from jaxsys.serving.generation import encode_prompts  # noqa: PLC0415
      prompt = encode_prompts(self.tokenizer, prompt)[0]
    return check_prompts([prompt], self.engine.model.config.vocab_size)[0]

  def add(self, prompt, params: RequestParams | None, request_id: str, *, text: bool = True) -> str:
    """Queues ``params.n`` sequences; ``text=False`` skips detokenizing them (``generate``)."""
    params = RequestParams() if params is None else params
    if not isinstance(params, RequestParams):
      raise InputError(f"params must be a RequestParams, got {type(params).__name__}")
    if request_id in self.requests:
      raise InputError(f"request_id={request_id!r} is already live")
    params.sampling().check_vocab(self.engine.model.config.vocab_size)
    if params.stop and self.tokenizer is None:
      raise InputError("stop strings need the engine's tokenizer; use stop_token_ids")
    ids = self.encode(prompt)
    err = self.engine._capacity_error(len(ids) + params.max_tokens)
    if err is not None:
      raise InputError(f"request {request_id!r}: {err}")
    seed = int(self._rng.integers(0, 2**31 - 1)) if params.seed is None else int(params.seed)
    stops = set(params.stop_token_ids)
    if not params.ignore_eos:
      stops |= set(self.engine.stop_tokens)
    ll_tok = None
    if params.grammar is not None:
      if self.tokenizer is None:
        raise InputError("a grammar (structured output) needs the engine's tokenizer")
      ll_tok = ll_tokenizer(self.tokenizer, self.engine.model.config.vocab_size, self.engine.stop_tokens)
    seqs = []
    for i in range(params.n):
      self._arrival += 1
      s = SeqState(request_id, i, ids, params, seed, self._arrival, frozenset(stops))
      if ll_tok is not None:
        s.constraint = Constraint(ll_tok, params.grammar)
      if self.tokenizer is not None and text:
        s.text = TextStream(self.tokenizer, params.stop)
      seqs.append(s)
      self.waiting.append(s)
    self.requests[request_id] = seqs
    log.info("request %s: added, %d prompt tokens, n=%d, max_tokens=%d", request_id, len(ids),
             params.n, params.max_tokens)
    return request_id

  def abort(self, request_id: str) -> bool:
    """Stops every choice of a request and frees its pages; False if it is not live."""
    seqs = self.requests.pop(request_id, None)
    if seqs is None:
      return False
    for s in seqs:
      if s.status in (PREFILL, DECODE):
        self._free(s)
      elif s.status == WAITING:
        self.waiting.remove(s)
      s.status, s.finish_reason = FINISHED, s.finish_reason or "abort"
    log.info("request %s: aborted", request_id)
    return True

  def has_unfinished(self) -> bool:
    return bool(self.waiting or self.running)

  def reset(self) -> None:
    """After a failure inside a step: every request is dropped and every page freed."""
    self.engine._abort()
    self.waiting.clear()
    self.running.clear()
    self.requests.clear()
    self.slots = [None] * len(self.slots)
    self._last_decode = ()

  # -- pages ----------------------------------------------------------------------------------
  def _free(self, s: SeqState) -> None:
    self.engine.cache.release(s.rid)
    del self.running[s.rid]
    self.slots[s.slot] = None
    s.slot = None

  def _preempt(self, s: SeqState) -> None:
    """Recompute preemption: free the pages, requeue at the front with the tokens made so far."""
    self._free(s)
    s.status, s.computed, s.registered = WAITING, 0, 0
    s.preemptions += 1
    self.stats["preemptions"] += 1
    self.waiting.appendleft(s)
    log.info("request %s[%d]: preempted after %d tokens (pool out of pages)", s.request_id, s.index,
             len(s.out))

  def _newest(self):
    return max(self.running.values(), key=lambda s: s.arrival)

  def _reserve(self, s: SeqState, n: int) -> bool:
    """Room for ``n`` more tokens of ``s``; False if the pool cannot give it now."""
    try:
      self.engine.cache.extend(s.rid, n)
      return True
    except PoolExhaustedError:
      return False

  def _admit(self, s: SeqState) -> bool:
    cache, ps = self.engine.cache, self.engine.cache_config.page_size
    if None not in self.slots:
      return False
    toks = s.tokens
    shared = []
    if self.prefix_caching:
      s.keys = page_keys(toks, ps)
      shared = cache.alloc.lookup(s.keys, limit=(len(toks) - 1) // ps)
    try:
      cache.admit(s.rid, len(shared) * ps, shared=shared)
    except PoolExhaustedError:
      return False
    s.computed = len(shared) * ps
    s.registered = len(shared)
    cache.seqs[s.rid].length = s.computed
    s.slot = self.slots.index(None)
    self.slots[s.slot] = s.rid
    self.running[s.rid] = s
    s.status = PREFILL
    self.stats["cached_tokens"] += s.computed
    return True

  # -- one iteration --------------------------------------------------------------------------
  def step(self) -> list[StepOutput]:
    try:
      return self._step()
    except BaseException:
      self.reset()
      raise

  def _step(self) -> list[StepOutput]:
    c = self.engine.config
    budget = c.max_num_batched_tokens
    decode = sorted((s for s in self.running.values() if s.status == DECODE), key=lambda s: s.arrival)
    for s in decode:  # one more token each; the newest running sequence yields when out of pages
      while s.status == DECODE and not self._reserve(s, 1):
        self._preempt(self._newest())
    decode = [s for s in decode if s.status == DECODE]
    budget -= len(decode)
    chunks = []
    for s in sorted((s for s in self.running.values() if s.status == PREFILL), key=lambda s: s.arrival):
      n = self._chunk_len(s, budget)
      if n <= 0 or not self._reserve(s, n):
        break
      chunks.append((s, n))
      budget -= n
    while budget > 0 and self.waiting and not (chunks and not self.chunked):
      s = self.waiting[0]
      if not self._admit(s):
        break
      self.waiting.popleft()
      n = self._chunk_len(s, budget)
      if n <= 0 or not self._reserve(s, n):
        self._free(s)  # wait in the queue until pages free up
        s.status, s.computed = WAITING, 0
        self.waiting.appendleft(s)
        break
      chunks.append((s, n))
      budget -= n
    if not decode and not chunks:
      if self.running:  # every running sequence waits for pages: the newest makes room
        self._preempt(self._newest())
        return self._step()
      return []
    self.stats["steps"] += 1
    # The decoding rows draw inside the decode executable (one executable per engine, whether or
    # not the step also prefills); prompts completed by this step's chunks draw from their last
    # hidden state in ``_sample_step``. Every row's key depends on its own seed, choice and index
    # alone, so splitting the draw changes no token.
    drawn = None
    if decode:
      ints, floats = self._sample_args(decode, [s.slot for s in decode])
      drawn = self._decode(decode, ints, floats, self._logit_adjust(decode))
    done, hidden = [], None
    for s, n in chunks:
      h = self._prefill(s, n)
      self.stats["prefill_tokens"] += n
      if h is not None:  # the prompt is complete: its last hidden state gives the next token
        if hidden is None:
          hidden = jnp.zeros((len(self.slots), h.shape[-1]), h.dtype)
        hidden = _put_row(hidden, h, jnp.int32(len(done)))
        done.append(s)
    outs = [] if drawn is None else self._emit(decode, drawn)
    return outs + (self._sample(done, hidden) if done else [])

  def _chunk_len(self, s: SeqState, budget: int) -> int:
    left = len(s.tokens) - s.computed
    if not self.chunked:  # whole prompt in one call (streaming heads)
      return left if budget > 0 else 0
    return min(left, budget, self.engine.config.prefill_chunk)

  def _prefill(self, s: SeqState, n: int):
    """Runs ``n`` more tokens of ``s``; the last token's hidden state when its prompt is done."""
    e = self.engine
    toks = s.tokens
    if not self.chunked:
      hidden = e._prefill(s.rid, toks)
      s.computed = len(toks)
    else:
      t = bucket(n, e.config.min_prompt_bucket)
      buf = np.zeros((1, t), np.int32)
      buf[0, :n] = toks[s.computed:s.computed + n]
      seq = e.cache.seqs[s.rid]
      bt, stt, _ = e.cache.block_tables([s.rid], e.max_pages)  # one executable per chunk bucket
      e.cache.state, hidden = prefill_chunk(
          e._graphdef, e._params, e.cache_config, e.cache.state, jnp.asarray(buf),
          jnp.int32(s.computed), jnp.int32(n), jnp.asarray(bt), jnp.asarray(stt), e.config.lserve.impl)
      s.computed += n
      seq.length = s.computed
      if self.prefix_caching:  # the full pages now computed can serve later requests
        ps = e.cache_config.page_size
        for i in range(s.registered, min(s.computed // ps, len(s.keys))):
          e.cache.alloc.register(seq.pages[i], s.keys[i])
        s.registered = max(s.registered, min(s.computed // ps, len(s.keys)))
    if s.computed < len(toks):
      return None
    s.status = DECODE
    return hidden

  def _decode(self, decode, ints, floats, pen=None):
    """One decode step over the slots, each decoding row drawing its next token with the sampling
    arguments of :meth:`_sample_args` (row ``j`` = ``decode[j]``): what ``_sample_step`` returns."""
    e = self.engine
    rids = [None] * len(self.slots)
    tokens = np.zeros(len(self.slots), np.int32)
    for s in decode:
      rids[s.slot] = s.rid
      tokens[s.slot] = s.out[-1]
    key = tuple(rids)
    reselect = key != self._last_decode
    self._last_decode = key
    out = e._decode(rids, tokens, reselect, ints, floats, self.keep_logits, pen)
    for s in decode:
      s.computed += 1
    self.stats["decode_tokens"] += len(decode)
    return out

  def _sample_args(self, rows, src):
    """The per-row parameters of ``draw``, padded to ``slots`` rows (fixed shapes: one executable
    for every mix of rows): ``ints int32[6, slots]`` = (src, seed, choice, index, top_k,
    logprobs), ``floats float32[3, slots]`` = (temperature, top_p, min_p) (two host-to-device
    copies per step); row ``j`` reads logits row ``src[j]``."""
    b, r = len(self.slots), len(rows)
    pad = lambda xs, dt, fill=0: np.asarray(list(xs) + [fill] * (b - r), dt)  # noqa: E731
    p = [s.params for s in rows]
    seeds = pad([s.seed for s in rows], np.uint32).view(np.int32)  # uint32 bits (cast back in the step)
    ints = np.stack([pad(src, np.int32), seeds,
                     pad([s.index for s in rows], np.int32), pad([len(s.out) for s in rows], np.int32),
                     pad([q.top_k for q in p], np.int32), pad([q.logprobs for q in p], np.int32)])  # [6, slots]
    floats = np.stack([pad([q.temperature for q in p], np.float32),
                       pad([q.top_p for q in p], np.float32, 1.0),
                       pad([q.min_p for q in p], np.float32)])                 # [3, slots]
    return ints, floats

  def _logit_adjust(self, rows):
    """The rows' :class:`LogitAdjust` (padded to ``slots`` rows), or None when no row has
    penalties, bias or a grammar (the common case: its executables then carry nothing for them).
    Only the parts some row uses are built: a step with grammars alone copies one packed mask per
    row (vocab / 8 bytes), not the penalties' ``[slots, vocab]`` history."""
    params = [s.params.sampling(0) for s in rows]
    penalized = any(p.penalized for p in params)
    constrained = [i for i, s in enumerate(rows) if s.constraint is not None]
    if not penalized and not constrained:
      return None
    vocab, b = self.engine.model.config.vocab_size, len(self.slots)
    pen = allowed = None
    if penalized:
      pen = Penalties.rows(params, [s.out for s in rows], [s.prompt for s in rows], vocab, b)
    if constrained:
      words = -(-vocab // 32)
      allowed = np.full((b, words), 0xFFFFFFFF, np.uint32)  # rows without a grammar: all allowed
      for i in constrained:
        allowed[i] = rows[i].constraint.allowed_bits(words)
    return LogitAdjust(pen, allowed)

  def _sample(self, rows, hidden) -> list[StepOutput]:
    """Samples the first token of each just-prefilled prompt (row ``j``: ``hidden[j]``)."""
    e = self.engine
    ints, floats = self._sample_args(rows, range(len(rows)))
    out = _sample_step(e._graphdef, self.keep_logits, e._params, hidden, ints, floats,
                       self._logit_adjust(rows))
    return self._emit(rows, out)

  def _emit(self, rows, drawn) -> list[StepOutput]:
    """Appends each row's drawn token, checks its stop conditions and streams its text."""
    if any(s.params.logprobs for s in rows):
      toks, chosen, top_ids, top_lp, *logits = jax.device_get(drawn)
    else:  # fetch only what is used (the log-probability outputs are zeros then)
      toks, *logits = jax.device_get((drawn[0], *drawn[4:]))
    outs = []
    for i, s in enumerate(rows):
      tok = int(toks[i])
      s.out.append(tok)
      if logits:
        s.logits.append(logits[0][i])
      lps = None
      if s.params.logprobs:
        k = s.params.top_logprobs
        lps = [TokenLogprob(tok, float(chosen[i]),
                            [(int(a), float(v)) for a, v in zip(top_ids[i, :k], top_lp[i, :k])])]
        s.logprobs += lps
      text, hit = ("", False) if s.text is None else s.text.add(s.out)
      complete = s.constraint is not None and s.constraint.advance(tok)
      reason = None
      if tok in s.stop_ids or hit or complete:
        reason = "stop"
      elif len(s.out) >= s.params.max_tokens:
        reason = "length"
      if reason is not None:
        if s.text is not None:
          text += s.text.flush()
        self._finish(s, reason)
      outs.append(StepOutput(s.request_id, s.index, [tok], None if s.text is None else text, lps,
                             reason is not None, reason, len(s.prompt), len(s.out)))
    return outs

  def _finish(self, s: SeqState, reason: str) -> None:
    self._free(s)
    s.status, s.finish_reason = FINISHED, reason
    seqs = self.requests.get(s.request_id, [])
    if all(x.status == FINISHED for x in seqs):
      self.requests.pop(s.request_id, None)
      log.info("request %s: finished (%s), %s tokens", s.request_id, reason,
               [len(x.out) for x in seqs])


@jax.jit
def _put_row(buf, row, i):
  """``buf[i] = row[0]`` (``buf [slots, embed]``, ``row [1, embed]``; ``i`` traced: one executable)."""
  return jax.lax.dynamic_update_slice_in_dim(buf, row.astype(buf.dtype), i, axis=0)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _sample_step(graphdef, keep_logits, params, hidden, ints, floats, pen):
  """Row ``j`` draws its next token from the model's logits of ``hidden[src[j]]`` (a prompt's last
  hidden state, ``hidden [slots, embed]``) with its own parameters and key
  ``fold_in(fold_in(seed, choice), index)``. ``ints int32[6, slots]`` = (src, seed bits, choice,
  index, top_k, logprobs), ``floats float32[3, slots]`` = (temperature, top_p, min_p). Returns
  the tokens and the model's log-probabilities (chosen and the top ``MAX_TOP_LOGPROBS``), and
  with ``keep_logits`` the logits ``[slots, vocab]`` as well."""
  logits = nnx.merge(graphdef, params).logits(hidden[:, None])[:, 0]  # [slots, vocab]
  return draw(logits[ints[0]], ints, floats, keep_logits, pen)


class LogitAdjust(NamedTuple):
  """What changes a step's logits before the draw: ``pen``, the rows' :class:`Penalties` (None:
  no row has penalties or bias), and ``allowed``, the constrained rows' grammar masks packed
  ``uint32[slots, ceil(vocab / 32)]`` (None: no row has a grammar; rows without one: all ones)."""
  pen: Any
  allowed: Any


def draw(logits, ints, floats, keep_logits: bool, adjust: LogitAdjust | None = None):
  """Traced: row ``j`` of ``logits [slots, vocab]`` draws its token with its own parameters and
  key ``fold_in(fold_in(seed, choice), index)`` (``ints`` / ``floats`` of
  ``Scheduler._sample_args``), from the logits after ``adjust`` (:class:`LogitAdjust`; None: no
  row has penalties or a grammar): penalties and bias, then -inf on what a grammar forbids. The
  reported log-probabilities are the model's own. Also run inside the engine's decode executable."""
  raw = logits
  if adjust is not None and adjust.pen is not None:
    logits = penalize(logits, adjust.pen)
  if adjust is not None and adjust.allowed is not None:
    logits = jnp.where(unpack_allowed(adjust.allowed, logits.shape[-1]), logits, -jnp.inf)
  _, seeds, choice, index, top_k, want_logprobs = ints
  temperature, top_p, min_p = floats
  seeds = seeds.astype(jnp.uint32)

  def drawn():
    keys = jax.vmap(lambda s, c, i: jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(s), c), i))(
        seeds, choice, index)
    return sample_rows(keys, logits, temperature, top_k, jnp.minimum(top_p, 1.0), min_p)

  # Runtime branches (one executable): an all-greedy step skips the per-row sort and draw
  # (sample_rows gives greedy rows the argmax as well), a step where no row asks for
  # log-probabilities skips the log-softmax and top-k over the vocabulary.
  toks = jax.lax.cond(jnp.all(temperature <= 0),
                      lambda: jnp.argmax(logits, axis=-1).astype(jnp.int32), drawn)
  top = min(MAX_TOP_LOGPROBS, logits.shape[-1])
  b = logits.shape[0]
  out = (toks,) + jax.lax.cond(
      jnp.any(want_logprobs > 0), lambda: token_logprobs(raw, toks, top),
      lambda: (jnp.zeros((b,), jnp.float32), jnp.zeros((b, top), jnp.int32), jnp.zeros((b, top), jnp.float32)))
  return out + (raw,) if keep_logits else out
