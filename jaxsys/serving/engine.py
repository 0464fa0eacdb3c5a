"""Serving engine: continuous batching over a paged KV cache, dense or LServe sparse attention.

``ServingEngine(model, ServingConfig(...), streaming=flags)`` serves ragged requests with a fixed number
of batch slots: between decode steps finished requests leave (their pages return to the free
list) and waiting requests join (prefill fills their pages, their first token is sampled from
the prefill logits). Every decode step is one jitted call over all slots (static shapes: slots
x page-table bucket), with two executables: one that refreshes the page selection and one that
reuses it (LServe reuses a selection for ``reuse_steps`` steps).

* ``ServingConfig(lserve=LServeConfig(dense=True))``: every head reads every page (the exact
  dense baseline on the same cache).
* LServe mode: retrieval heads read the top pages of the hierarchical selector under
  ``token_budget``; streaming heads (``streaming`` flags ``bool[layers, kv_heads]``, e.g. from
  ``streaming.identify_streaming_heads``) read sink + local pages.

A request that can never fit (prompt + new tokens beyond ``max_seq_len``, the model's context
length or the page pool) is rejected with a message in ``result.errors`` while the others are
served; one that does not fit *now* waits for pages to be freed.

An exception or ``KeyboardInterrupt`` at any point of ``generate`` propagates after every page of
the call went back to the pool (as vLLM aborts a request): the engine stays usable.

**Step-level API** (``scheduler.py``; what the OpenAI server drives): ``add_request(prompt,
RequestParams(...), request_id)`` queues a request (token ids, or with ``tokenizer=`` a string
or a chat), each ``step()`` runs one iteration of continuous batching (decode of the running
sequences plus prefill chunks under the token budget ``max_num_batched_tokens``, prefix cache,
preemption by recompute) and returns every running sequence's new tokens and text;
``abort(request_id)`` frees a request's pages at once.

Usage::

  engine = ServingEngine(model, ServingConfig(max_batch=4, num_pages=512), streaming=gates.streaming)
  res = engine.generate([[1, 2, 3], [4, 5]], max_new_tokens=16)
  res.tokens[0], res.errors[1]

  engine = ServingEngine(model, ServingConfig(max_batch=8, num_pages=512), tokenizer=tok)
  engine.add_request([{"role": "user", "content": "Hi"}], RequestParams(max_tokens=32), "r1")
  while engine.has_unfinished():
    outs = engine.step()               # [StepOutput(request_id, index, new_token_ids, new_text, ...)]
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxsys.core.errors import ConfigError, InputError, check_min
from jaxsys.serving import lserve as lserve_lib
from jaxsys.decoding.core import bucket, check_prompts, context_length, describe_context
from jaxsys.decoding.sampling import GREEDY, SamplingParams
from jaxsys.decoding.sharding import tp_mesh
from jaxsys.serving.paged_cache import PagedCacheConfig, PagedKVCache, PoolExhaustedError
from jaxsys.serving.paged_views import PagedDecode
from jaxsys.serving.prefill import check_model, prefill
from jaxsys.serving.requests import RequestParams, StepOutput
from jaxsys.serving.scheduler import Scheduler, draw

__all__ = ["ServingConfig", "ServingEngine", "ServingResult"]

_ids = itertools.count()


@dataclasses.dataclass(frozen=True)
class ServingConfig:
  """Slots, pool and sequence limits of the engine and its attention mode (``lserve``).

  ``max_seq_len`` bounds prompt + new tokens of a request; the engine lowers it to the model's
  context length (``generate.context_length``) where that is shorter. ``max_num_batched_tokens``
  is the step API's token budget per step (decode tokens + prefill chunk tokens);
  ``prefix_caching`` shares full prompt pages between requests of the step API.
  """
  lserve: lserve_lib.LServeConfig = lserve_lib.LServeConfig()
  max_batch: int = 4
  num_pages: int = 256
  max_seq_len: int = 4096
  prefill_chunk: int = 4096
  min_prompt_bucket: int = 16
  max_num_batched_tokens: int = 2048
  prefix_caching: bool = True

  def __post_init__(self):
    check_min(self, 1, "max_batch", "num_pages", "max_seq_len", "prefill_chunk", "min_prompt_bucket")
    if self.max_num_batched_tokens < self.max_batch + 1:
      raise ConfigError(f"max_num_batched_tokens={self.max_num_batched_tokens} must exceed "
                        f"max_batch={self.max_batch} (room for a prefill chunk beside every decode)")
    if self.max_seq_len > self.num_pages * self.lserve.page_size:
      raise ConfigError(f"max_seq_len={self.max_seq_len} exceeds the pool: num_pages={self.num_pages} "
                        f"x page_size={self.lserve.page_size}")


@dataclasses.dataclass
class ServingResult:
  tokens: list[list[int]]
  finished: list[bool]           # stopped on a stop token
  errors: list[str | None]       # why a request was rejected (None if served)
  logits: list[np.ndarray] | None = None   # [new_tokens, vocab] when return_logits
  steps: int = 0
  prefill_seconds: float = 0.0
  decode_seconds: float = 0.0
  decode_tokens: int = 0

  @property
  def decode_tokens_per_second(self) -> float:
    return self.decode_tokens / self.decode_seconds if self.decode_seconds else 0.0


class ServingEngine:
  """See the module docstring."""

  def __init__(self, model, config: ServingConfig = ServingConfig(), streaming=None, *,
               tokenizer=None, stop_tokens=None, mesh=None):
    self.model = model
    self.mesh = tp_mesh(model, mesh, "the serving engine")
    self.tokenizer = tokenizer
    self.config = config
    ls = config.lserve
    mc = model.config
    flags = None
    if streaming is not None and not ls.dense:
      flags = np.asarray(streaming, bool)
      if flags.shape != (mc.num_layers, mc.num_kv_heads):
        raise ConfigError(f"streaming flags have shape {flags.shape}; expected "
                          f"(num_layers={mc.num_layers}, num_kv_heads={mc.num_kv_heads})")
    self.cache_config = ls.cache_config(
        num_layers=mc.num_layers, num_kv_heads=mc.num_kv_heads, head_dim=mc.head_dim,
        num_pages=config.num_pages, max_requests=config.max_batch,
        streaming=None if flags is None else tuple(map(tuple, flags)), dtype=str(jnp.dtype(mc.dtype)))
    check_model(model, self.cache_config)
    self.selection = ls.selection
    self.max_seq_len = min(config.max_seq_len, context_length(mc))
    self.max_pages = -(-self.max_seq_len // ls.page_size)
    self.cache = PagedKVCache(self.cache_config, self.mesh)
    self._graphdef, self._params = nnx.split(model)
    self._numbers = None  # per-layer retrieval selections [slots, r_l, K]
    self._since_select = 0
    from jaxsys.serving.generation import default_stop_tokens  # noqa: PLC0415
    self.stop_tokens = tuple(default_stop_tokens(mc, tokenizer) if stop_tokens is None else stop_tokens)
    self.scheduler = Scheduler(self, tokenizer)

  # -- step-level API (scheduler.py) ----------------------------------------------------------
  def add_request(self, prompt, params: RequestParams | None = None, request_id: str | None = None) -> str:
    """Queues a request (token ids; a string or chat with a tokenizer); returns its id.

    Raises ``InputError`` for a bad prompt, a duplicate id, or prompt + ``max_tokens`` beyond
    ``max_seq_len`` / the model's context / the pool (nothing is queued then)."""
    if request_id is None:
      request_id = f"req-{next(_ids)}"
    return self.scheduler.add(prompt, params, str(request_id))

  def step(self) -> list[StepOutput]:
    """One iteration: the new tokens (and text) of every sequence that advanced."""
    with self.on_mesh():
      return self.scheduler.step()

  def on_mesh(self):
    """The engine's mesh as the ambient one (its programs' layout hints need it); a no-op
    without a mesh."""
    return jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext()

  def abort(self, request_id: str) -> bool:
    """Drops a queued or running request and frees its pages (False if it is not live)."""
    return self.scheduler.abort(str(request_id))

  def has_unfinished(self) -> bool:
    return self.scheduler.has_unfinished()

  @property
  def num_free_pages(self) -> int:
    """Pages a new request could take: free plus cached-but-unreferenced ones."""
    return self.cache.alloc.num_free

  # -- admission ----------------------------------------------------------------------------
  def _capacity_error(self, n_tokens: int) -> str | None:
    c = self.config
    if n_tokens > self.max_seq_len:
      return (f"prompt + max_new_tokens = {n_tokens} tokens exceeds the limit of {self.max_seq_len}: "
              f"max_seq_len={c.max_seq_len}, {describe_context(self.model.config)}")
    need = self.cache.pages_for(n_tokens)
    if need > c.num_pages:
      return f"needs {need} pages but the pool has num_pages={c.num_pages}"
    return None

  def _prefill(self, rid, prompt):
    """Prefills the whole ``prompt`` (int32 ids) into ``rid``'s pages in one call (chunked inside
    it); the last token's hidden state ``[1, embed]``."""
    c = self.config
    n = len(prompt)
    t = bucket(n, c.min_prompt_bucket)
    chunk = min(c.prefill_chunk, t)
    t = -(-t // chunk) * chunk
    tokens = np.zeros((1, t), np.int32)
    tokens[0, :n] = prompt
    bt, stt, _ = self.cache.block_tables([rid], self.max_pages)
    self.cache.state, hidden = prefill(self.model, self.cache_config, self.cache.state,
                                       jnp.asarray(tokens), n, jnp.asarray(bt), jnp.asarray(stt),
                                       chunk=chunk, impl="auto")
    self.cache.seqs[rid].length = n
    return hidden

  # -- generation ---------------------------------------------------------------------------
  def generate(self, prompts, max_new_tokens, *, sampling: SamplingParams | None = None,
               stop_tokens=None, progress: bool = False, return_logits: bool = False) -> ServingResult:
    """Serves all prompts with continuous batching; see the module docstring.

    A thin layer over the step API: every prompt that fits becomes a request of the scheduler
    and ``step()`` runs until all finished (one batch loop for both). ``max_new_tokens``: an int
    or one per prompt. ``sampling=None`` is greedy; otherwise prompt ``i`` draws with its own seed
    derived from ``(sampling.seed, i)``. Stop tokens default to the config's EOS ids.
    """
    mc = self.model.config
    sch = self.scheduler
    if sch.has_unfinished():
      raise InputError("generate() cannot run while step-API requests are live; abort them first")
    arrs = check_prompts(prompts, mc.vocab_size)
    news = [max_new_tokens] * len(arrs) if np.ndim(max_new_tokens) == 0 else list(max_new_tokens)
    if len(news) != len(arrs) or any(int(m) < 1 for m in news):
      raise InputError(f"max_new_tokens must be a positive int or one per prompt, got {max_new_tokens!r}")
    stops = tuple(int(t) for t in (getattr(mc, "eos_ids", ()) if stop_tokens is None else stop_tokens))
    s = GREEDY if sampling is None else sampling
    s.check_vocab(mc.vocab_size)
    errors = [self._capacity_error(len(a) + int(m)) for a, m in zip(arrs, news)]
    res = ServingResult([[] for _ in arrs], [False] * len(arrs), errors,
                        [None] * len(arrs) if return_logits else None)
    call = next(_ids)
    rids, seqs, bar = {}, {}, None
    try:
      for i, (a, m) in enumerate(zip(arrs, news)):
        if errors[i] is None:
          params = RequestParams(max_tokens=int(m), temperature=s.temperature, top_p=s.top_p,
                                 top_k=s.top_k, min_p=s.min_p, seed=_prompt_seed(s.seed, i),
                                 stop_token_ids=stops, ignore_eos=True,
                                 frequency_penalty=s.frequency_penalty, presence_penalty=s.presence_penalty,
                                 repetition_penalty=s.repetition_penalty, logit_bias=s.logit_bias)
          rid = sch.add(a, params, f"generate-{call}-{i}", text=False)
          rids[rid], seqs[rid] = i, sch.requests[rid][0]
      bar = _progress(progress, sum(int(news[i]) for i in rids.values()))
      sch.keep_logits = return_logits
      while sch.has_unfinished():
        steps, pre, dec = sch.stats["steps"], sch.stats["prefill_tokens"], sch.stats["decode_tokens"]
        t0 = time.perf_counter()
        outs = self.step()
        dt = time.perf_counter() - t0
        if sch.stats["steps"] == steps:  # nothing ran while requests wait: a bug, not a wait
          raise PoolExhaustedError("the engine is idle but cannot admit the next request")
        res.steps += 1
        if sch.stats["prefill_tokens"] > pre:  # a step with prefill chunks counts as prefill time
          res.prefill_seconds += dt
        else:
          res.decode_seconds += dt
          res.decode_tokens += sch.stats["decode_tokens"] - dec
        if bar is not None:
          for o in outs:
            bar.update(len(o.new_token_ids))
            if o.finished and o.num_generated < seqs[o.request_id].params.max_tokens:
              bar.total -= seqs[o.request_id].params.max_tokens - o.num_generated  # stopped early
              bar.refresh()
    except BaseException:
      sch.reset()
      raise
    finally:
      sch.keep_logits = False
      if bar is not None:
        bar.close()
    for rid, i in rids.items():
      q = seqs[rid]
      res.tokens[i] = list(q.out)
      res.finished[i] = q.finish_reason == "stop"
      if return_logits:
        res.logits[i] = np.stack(q.logits)
    return res

  def _abort(self):
    """After a failure anywhere in ``generate``: frees every live request (admitted, prefilling or
    decoding) and forgets the page selection, so the next call starts from an empty pool."""
    self.cache.release_all()
    self._numbers = None
    self._since_select = 0

  def _decode(self, rids, tokens, reselect, ints, floats, keep_logits=False, pen=None):
    """The decode step over the slots ``rids`` (None: empty) with each one's last token
    ``tokens int32[slots]``; the rows' next tokens are drawn in the same executable
    (``scheduler.draw`` with the scheduler's sampling arguments ``ints`` / ``floats`` and the
    rows' ``pen`` LogitAdjust or None; one dispatch per decode step): what ``draw`` returns
    (device arrays)."""
    for rid in rids:
      if rid is not None:
        self.cache.extend(rid, 1)
    bt, stt, lengths = self.cache.block_tables(rids, self.max_pages)
    active = np.array([r is not None for r in rids])
    sel = self.selection
    if sel is not None:
      reselect = reselect or self._numbers is None or self._since_select >= sel.reuse_steps
      self._since_select = 1 if reselect else self._since_select + 1
    numbers = self._numbers if self._numbers is not None else self._no_selection(len(rids))
    drawn, self.cache.state, numbers = _decode_step(
        self._graphdef, self._params, self.cache_config, sel, self.cache.state, jnp.asarray(tokens),
        jnp.asarray(lengths), jnp.asarray(active), jnp.asarray(bt), jnp.asarray(stt),
        tuple(numbers), np.bool_(reselect if sel is not None else True), self.config.lserve.impl,
        bool(keep_logits), ints, floats, pen)
    self._numbers = list(numbers) if sel is not None else None
    for rid in rids:
      if rid is not None:
        self.cache.seqs[rid].length += 1
    return drawn

  def _no_selection(self, slots: int) -> list:
    """The selection a decode step starts from before any (it re-selects then): per layer
    ``int32[slots, r_l, K]`` of -1 where the step selects pages (a retrieval head and more pages
    than the budget), else None. Arrays of the carried selection's shape, not None, so the first
    step runs the executable of every later re-selecting step instead of compiling its own."""
    c, sel = self.cache_config, self.selection
    if self.mesh is not None or not lserve_lib.selects_pages(sel, self.max_pages):
      return [None] * c.num_layers
    return [np.full((slots, len(r), sel.num_select), -1, np.int32) if len(r) else None
            for r in map(c.retrieval_heads, range(c.num_layers))]


# reselect (11) is traced: re-selecting and reusing steps share one executable
@functools.partial(jax.jit, static_argnums=(0, 2, 3, 12, 13), donate_argnums=(4,))
def _decode_step(graphdef, params, c: PagedCacheConfig, sel, st, tokens, positions, active, bt,
                 stt, numbers, reselect, impl, keep_logits, ints, floats, pen):
  model = nnx.merge(graphdef, params)
  view = PagedDecode(st, bt, stt, positions, active, tuple(numbers), config=c, selection=sel,
                     reselect=reselect, impl=impl)
  h, view = model.forward_hidden(tokens[:, None], positions=positions[:, None], cache=view)
  logits = model.logits(h)[:, 0]  # [slots, vocab]
  return draw(logits[ints[0]], ints, floats, keep_logits, pen), view.state, view.numbers


def _prompt_seed(seed: int, index: int) -> int:
  """Prompt ``index``'s seed in a ``generate`` call seeded ``seed``: distinct streams per prompt."""
  return int(np.random.SeedSequence([int(seed), int(index)]).generate_state(1)[0] & 0x7FFFFFFF)


def _progress(enabled: bool, total: int):
  if not enabled:
    return None
  from tqdm.auto import tqdm
  return tqdm(total=total, desc="tokens", file=sys.stderr)
