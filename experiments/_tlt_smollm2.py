"""TLT full mode on SmolLM2-135M-Instruct (``python -m experiments.tlt``).

The policy is the real model (``jaxsys.models.load_pretrained``, f32 weights). Prompts are
``jaxsys.rl.chat_tasks.ChatTaskSampler``'s verifiable chat tasks (count / list / repeat / sort N
items, worked arithmetic; N truncated-Zipf), whose answers are naturally long-tailed (the figures
in experiments/README.md were measured before this switch, on plain "list / count N items"
instructions). Measures:

1. the regime row: the batch-1 decode step of the decoding core's ``generate`` (on-device loop,
   per-step cost from two lengths, so the prefill cancels) beside weight bytes / measured read
   bandwidth (``jaxsys.core.bench.read_bandwidth``) and llama.cpp when ``llama_cpp`` imports;
   the 5-token verify / 1-token forward ratio at batch 1 (``speculative.forward.target_tree_forward``
   over a 256-token cache); the longest rollout response relative to the median;
1b. lookup drafting (``experiments._tlt_lookup``, part ``lookup``): chains copied from the row's
   own history and from 3 sibling responses, no drafter model, against both vanilla decodes at
   batch 1-8, and its greedy losslessness; ``grpo_lookup``: GRPO with the lookup-drafted long
   tail vs the vanilla rollout on a heavier-tailed task mix (sizes to 64, 256 new tokens), with
   the rollout share f of that mix;
2. an EAGLE drafter warmed up on the policy's own sampled rollouts (``rl.tlt.warm_up_drafter``,
   CE over a reduced draft vocabulary of the K most frequent rollout tokens; FR-Spec / EAGLE-3),
   saved under the run dir;
3. speculative decode speedup vs the same engine's vanilla mode at batch 1, 2, 4, 8 (one decode
   loop: speculation switched off; its state sized for the long prompts it decodes,
   ``long_prompt``, so it keeps pace with the decoding core's ``generate``, which is timed in the
   same rounds as a cross-check row; sampled at the rollout temperature, interleaved best-of-N),
   chain and tree,
   reduced vs full draft vocabulary (the same trained block, drafting through all 49152 head
   rows), with the mean accepted length;
4. greedy losslessness: speculative == vanilla token for token on 8 prompts;
5. GRPO on the chat tasks (4 prompts x G = 4 per step, 10 steps, lr 1e-6, no KL term; updates
   on 4 responses at a time with the blocks rematerialised, which keeps the run under ~19 GB), TLT
   (online drafter, bandit with a vanilla arm, speculative long tail) vs the vanilla rollout,
   same seeds, interleaved in one process (``experiments._tlt_grpo``): step / rollout / update
   time (steps 2+), the rollout share f and its Amdahl bound, the drafter's update time, reward
   curves overlaid and the accepted length of the frozen vs the online drafter on the drifting
   policy (``tlt_smollm2_grpo.png``).

``python -m experiments.tlt --parts grpo`` runs one part (with the warm-up it needs) and writes
``runs/tlt_grpo/`` (plots and the drafter checkpoint too). On a 24 GB host start the ``grpo`` part
with ``MALLOC_ARENA_MAX=2`` in the environment: measured that way it peaked at 18.8 GB.
``JAXSYS_TLT_DRAFTER=runs/tlt/drafter_ckpt/smollm2_<time>`` restores a drafter an
earlier run saved (same settings) instead of training one; only the rollouts GRPO's online
buffer starts from are then sampled.

``run(out_dir, parts=None, seed=0)``: ``seed`` (the experiment's ``--seed``) moves every prompt
set, the drafter's initialisation, the rollouts' and GRPO's sampling keys, the drafter buffers,
the bandit and the task sampler (seed 0: the default table). A drafter restored with
``JAXSYS_TLT_DRAFTER`` is the one named, whatever seed it was trained under (the path is the
user's choice; the rollouts after it follow the seed).
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

import numpy as np

from experiments._cli import reseed
from jaxsys.core.results import Row, run_dir, write_result

NAME = "tlt"
MODEL = "smollm2-135m-instruct"



def _config(seed: int = 0) -> dict:
  # ``seed``: the run's --seed, recorded; the literal seeds below are reseed(<literal>, seed).
  return dict(temperature=0.7, max_new=160, warm_rollouts=16, warm_batch=8, warm_steps=400,
              draft_vocab=4096, batches=(1, 2, 4, 8), repeats=2, chain=(4, 1, 5), tree=(4, 2, 5),
              items=(2, 48), verify_cache=256, verify_reps=20, n_lossless=8, lossless_new=32, seed=seed,
              # GRPO (part "grpo"): 4 prompts x G=4 per step, 10 steps of each run
              grpo_steps=10, prompts_per_step=4, group_size=4, grpo_lr=1e-6, length_bucket=128,
              spot_steps=16, online_buffer=6, online_lr=5e-4, n_eval=4,
              # lookup drafting (part "lookup", ``experiments._tlt_lookup``): no drafter model
              lookup_depth=4, lookup_ngram=3, lookup_ref=512, lookup_sets=5,
              # The speedup and lookup engines decode only the long-tail count / repeat prompts
              # (56-59 tokens with the chat template): their decode state is sized for 64 prompt
              # tokens, as generate's is (prompt bucket + new tokens), not for the sampler's 241.
              long_prompt=64,
              # GRPO with the lookup-drafted tail (part "grpo_lookup"): a heavier-tailed task mix
              heavy_items=(2, 64), heavy_max_new=256, lookup_grpo_steps=6)


PARTS = ("regime", "lookup", "grpo_lookup", "speedup", "lossless", "grpo")


def _prompts(sampler, n: int, rng, *, long_only: bool = False) -> list[list[int]]:
  """Prompts of a ``jaxsys.rl.chat_tasks.ChatTaskSampler``: its long-tailed mixture
  (truncated-Zipf sizes), or ``long_only`` count / repeat tasks of 24-48 items (the long tail the
  speedup rows decode)."""
  from jaxsys.rl import chat_tasks
  if long_only:
    return [list(chat_tasks.make_example(str(rng.choice(["count", "repeat"])), rng,
                                         int(rng.integers(24, 49)), sampler.tokenizer).prompt)
            for _ in range(n)]
  return [list(e.prompt) for e in sampler.sample(n, rng)]


def _verify_ratio(model, cache_len: int, reps: int) -> tuple[float, float]:
  """Best-of-``reps`` seconds of a batch-1 target forward over 1 and 5 new tokens (causal among
  them) after ``cache_len`` cached rows, interleaved: ``(t1, t5)``."""
  import jax
  import jax.numpy as jnp
  from flax import nnx
  from jaxsys.core.bench import time_interleaved
  from jaxsys.decoding.cache import KVCache
  from jaxsys.speculative import forward as fwd
  gdef, state = nnx.split(model)

  @jax.jit
  def f(state, cache, tokens, positions, vis):
    return fwd.target_tree_forward(nnx.merge(gdef, state), cache, tokens, positions, vis)[0]

  cache = KVCache.init(model.config, 1, cache_len + 8).with_lengths(jnp.full((1,), cache_len, jnp.int32))
  args = {}
  for t in (1, 5):
    args[t] = (state, cache, jnp.ones((1, t), jnp.int32),
               cache_len + jnp.arange(t, dtype=jnp.int32)[None], jnp.tril(jnp.ones((t, t), bool))[None])
  times = time_interleaved({t: (f, args[t]) for t in (1, 5)}, rounds=reps)
  return times[1].min, times[5].min


def run(out_dir: str, parts=None, seed: int = 0, dtype: str = "float32") -> list[Row]:
  """``parts``: names from ``PARTS`` (default all; the drafter warm-up runs unless the parts are
  among ``regime``, ``lookup`` and ``grpo_lookup``); results go to ``tlt`` or ``tlt_<parts>``.
  ``seed``: the run's ``--seed``, passed to every part. ``dtype``: the policy's compute dtype."""
  from experiments import _tlt_lookup
  from experiments._cli import with_compute_dtype
  from jaxsys.models import load_pretrained
  from jaxsys.rl.chat_tasks import ChatTaskSampler
  from jaxsys.serving.generation import default_stop_tokens

  parts = tuple(parts or PARTS)
  if set(parts) - set(PARTS):
    raise ValueError(f"parts={list(parts)} must be names among {PARTS}")
  cfg = _config(seed)
  name = NAME if parts == PARTS else NAME + "_" + "_".join(parts)
  out = run_dir(name, out_dir)     # plots, the drafter checkpoint and the XLA cache beside result.json
  t_start = time.perf_counter()
  model, tok = load_pretrained(MODEL)
  model = with_compute_dtype(model, dtype)
  stops = default_stop_tokens(model.config, tok)
  sampler = ChatTaskSampler(tok, items=cfg["items"], seed=reseed(0, seed))
  rows: list[Row] = []
  extra: dict = {"lookup": None, "grpo_lookup": None}
  config = dict(cfg, model=MODEL, parts=list(parts), dtype=dtype)
  step_s = None
  if "regime" in parts:
    rrows, step_s = _regime(model, sampler, cfg, seed)
    rows += rrows
  if "lookup" in parts:  # no drafter model, so before the warm-up
    rrows, extra["lookup"] = _tlt_lookup.run(
        model, sampler, stops, cfg, lambda n, r: _prompts(sampler, n, r, long_only=True), out, seed=seed)
    rows += rrows
  if "grpo_lookup" in parts:
    rrows, extra["grpo_lookup"] = _tlt_lookup.grpo(model, tok, stops, cfg, out, seed=seed)
    rows += rrows
  if set(parts) - {"regime", "lookup", "grpo_lookup"}:  # the parts below need the drafter
    w = _warmup(model, sampler, stops, cfg, out, seed)
    rows += w.rows
    extra["warm"] = w.log
    config.update(chain=w.chain.name, tree=w.tree.name, draft_coverage=w.coverage, lengths=w.lengths)
    if "speedup" in parts:
      rrows, extra["curves"] = _speedup(model, w, sampler, stops, cfg, step_s, seed)
      rows += rrows
    if "lossless" in parts:
      rows += _lossless(model, w, sampler, stops, cfg, seed)
    if "grpo" in parts:
      rrows, extra["grpo"], summary = _grpo(model, sampler, w.drafter, w.rollouts, w.base, w.pool, cfg,
                                            step_s, out, seed)
      rows += rrows
      config.update(summary)
    config["compilations"] = w.pool.compilations
  config.update(seconds=time.perf_counter() - t_start, machine_note="2-core CPU host")
  write_result(name, rows, config=config, quick=False, out_dir=out_dir, extra=extra)
  return rows


def _regime(model, sampler, cfg, seed):
  """Part 1: the batch-1 decode step beside the bandwidth bound (and llama.cpp when it imports),
  and the 5-token verify / 1-token forward ratio. Returns ``(rows, step seconds)``."""
  from experiments import real_lm
  from jaxsys.core.bench import read_bandwidth, time_fn
  from jaxsys.serving.generation import generate
  probe = _prompts(sampler, 1, np.random.default_rng(reseed(1, seed)), long_only=True)
  n_short, n_long = 32, 128
  for n in (n_short, n_long):  # compile both lengths' loops
    generate(model, probe, max_new_tokens=n, stop_tokens=())
  t_short, t_long = (time_fn(generate, model, probe, max_new_tokens=n, stop_tokens=(), warmup=0,
                             iters=3).min for n in (n_short, n_long))
  step_s = (t_long - t_short) / (n_long - n_short)
  bw = read_bandwidth(1.0, 3)["xla"]
  wbytes = real_lm._param_bytes(model)
  bound_s = wbytes / bw
  llama_note = "llama.cpp: llama_cpp does not import here (not installed), not measured"
  if real_lm._have_llama():
    from jaxsys.models.llm.interop import pretrained as P
    llm = real_lm._Llama(real_lm._llama_files(P.find(MODEL))["F32"], n_ctx=512)
    llm.generate(probe[0], 8)
    _, dec_s, _ = llm.generate(probe[0], n_long)
    llama_note = f"llama.cpp F32 {1e3 * dec_s / (n_long - 1):.1f} ms/token"
  t1, t5 = _verify_ratio(model, cfg["verify_cache"], cfg["verify_reps"])
  print(f"[tlt/smollm2] regime: step {1e3 * step_s:.1f} ms, bound {1e3 * bound_s:.1f} ms, "
        f"verify 5/1 {t5 / t1:.2f}", flush=True)
  return [Row(metric="regime: batch-1 decode step (decoding core generate)", unit="ms",
              ours=1e3 * step_s, baseline=1e3 * bound_s, baseline_name="weight bytes / read bandwidth",
              ratio=bound_s / step_s,
              note=f"{wbytes / 1e6:.0f} MB f32 weights at {bw / 1e9:.1f} GB/s (XLA 1 GiB read); "
                   f"ratio = share of the bandwidth bound reached; {llama_note}"),
          Row(metric="regime: 5-token verify / 1-token forward, batch 1", unit="x", ours=t5 / t1, goal="<= 1.3",
              note=f"{1e3 * t1:.1f} ms vs {1e3 * t5:.1f} ms after {cfg['verify_cache']} cached tokens")], step_s


@dataclasses.dataclass
class _Warm:
  """The drafter warm-up's products, shared by the speedup, lossless and GRPO parts."""
  drafter: Any       # reduced draft vocabulary, trained (or restored)
  full: Any          # the same trained block drafting through the full head
  rollouts: list     # the warm-up rollouts (GRPO's online buffer starts from the last ones)
  base: dict         # the RolloutConfig fields every engine shares
  pool: Any          # one executable pool for every engine
  chain: Any
  tree: Any
  lengths: list      # response lengths of the warm-up rollouts
  coverage: float    # share of response tokens the reduced vocabulary covers
  log: dict
  rows: list


def _warmup(model, sampler, stops, cfg, out, seed) -> _Warm:
  """Part 2: rollouts of the policy and the EAGLE drafter trained on them (``jaxsys.rl.tlt.
  warm_up_drafter``), or restored from ``JAXSYS_TLT_DRAFTER`` (then only the rollouts GRPO's
  online buffer starts from are sampled)."""
  from flax import nnx
  from jaxsys.decoding.sampling import SamplingParams
  from jaxsys.models.llm.drafter import DrafterConfig, EagleDrafter
  from jaxsys.rl.tlt import warm_up_drafter
  from jaxsys.speculative import online
  from jaxsys.speculative.bandit import Strategy
  from jaxsys.speculative.engine import RolloutConfig
  from jaxsys.speculative.pool import ExecutablePool
  mc = model.config
  chain, tree = Strategy(*cfg["chain"]), Strategy(*cfg["tree"])
  base = dict(strategies=(chain, tree), max_new=cfg["max_new"], max_prompt=sampler.max_prompt,
              prompt_buckets=tuple(p for p in (32, 64, 128) if p < sampler.max_prompt),
              stop_tokens=stops, batch_buckets=cfg["batches"], spec_threshold=8,
              sampling=SamplingParams(cfg["temperature"]), compilation_cache_dir=str(out / "xla_cache"),
              seed=reseed(0, seed))  # the bandit's exploration
  pool = ExecutablePool(max_entries=256)
  dcfg = DrafterConfig.for_target(mc, draft_vocab=cfg["draft_vocab"])
  saved = os.environ.get("JAXSYS_TLT_DRAFTER")
  drafter = online.load_drafter(saved, dcfg) if saved else EagleDrafter(dcfg, rngs=nnx.Rngs(reseed(1, seed)))
  rng = np.random.default_rng(reseed(0, seed))  # the warm-up rollouts' prompts
  n = cfg["online_buffer"] if saved else cfg["warm_rollouts"]
  warm = warm_up_drafter(model, drafter, RolloutConfig(**base),
                         [_prompts(sampler, cfg["warm_batch"], rng) for _ in range(n)],
                         seeds=[reseed(100 + k, seed) for k in range(n)], steps=0 if saved else cfg["warm_steps"],
                         lr=3e-3, batch=8, draft_vocab=not saved,
                         heldout=(_prompts(sampler, cfg["warm_batch"], np.random.default_rng(reseed(99, seed))),
                                  reseed(7, seed)),
                         buffer_seed=reseed(0, seed), pool=pool)
  drafter = warm.drafter
  if not saved:
    online.save_drafter(out / "drafter_ckpt" / f"smollm2_{int(time.time())}", drafter)
  full = EagleDrafter(DrafterConfig.for_target(mc), rngs=nnx.Rngs(reseed(1, seed)))
  nnx.update(full, nnx.state(drafter, nnx.Param))
  lengths = np.asarray([len(t) for r in warm.rollouts for t in r.tokens])
  resp = np.concatenate([np.asarray(s)[p:] for r in warm.rollouts for s, p in zip(r.sequences, r.prompt_lengths)])
  counts = np.bincount(resp, minlength=mc.vocab_size)
  coverage = float(counts[np.asarray(drafter.draft_ids[...])].sum() / counts.sum())
  log = {"drafter_warm": dict(warm.metrics, **({"restored": saved} if saved else {}))}
  med = float(np.median(lengths))
  rows = [Row(metric="regime: longest rollout response / median", unit="x", ours=float(lengths.max()) / med,
              note=f"{len(lengths)} sampled responses (T={cfg['temperature']}), median {med:.0f}, "
                   f"max {lengths.max()} tokens (max_new {cfg['max_new']})"),
          Row(metric="drafter warm-up (reduced vocab CE)", unit="held-out top-1", ours=warm.metrics["heldout_top1"],
              note=(f"restored from {saved}" if saved else
                    f"{cfg['warm_steps']} steps in {warm.metrics['train_seconds']:.0f}s on "
                    f"{len(lengths)} responses") + f"; K={cfg['draft_vocab']} covers "
                   f"{coverage:.3f} of response tokens")]
  print(f"[tlt/smollm2] warm-up: {log}", flush=True)
  return _Warm(drafter, full, warm.rollouts[-cfg["online_buffer"]:], base, pool, chain, tree,
               lengths.tolist(), coverage, log, rows)


def _speedup(model, w: _Warm, sampler, stops, cfg, step_s, seed):
  """Part 3: speculative throughput vs the same engine's vanilla mode at each batch, chain and
  tree, reduced and (batch 1) full draft vocabulary, interleaved best-of-N; ``generate`` is timed
  in the same rounds (the cross-check row). Returns ``(rows, curve)``."""
  from jaxsys.decoding.sampling import SamplingParams
  from jaxsys.serving.generation import generate
  from jaxsys.speculative.engine import RolloutConfig, RolloutEngine
  # One decode loop: the baseline is the engine itself with speculation off (same executables,
  # same cache), sized for the long prompts decoded here (``long_prompt``).
  long = RolloutConfig(**dict(w.base, max_prompt=cfg["long_prompt"], prompt_buckets=()))
  engines = {"reduced": RolloutEngine(model, w.drafter, long, pool=w.pool),
             "full": RolloutEngine(model, w.full, long, pool=w.pool)}
  rows, curve = [], {"batch": []}
  for b in cfg["batches"]:
    prompts = _prompts(sampler, b, np.random.default_rng(reseed(10 + b, seed)), long_only=True)
    runs = [("vanilla", "reduced", None), ("chain", "reduced", w.chain), ("tree", "reduced", w.tree)]
    if b == 1:
      runs += [("chain", "full", w.chain), ("tree", "full", w.tree)]

    def decode(vocab, strat, key):  # vocab None: the decoding core's generate, same prompts
      if vocab is None:
        return generate(model, prompts, max_new_tokens=cfg["max_new"], stop_tokens=stops,
                        sampling=SamplingParams(cfg["temperature"], seed=key))
      return engines[vocab].generate(prompts, seed=key, force_strategy=strat, speculative=strat is not None)

    runs += [("generate", None, None)]
    for _label, vocab, strat in runs:  # compile / warm-up each
      decode(vocab, strat, reseed(0, seed))
    tput, acc = {}, {}
    for rep in range(cfg["repeats"]):  # interleaved best-of-N
      for label, vocab, strat in runs:
        t0 = time.perf_counter()
        r = decode(vocab, strat, reseed(1 + rep, seed))
        key = label if strat is None else f"{label}/{vocab}"
        tput[key] = max(tput.get(key, 0.0), sum(len(t) for t in r.tokens) / (time.perf_counter() - t0))
        if strat is not None:
          acc[key] = r.stats["mean_accepted"] + 1
    curve["batch"].append(b)
    for key, v in tput.items():
      curve.setdefault(key, []).append(v)
      if key in ("vanilla", "generate"):
        continue
      rows.append(Row(metric=f"{key} vocab decode throughput @ batch {b}",
                      unit="tokens/s (ratio = ours/baseline)", baseline=tput["vanilla"],
                      baseline_name="vanilla (same engine)", ours=v, ratio=v / tput["vanilla"],
                      goal=">= 2.2" if b == 1 else None,
                      note=f"accepted length {acc[key]:.2f} tokens/round; generate "
                           f"{tput['generate']:.1f} tokens/s in the same rounds"))
    rows.append(Row(metric=f"vanilla engine vs decoding core generate @ batch {b}", unit="tokens/s",
                    baseline=tput["generate"], baseline_name="generate (same prompts and rounds)",
                    ours=tput["vanilla"], ratio=tput["vanilla"] / tput["generate"],
                    note="the speedup rows' baseline beside the decoding core's own loop; both include "
                         "their prefill" + ("" if step_s is None or b != 1 else
                                            f"; generate's per-step figure: {1.0 / step_s:.1f} tokens/s")))
    print(f"[tlt/smollm2] batch {b}: tokens/s {tput} accepted {acc}", flush=True)
  return rows, curve


def _lossless(model, w: _Warm, sampler, stops, cfg, seed) -> list[Row]:
  """Part 4: greedy speculative (chain and tree) == the decoding core's greedy generate."""
  from jaxsys.decoding.sampling import GREEDY
  from jaxsys.serving.generation import generate
  from jaxsys.speculative.engine import RolloutConfig, RolloutEngine
  lp = _prompts(sampler, cfg["n_lossless"], np.random.default_rng(reseed(5, seed)))
  ref = generate(model, lp, max_new_tokens=cfg["lossless_new"], stop_tokens=stops).tokens
  gbase = dict(w.base, sampling=GREEDY, max_new=cfg["lossless_new"], batch_buckets=(cfg["n_lossless"],))
  eng = RolloutEngine(model, w.drafter, RolloutConfig(**gbase), pool=w.pool)
  same = sum(g == r for s in (w.chain, w.tree) for g, r in zip(eng.generate(lp, force_strategy=s).tokens, ref))
  return [Row(metric="greedy speculative == vanilla (SmolLM2, token for token)", unit="prompts",
              ours=float(same), baseline=float(2 * len(lp)), baseline_name="prompts x 2 runs",
              ratio=same / (2 * len(lp)), goal=">= 1.0",
              note=f"chain and tree, reduced draft vocabulary, {cfg['lossless_new']} new tokens")]


def _grpo(model, sampler, drafter0, warm_results, base, pool, cfg, step_s, out, seed: int = 0):
  """GRPO on the chat tasks, TLT vs the vanilla rollout (``experiments._tlt_grpo``), with the
  warmed-up drafter; the online buffer starts from the last warm-up rollouts. ``seed``: the run's
  ``--seed``."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  from experiments import _tlt_grpo
  from jaxsys.rl import grpo
  from jaxsys.rl.tlt import TLTConfig, make_tlt_trainer
  from jaxsys.speculative.bandit import Strategy
  from jaxsys.speculative.engine import RolloutConfig

  n = cfg["prompts_per_step"] * cfg["group_size"]
  buckets = tuple(sorted(set(cfg["batches"]) | {n}))
  rollout = RolloutConfig(**dict(base, batch_buckets=buckets))
  # lr 1e-6 and no KL term (no reference forward): a pretrained chat model fine-tuned with
  # GRPO moves in small steps; the comparison is of time per step at equal learning. GRPO's seed
  # is the run's seed itself, not reseed(0, seed): the trainer seeds rollout i with
  # grpo.seed * 100003 + i, a uint32, which a reseeded value would overflow.
  tlt_cfg = TLTConfig(grpo=grpo.GRPOConfig(group_size=cfg["group_size"],
                                           prompts_per_step=cfg["prompts_per_step"],
                                           lr=cfg["grpo_lr"], kl_coef=0.0,
                                           length_bucket=cfg["length_bucket"], seed=seed,
                                           # two policies with Adam in 24 GB: recompute the
                                           # blocks' activations in the backward pass, and
                                           # update on 4 responses at a time
                                           remat=True, minibatches=4),
                      online_buffer=cfg["online_buffer"], drafter_lr=cfg["online_lr"],
                      drafter_batch=8, spot_steps=cfg["spot_steps"], synchronous=True,
                      buffer_seed=reseed(1, seed))  # TLTConfig's default (1), moved by the run's

  def make_tlt(speculative: bool):
    return make_tlt_trainer(model, drafter0, sampler, rollout, tlt_cfg, speculative=speculative,
                            warm_rollouts=warm_results, pool=pool, reward_fn=sampler.reward_fn,
                            pad_id=sampler.pad_id)

  eval_prompts = _prompts(sampler, cfg["n_eval"], np.random.default_rng(reseed(9, seed)), long_only=True)
  hist = _tlt_grpo.compare(make_tlt, model, drafter0, RolloutConfig(**base), eval_prompts,
                           Strategy(*cfg["chain"]), pool, cfg["grpo_steps"], tag="tlt/smollm2", seed=seed)
  rows, summary = _tlt_grpo.rows(hist, cfg["spot_steps"], None if step_s is None else 1e3 * step_s,
                                 label=" (SmolLM2)")
  fig, ax = plt.subplots(1, 2, figsize=(10, 4))
  _tlt_grpo.plot_rewards(ax[0], hist)
  steps = np.arange(1, len(hist["tlt"]) + 1)
  ax[1].plot(steps, hist["acc_frozen"], "o-", label="drafter trained once")
  ax[1].plot(steps, hist["acc_online"], "s--", label="online drafter")
  ax[1].set(xlabel="GRPO step", ylabel="tokens per round (chain)", title="acceptance on the drifting policy")
  for a in ax:
    a.legend()
  fig.tight_layout()
  fig.savefig(out / "tlt_smollm2_grpo.png", dpi=100)
  plt.close(fig)
  return rows, hist, summary
