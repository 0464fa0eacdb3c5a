"""Adaptive rollout engine: vanilla decoding while the batch is full, speculative in the long tail.

RL rollouts start with every sequence running (a large batch: decoding is efficient and
speculation buys little) and end with a few very long responses (a tiny batch: each step is
latency bound and verification of many draft tokens is almost free). TLT's engine therefore

* decodes the full batch with one on-device vanilla loop until fewer than ``spec_threshold``
  sequences run, then switches to the long tail (the rows never return to the full batch);
* shrinks the batch to the smallest power-of-two bucket holding the running rows, one on-device
  loop per bucket (``speculative.fused``): no Python runs between decode steps;
* lets a ``BucketedBandit`` pick the strategy (depth, topk, verify_tokens) per batch bucket,
  rewarded by ``accepted tokens x batch / step time`` (tokens per second); with
  ``vanilla_arm=True`` plain decoding is one more arm, so the tail is not speculated where no
  strategy beats it (e.g. a small model on a CPU, where a round costs several vanilla steps);
* drafts with the EAGLE drafter, or without a model for ``Strategy.lookup_chain`` arms
  (``speculative.lookup``): chains copied from the row's own history and its reference tokens,
  which are the ``references=`` given to ``generate`` and, with ``lookup_siblings``, the finished
  responses to the same prompt (a GRPO group's siblings), added when the batch shrinks;
* runs only ahead-of-time compiled executables from an ``ExecutablePool`` keyed by
  ``(step, strategy or verify_tokens, batch bucket)`` plus the static decode config (so engines
  can share one pool); verification is shared by every strategy with the same ``verify_tokens``.

Usage::

  engine = RolloutEngine(model, drafter, RolloutConfig(strategies=(Strategy.chain(4),), max_new=128))
  engine.precompile()                       # optional: everything before the first rollout
  res = engine.generate(prompts, seed=0)   # res.tokens[i], res.stats
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from jaxsys.core.errors import ConfigError, InputError
from jaxsys.models.llm.drafter import check_compatible
from jaxsys.speculative import decode as dec
from jaxsys.speculative import fused
from jaxsys.speculative import lookup
from jaxsys.decoding import core
from jaxsys.decoding.core import bucket_of
from jaxsys.decoding.sharding import kv_spec, tp_mesh
from jaxsys.speculative.bandit import BucketedBandit, Strategy
from jaxsys.speculative.pool import ExecutablePool, enable_persistent_cache
from jaxsys.decoding.sampling import GREEDY, SamplingParams

__all__ = ["RolloutConfig", "RolloutEngine", "RolloutResult"]


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
  strategies: tuple[Strategy, ...] = (Strategy.chain(4),)
  max_new: int = 64
  max_prompt: int = 32
  batch_buckets: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
  spec_threshold: int = 8          # speculate when running sequences < spec_threshold
  speculative: bool = True         # False: the vanilla baseline (same engine, no drafting)
  epsilon: float = 0.1
  stop_tokens: tuple[int, ...] = ()
  sampling: SamplingParams = GREEDY
  pool_max_entries: int = 128
  pool_max_bytes: int | None = None
  compilation_cache_dir: str | None = None
  seed: int = 0
  # Each phase of a rollout is one on-device while_loop (``fused.py``, over the decoding core's
  # ``while_running``): vanilla on the full batch until fewer than spec_threshold rows run, then
  # a shrink and the long tail (speculative with a bandit-chosen strategy, or vanilla). No Python
  # runs between decode steps.
  # shrink_tail=True: the long tail shrinks again whenever its running rows fit a smaller
  # bucket, one loop per bucket (the bandit picks each loop's strategy for its batch size);
  # False: one shrink, and the tail ends in the bucket it started in.
  shrink_tail: bool = True
  # vanilla_arm=True: the bandit also has a "no speculation" arm (index len(strategies)), so the
  # long tail falls back to plain decoding on hardware/batch sizes where no strategy pays off.
  vanilla_arm: bool = False
  # Lookup strategies (``Strategy.lookup_chain``): ``lookup_ref`` reference tokens per row (0: a
  # row's own history only); ``lookup_siblings``: finished responses to an identical prompt join
  # the references of the rows still running when the batch shrinks (the long tail's siblings).
  lookup_ref: int = 0
  lookup_siblings: bool = True
  # Prompt lengths the prefill is also compiled for (one executable per length and batch bucket):
  # a batch prefills at the smallest of them, or ``max_prompt``, that holds its longest prompt.
  # RL prompts are often far shorter than ``max_prompt``; a prefill over the whole bucket then
  # costs more than its decode steps save (SmolLM2, max_prompt 241, 160 new tokens at batch 1:
  # 0.35 s of a 5.5 s rollout). ``()``: every prefill is ``max_prompt`` long.
  prompt_buckets: tuple[int, ...] = ()

  def __post_init__(self):
    object.__setattr__(self, "strategies", tuple(self.strategies))
    object.__setattr__(self, "batch_buckets", tuple(sorted(self.batch_buckets)))
    object.__setattr__(self, "stop_tokens", tuple(int(t) for t in self.stop_tokens))
    object.__setattr__(self, "prompt_buckets", tuple(sorted({int(p) for p in self.prompt_buckets})))
    if not self.strategies:
      raise ConfigError("strategies must not be empty")
    if self.max_new < 1 or self.max_prompt < 1:
      raise ConfigError(f"max_new={self.max_new} and max_prompt={self.max_prompt} must be >= 1")
    if self.spec_threshold < 0:
      raise ConfigError(f"spec_threshold={self.spec_threshold} must be >= 0")
    if any(b < 1 for b in self.batch_buckets):
      raise ConfigError(f"batch_buckets={self.batch_buckets} must be positive")
    if not isinstance(self.sampling, SamplingParams):
      raise ConfigError(f"sampling={self.sampling!r} must be a SamplingParams")
    if self.lookup_ref < 0:
      raise ConfigError(f"lookup_ref={self.lookup_ref} must be >= 0")
    if any(not 1 <= p <= self.max_prompt for p in self.prompt_buckets):
      raise ConfigError(f"prompt_buckets={self.prompt_buckets} must lie in [1, max_prompt={self.max_prompt}]")

  @property
  def prompt_lengths(self) -> tuple[int, ...]:
    """The prefill lengths: ``prompt_buckets`` and ``max_prompt``."""
    return tuple(sorted(set(self.prompt_buckets) | {self.max_prompt}))

  @property
  def needs_drafter(self) -> bool:
    """Whether some strategy drafts with the drafter model (lookup strategies do not)."""
    return any(not s.lookup for s in self.strategies)

  @property
  def uses_references(self) -> bool:
    return self.lookup_ref > 0 and any(s.lookup for s in self.strategies)

  @property
  def max_depth(self) -> int:
    return max(s.depth for s in self.strategies)

  @property
  def max_len(self) -> int:
    extra = max(max(s.verify_tokens, (s.depth - 1) * s.topk) for s in self.strategies)
    return self.max_prompt + self.max_new + self.max_depth + extra + 2

  def decode_config(self) -> dec.DecodeConfig:
    return dec.DecodeConfig(max_len=self.max_len, max_new=self.max_new, max_depth=self.max_depth,
                            max_topk=max(s.topk for s in self.strategies),
                            stop_tokens=self.stop_tokens, sampling=self.sampling,
                            ref_len=self.lookup_ref if self.uses_references else 0)


@dataclasses.dataclass
class RolloutResult:
  tokens: list[list[int]]          # new tokens per prompt (stop token included)
  sequences: list[np.ndarray]      # prompt + committed tokens
  features: list[np.ndarray]       # target features of the committed positions [len, embed]
  prompt_lengths: list[int]
  stats: dict


class RolloutEngine:
  """See the module docstring."""

  def __init__(self, model, drafter, config: RolloutConfig, *, pool: ExecutablePool | None = None,
               mesh=None):
    if drafter is None and config.speculative and config.needs_drafter:
      raise ConfigError("speculative=True with drafter-model strategies needs a drafter "
                        "(Strategy.lookup_chain strategies need none)")
    if drafter is not None:
      check_compatible(drafter, model)
    for s in config.strategies:
      if s.verify_tokens > 1 + s.num_candidates:
        raise ConfigError(f"strategy {s.name} verifies more nodes than it drafts")
    config.sampling.check_vocab(model.config.vocab_size)
    if config.compilation_cache_dir:
      enable_persistent_cache(config.compilation_cache_dir)
    self.config = config
    self.dcfg = config.decode_config()
    # mesh: tensor parallelism over "model" (jaxsys.decoding.sharding): weights by the "tp" rules
    # (placed on a copy: the caller's model keeps its own placement), the KV cache by kv head
    self.mesh = None
    if mesh is not None:
      model = _copy(model)
      self.mesh = tp_mesh(model, mesh, "the rollout engine")
    self.gdef, self.tstate = nnx.split(model)
    self.model_config = model.config
    self.drafter_config = drafter.config if drafter is not None else None
    self.dgdef, self.dstate = nnx.split(drafter) if drafter is not None else (None, None)
    self.dstate = self._replicated(self.dstate)
    # ``is None``, not ``or``: an empty pool has len 0 (falsy), and ``or`` would silently give
    # every engine its own pool (no sharing, every executable compiled once per engine).
    self.pool = pool if pool is not None else ExecutablePool(config.pool_max_entries, config.pool_max_bytes)
    arms = config.strategies + ((None,) if config.vanilla_arm else ())
    self.bandit = BucketedBandit(arms, config.batch_buckets, epsilon=config.epsilon, seed=config.seed)
    self._abstract: dict[int, dec.DecodeState] = {}
    # Hashing a GraphDef walks the whole module: do it once, not on every step.
    self._key_suffix = (self.dcfg, hash(self.gdef), hash(self.dgdef), self.mesh)

  # ---- weights ---------------------------------------------------------------------------
  def set_weights(self, model):
    """Syncs new policy weights (same architecture: executables stay valid)."""
    gdef, state = self._split_placed(model)
    if gdef != self.gdef:
      raise ConfigError("set_weights needs a model with the same structure as the engine's")
    self.tstate = state

  def set_drafter(self, drafter_or_state):
    """Swaps in an updated drafter (a module or its ``nnx.State``)."""
    if isinstance(drafter_or_state, nnx.Module):
      check_compatible(drafter_or_state, nnx.merge(self.gdef, self.tstate))
      drafter_or_state = nnx.split(drafter_or_state)[1]
    self.dstate = self._replicated(drafter_or_state)

  # ---- placement (mesh=...) ----------------------------------------------------------------
  def _split_placed(self, model):
    """``nnx.split`` of ``model``, its weights placed by the "tp" rules on a mesh (on a copy);
    without a mesh, on the default device (a trainer may hold them sharded over a mesh)."""
    if self.mesh is None:
      gdef, state = nnx.split(model)
      return gdef, jax.device_put(state, jax.devices()[0])
    model = _copy(model)
    tp_mesh(model, self.mesh, "the rollout engine")
    return nnx.split(model)

  @property
  def _rep(self):
    """Replicated over the mesh (None without one: the default device)."""
    return None if self.mesh is None else NamedSharding(self.mesh, jax.P())

  def _replicated(self, tree):
    if self.mesh is None or tree is None:
      return tree
    return jax.device_put(tree, self._rep)

  def _put(self, x):
    """A host array for an executable: replicated over the mesh, or on the default device."""
    return jax.device_put(x) if self.mesh is None else self._replicated(x)

  def _shardings(self, b: int):
    """The decode state's placement at bucket ``b`` (None without a mesh): the target KV cache
    over "model" by kv head, everything else replicated."""
    if self.mesh is None:
      return None
    st = self._abstract_state(b)
    kv = NamedSharding(self.mesh, kv_spec(self.mesh))
    out = jax.tree.map(lambda _: self._rep, st)
    cache = dataclasses.replace(out.cache, k=tuple(kv for _ in st.cache.k), v=tuple(kv for _ in st.cache.v))
    return out.replace(cache=cache)

  def _on_mesh(self):
    return jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext()

  # ---- executables -----------------------------------------------------------------------
  def _state_shape(self, b: int):
    """The decode state's shapes at bucket ``b``, with their placement on a mesh."""
    st, sh = self._abstract_state(b), self._shardings(b)
    if sh is None:
      return st
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), st, sh)

  def _abstract_state(self, b: int):
    if b not in self._abstract:
      c = self.config
      dcfg = self.drafter_config or _dummy_drafter_cfg(self.model_config)

      def make():
        return dec.init_state(nnx.merge(self.gdef, self.tstate), dcfg, jnp.zeros((b, c.max_prompt), jnp.int32),
                              None, self.dcfg, jax.random.key(0))
      self._abstract[b] = jax.eval_shape(make)
    return self._abstract[b]

  def _exe(self, kind: str, b: int, strategy: Strategy | None = None):
    """The compiled executable for ``kind`` at batch bucket ``b`` (built on the first request)."""
    key = (kind, strategy, b) if kind in ("sloop", "lloop") else (kind, b)
    # Shared pools: executables also depend on the static decode config and module structures.
    key = key + self._key_suffix
    return self.pool.get(key, lambda: self._build_on_mesh(kind, b, strategy))

  def _build_on_mesh(self, kind: str, b: int, strategy: Strategy | None):
    with self._on_mesh():
      return self._build(kind, b, strategy)

  def _build(self, kind: str, b: int, strategy: Strategy | None):
    c, dcfg = self.config, self.dcfg
    st = self._state_shape(b)
    if kind == "init":
      dcf = self.drafter_config or _dummy_drafter_cfg(self.model_config)
      model = nnx.merge(self.gdef, self.tstate)
      # Takes the int seed: an eager ``jax.random.key`` outside would be one more compile.
      fn = lambda seed: dec.init_state(model, dcf, jnp.zeros((b, c.max_prompt), jnp.int32), None, dcfg,
                                       jax.random.key(seed))
      return jax.jit(fn, out_shardings=self._shardings(b)).lower(jnp.uint32(0)).compile()
    if kind.startswith("prefill"):  # "prefill<length>": one executable per prompt length
      prompts = jax.ShapeDtypeStruct((b, int(kind[7:])), jnp.int32, sharding=self._rep)
      lengths = jax.ShapeDtypeStruct((b,), jnp.int32, sharding=self._rep)
      return dec.jit_prefill(dcfg).lower(self.gdef, self.tstate, st, prompts, lengths).compile()
    if kind == "vloop":
      return fused.jit_vanilla_loop(dcfg).lower(self.gdef, self.tstate, st, jnp.int32(1)).compile()
    if kind == "sloop":
      return fused.jit_spec_loop(dcfg, strategy).lower(self.gdef, self.tstate, self.dgdef, self.dstate,
                                                        st, jnp.int32(1), jnp.bool_(True)).compile()
    if kind == "lloop":
      return fused.jit_lookup_loop(dcfg, strategy).lower(self.gdef, self.tstate, st, jnp.int32(1)).compile()
    if kind == "setref":  # new reference tokens for every row (lookup drafting)
      ref = jax.ShapeDtypeStruct((b, dcfg.ref_len), jnp.int32,
                                 sharding=self._rep)
      return jax.jit(lambda st, ref: st.replace(ref=ref), donate_argnums=0,
                     out_shardings=self._shardings(b)).lower(st, ref).compile()
    if kind == "pad":  # marks padding rows done (an eager ``done | mask`` would compile mid-rollout)
      return jax.jit(_mark_padding, out_shardings=self._shardings(b)).lower(st, jnp.int32(0)).compile()
    if kind.startswith("take"):  # shrink from bucket ``b`` to ``new_b``: a pool entry per pair
      new_b = int(kind[4:])
      idx = jax.ShapeDtypeStruct((new_b,), jnp.int32,
                                 sharding=self._rep)
      return jax.jit(_take_rows, out_shardings=self._shardings(new_b)).lower(st, idx, jnp.int32(0)).compile()
    raise ValueError(f"unknown executable kind {kind!r}")

  def _tail_buckets(self) -> set[int]:
    """Buckets a fused long tail can run on: it starts below ``spec_threshold`` running rows."""
    c = self.config
    top = min(max(c.spec_threshold, 2), c.batch_buckets[-1] + 1)  # no tail beyond the largest bucket
    return {bucket_of(r, c.batch_buckets) for r in range(1, top)}

  def _shrink_targets(self, b: int) -> list[int]:
    """Buckets a batch of bucket ``b`` can shrink to: a long-tail bucket (from the full batch,
    then from tail bucket to tail bucket)."""
    return sorted(nb for nb in self._tail_buckets() if nb < b)

  def precompile(self, buckets: Sequence[int] | None = None, speculative: bool | None = None):
    """Compiles every executable a rollout may need, ahead of time: afterwards a rollout whose
    prompt count falls in ``buckets`` runs no compiler (``tests/speculative/test_precompile.py``).
    ``speculative`` (default ``config.speculative``) also builds the speculative long-tail loops
    (for engines used both ways through ``generate(speculative=...)``)."""
    spec = self.config.speculative if speculative is None else speculative
    tail = self._tail_buckets()
    for b in buckets or self.config.batch_buckets:
      self._exe("init", b)
      for lp in self.config.prompt_lengths:
        self._exe(f"prefill{lp}", b)
      self._exe("pad", b)
      for nb in self._shrink_targets(b):
        self._exe(f"take{nb}", b)
      self._exe("vloop", b)
      # The long tail runs on the ``tail`` buckets (``force_strategy`` speculates on any bucket:
      # measurements at a fixed batch warm those up themselves).
      if spec and b in tail:
        for s in self.config.strategies:
          if s.lookup:
            self._exe("lloop", b, s)
          elif self.dstate is not None:
            self._exe("sloop", b, s)
      if self.config.uses_references:
        self._exe("setref", b)

  # ---- rollout ---------------------------------------------------------------------------
  def generate(self, prompts: Sequence[Sequence[int]], *, seed: int = 0,
               on_long_tail: Callable[[], None] | None = None,
               force_strategy: Strategy | None = None,
               speculative: bool | None = None,
               references: Sequence[Sequence[Sequence[int]]] | None = None) -> RolloutResult:
    """Generates for every prompt; see the module docstring.

    ``on_long_tail`` is called once when speculation first switches on (e.g. to start drafter
    training on idle resources); ``force_strategy`` bypasses the bandit and speculates from the
    first step (for measurements at a fixed batch size); ``speculative=False`` runs this call
    as the vanilla baseline (same executables and loop, no drafting). ``references[i]``: token
    sequences lookup strategies may copy from for prompt ``i`` (e.g. earlier responses to it);
    they need ``RolloutConfig.lookup_ref > 0``, which bounds the tokens kept per row (the newest).
    """
    c = self.config
    if force_strategy is not None and force_strategy not in c.strategies:
      raise ConfigError(f"force_strategy {force_strategy.name} is not one of the engine's strategies "
                        "(RolloutConfig.strategies fixes the cache and acceptance sizes)")
    arrs = self._check_prompts(prompts)
    user_refs = self._check_references(references, len(arrs))
    speculate = c.speculative if speculative is None else speculative
    needs = c.needs_drafter if force_strategy is None else not force_strategy.lookup
    if speculate and self.dstate is None and needs:
      raise ConfigError("speculative decoding with drafter-model strategies needs a drafter")
    n = len(arrs)
    b = bucket_of(n, c.batch_buckets)
    lp = bucket_of(max(len(a) for a in arrs), c.prompt_lengths)
    toks, lens = core.pad_batch(arrs, b, lp)
    rows = np.arange(b)  # engine row -> prompt index (>= n: padding)
    t_prefill = time.perf_counter()
    state = self._exe("init", b)(np.uint32(seed))
    # device_put, not jnp.asarray: the latter compiles a staging copy per new shape (mid-rollout).
    state = self._exe(f"prefill{lp}", b)(self.tstate, state, self._put(toks), self._put(lens))
    state = self._exe("pad", b)(state, jnp.int32(n))
    # Reference tokens serve lookup drafting only: a vanilla call skips building them.
    refs = (lambda rows, results: self._references(rows, arrs, user_refs, results)) \
        if c.uses_references and speculate else None
    if refs is not None and user_refs is not None:
      state = self._exe("setref", b)(state, self._put(refs(rows, {})))
    results: dict[int, tuple] = {}
    state.root.block_until_ready()  # so that ``seconds`` is decoding only
    stats = {"steps": 0, "spec_steps": 0, "vanilla_steps": 0, "accepted": [], "spec_batch": [],
             "strategy": [], "spec_seconds": 0.0, "vanilla_seconds": 0.0, "shrinks": 0,
             "prefill_seconds": time.perf_counter() - t_prefill}
    t_start = time.perf_counter()
    state, rows = self._run_phases(state, rows, results, n, stats, speculate, on_long_tail,
                                   force_strategy, refs)
    return self._finish(state, rows, results, n, stats, t_start, arrs)

  def _run_phases(self, state, rows, results, n, stats, speculate, on_long_tail, force_strategy,
                  refs=None):
    """The rollout's on-device phases (module docstring): the full batch's vanilla loop, then
    one long-tail loop per bucket. Fills ``stats``: steps (vanilla steps and speculative rounds),
    seconds, shrinks, and per tail loop its batch, strategy and accepted tokens."""
    c = self.config
    if force_strategy is None:  # phase 1: full batch, vanilla, until the long tail starts
      t0 = time.perf_counter()
      thr = max(c.spec_threshold, 1)
      state, steps = self._exe("vloop", len(rows))(self.tstate, state, jnp.int32(thr))
      stats["vanilla_steps"] += int(steps)  # int(): waits for the loop
      stats["vanilla_seconds"] += time.perf_counter() - t0
    tail_started, synced = False, False
    acc_sum = row_sum = 0  # accepted tokens and running rows over every speculative round
    while True:  # the long tail: one loop per bucket, each on the smallest bucket holding its rows
      done = np.asarray(state.done)
      running = int((~done).sum())
      if running == 0:
        if row_sum:  # one entry: the tail's mean per row and round, over all its loops
          stats["accepted"].append(acc_sum / row_sum)
        return state, rows
      new_b = bucket_of(running, c.batch_buckets)
      if new_b < len(rows):
        state, rows = self._shrink(state, rows, done, new_b, results, n, refs)
        stats["shrinks"] += 1
      b = len(rows)
      smaller = [x for x in c.batch_buckets if x < b]
      # the loop runs while its rows need this bucket, i.e. until they fit the next smaller one
      min_running = jnp.int32(smaller[-1] + 1 if smaller and c.shrink_tail else 1)
      t0 = time.perf_counter()
      arm = None
      if speculate:
        if on_long_tail is not None and not tail_started:
          on_long_tail()
        arm = None if force_strategy is not None else self.bandit.select(running)
      tail_started = True
      vanilla_arm = arm == len(c.strategies)  # the bandit chose not to draft this loop
      if not speculate or vanilla_arm:
        n0 = int(np.asarray(state.n_out).sum()) if vanilla_arm else 0
        state, steps = self._exe("vloop", b)(self.tstate, state, min_running)
        stats["vanilla_steps"] += int(steps)
        dt = time.perf_counter() - t0
        stats["vanilla_seconds"] += dt
        if vanilla_arm:  # rewarded in tokens/s, like the strategies
          stats["strategy"].append("vanilla")
          self.bandit.update(running, arm, (int(np.asarray(state.n_out).sum()) - n0) / dt)
        synced = False  # the drafter's cache misses these tokens
        continue
      strategy = force_strategy if arm is None else c.strategies[arm]
      if strategy.lookup:
        state, rounds, acc, row_rounds, plain = self._exe("lloop", b, strategy)(
            self.tstate, state, min_running)
        stats["lookup_plain_rounds"] = stats.get("lookup_plain_rounds", 0) + int(plain)
        synced = False
      else:  # drafter sync only when an earlier loop left the drafter's cache behind
        state, rounds, acc, row_rounds = self._exe("sloop", b, strategy)(
            self.tstate, self.dstate, state, min_running, jnp.bool_(not synced))
        synced = True
      rounds, acc, row_rounds = int(rounds), int(acc), int(row_rounds)
      dt = time.perf_counter() - t0
      if arm is not None:  # reward: tokens per second of this loop
        self.bandit.update(running, arm, (acc + row_rounds) / dt)
      stats["spec_steps"] += rounds
      stats["spec_seconds"] += dt
      acc_sum, row_sum = acc_sum + acc, row_sum + row_rounds
      stats["spec_batch"].append(running)
      stats["strategy"].append(strategy.name)

  def _shrink(self, state, rows, done, new_b, results, n, refs=None):
    """Harvests finished rows and keeps the running ones in a batch of ``new_b`` rows; ``refs``
    (lookup drafting) rebuilds the kept rows' references, now with their finished siblings."""
    self._harvest(state, rows, done, results, n)
    keep = np.flatnonzero(~done)
    pad = np.full(new_b - len(keep), np.flatnonzero(done)[0], np.int64)
    idx = self._put(np.concatenate([keep, pad]).astype(np.int32))
    state = self._exe(f"take{new_b}", len(rows))(state, idx, jnp.int32(len(keep)))
    rows = np.concatenate([rows[keep], np.full(len(pad), -1)])
    if refs is not None and self.config.lookup_siblings:
      state = self._exe("setref", new_b)(state, self._put(refs(rows, results)))
    return state, rows

  def _references(self, rows, arrs, user_refs, results) -> np.ndarray:
    """``int32 [len(rows), lookup_ref]``: per engine row, the prompt's ``references`` then the
    responses of finished rows with an identical prompt (``lookup.build_references``)."""
    c = self.config
    out = np.full((len(rows), c.lookup_ref), -1, np.int32)
    for i, p in enumerate(rows):
      if not 0 <= p < len(arrs):
        continue
      seqs = list(user_refs[p]) if user_refs is not None else []
      if c.lookup_siblings:
        seqs += [results[q][0] for q in sorted(results)
                 if q != p and np.array_equal(arrs[q], arrs[p])]
      out[i] = lookup.build_references(seqs, c.lookup_ref)
    return out

  def _check_references(self, references, n):
    """Validated ``references`` as lists of int32 arrays per prompt (None stays None)."""
    if references is None:
      return None
    if not self.config.uses_references:
      raise ConfigError("references= needs a lookup strategy (Strategy.lookup_chain) and "
                        f"RolloutConfig.lookup_ref > 0 (got lookup_ref={self.config.lookup_ref})")
    if len(references) != n:
      raise InputError(f"references has {len(references)} entries for {n} prompts (one list per prompt)")
    vocab = self.model_config.vocab_size
    out = []
    for i, seqs in enumerate(references):
      row = []
      for j, toks in enumerate(seqs):
        a = np.asarray(toks)
        if a.ndim != 1 or (a.size and (not np.issubdtype(a.dtype, np.integer) or a.min() < 0
                                       or a.max() >= vocab)):
          raise InputError(f"references[{i}][{j}] must be a 1-D sequence of token ids in "
                           f"[0, {vocab})")
        row.append(a.astype(np.int32))
      out.append(row)
    return out

  def _finish(self, state, rows, results, n, stats, t_start, arrs) -> RolloutResult:
    self._harvest(state, rows, np.asarray(state.done), results, n, final=True)
    stats["steps"] = stats["spec_steps"] + stats["vanilla_steps"]
    stats["seconds"] = time.perf_counter() - t_start
    stats["mean_accepted"] = float(np.mean(stats["accepted"])) if stats["accepted"] else 0.0
    ordered = [results[i] for i in range(n)]
    return RolloutResult(tokens=[r[0] for r in ordered], sequences=[r[1] for r in ordered],
                         features=[r[2] for r in ordered], prompt_lengths=[len(a) for a in arrs],
                         stats=stats)

  def _harvest(self, state, rows, done, results, n, final=False):
    take = [i for i in range(len(rows)) if 0 <= rows[i] < n and rows[i] not in results and (done[i] or final)]
    if not take:
      return
    # Copy whole arrays and index on the host: eager device indexing with a varying number of
    # rows would compile a new gather for every count.
    idx = np.asarray(take)
    out, n_out, seq, feats, lengths = (a[idx] for a in jax.device_get(
        (state.out, state.n_out, state.seq, state.feats, state.cache.lengths)))
    for j, i in enumerate(take):
      length = int(lengths[j])  # committed positions (the last root is not in the cache)
      results[int(rows[i])] = (out[j, :int(n_out[j])].tolist(), seq[j, :length].copy(),
                               feats[j, :length].copy())

  def _check_prompts(self, prompts):
    c = self.config
    out = core.check_prompts(prompts, self.model_config.vocab_size, max_len=c.max_prompt,
                             limit="max_prompt")
    if len(out) > c.batch_buckets[-1]:
      raise InputError(f"{len(out)} prompts exceed the largest batch bucket {c.batch_buckets[-1]}")
    return out


def _mark_padding(state: dec.DecodeState, n) -> dec.DecodeState:
  """Rows ``>= n`` (bucket padding) are done from the start."""
  return state.replace(done=state.done | (jnp.arange(state.done.shape[0]) >= n))


def _take_rows(state: dec.DecodeState, idx, n_keep) -> dec.DecodeState:
  """Rows ``idx`` of every per-row array; rows ``>= n_keep`` (padding) are marked done. Compiled
  with a traced ``n_keep``: one executable per (old, new) bucket pair, not per running count."""
  b = state.done.shape[0]
  new = jax.tree.map(lambda a: a[idx] if a.ndim and a.shape[0] == b else a, state)
  return new.replace(done=new.done | (jnp.arange(idx.shape[0]) >= n_keep))


def _copy(model):
  """A module sharing ``model``'s arrays (placing it moves nothing of the caller's)."""
  gdef, state = nnx.split(model)
  return nnx.merge(gdef, jax.tree.map(lambda x: x, state))  # new variables, the same arrays


def _dummy_drafter_cfg(model_config):
  from jaxsys.models.llm.drafter import DrafterConfig
  return DrafterConfig.for_target(model_config)
