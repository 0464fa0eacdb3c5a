"""Lookup drafting on SmolLM2 rollouts (part ``lookup`` of ``python -m experiments.tlt``).

Drafts need no drafter model: ``Strategy.lookup_chain`` copies a chain from the row's own history
(prompt and response so far) and, given ``references``, from its GRPO siblings, the other sampled
responses to the same prompt (``jaxsys.speculative.lookup``). Measured at batch 1, 2, 4 and 8 on
the long-tail prompts of the speedup rows (count / repeat 24-48 items, T = 0.7, 160 new tokens):

* decode throughput, i.e. generated tokens after the first over decode seconds (the prefill timed
  apart: ``RolloutEngine`` reports ``prefill_seconds``, ``generate`` its own), summed over
  ``lookup_sets`` prompt sets x ``repeats`` seeds, of the engine's vanilla mode, the decoding
  core's ``generate``, lookup over the row's own history, and lookup with 3 sibling responses
  (sampled first with ``generate``) as references; the ratio is against the engine's vanilla mode
  (the same engine, its decode state sized for these prompts, ``long_prompt``), with ``generate``
  beside it as a cross-check.
  Sampled responses differ in length between methods: sums over several sets and seeds, not
  best-of-N of one response, keep the comparison about the same distribution of text;
* tokens per round (accepted + 1) and the share of rounds with no match (run as a vanilla step);
* greedy lookup == ``generate`` token for token on 8 prompts.

``run(model, sampler, stops, cfg, prompts_fn, out=None, seed=0)`` and ``grpo(..., seed=0)``:
``seed`` (the experiment's ``--seed``) moves the prompt sets and sampling keys (seed 0: the default
table).
"""

from __future__ import annotations

import time

import numpy as np

from experiments._cli import reseed
from jaxsys.core.results import Row


def run(model, sampler, stops, cfg, prompts_fn, out=None, seed: int = 0) -> tuple[list[Row], dict]:
  """Rows and a curve (tokens/s per method vs batch, plotted to ``out/tlt_lookup.png`` when
  ``out`` is given); ``prompts_fn(n, rng)`` gives long-tail prompts
  (``_tlt_smollm2._prompts(..., long_only=True)``). ``seed``: the run's ``--seed``."""
  from jaxsys.decoding.sampling import GREEDY, SamplingParams
  from jaxsys.serving.generation import generate
  from jaxsys.speculative.bandit import Strategy
  from jaxsys.speculative.engine import RolloutConfig, RolloutEngine

  look = Strategy.lookup_chain(cfg["lookup_depth"], cfg["lookup_ngram"])
  # seed=: the bandit's, as in every engine of the experiment (every run here forces its strategy)
  base = dict(strategies=(look,), max_new=cfg["max_new"], max_prompt=cfg["long_prompt"],
              stop_tokens=stops, batch_buckets=cfg["batches"],
              lookup_ref=cfg["lookup_ref"], seed=reseed(0, seed))
  eng = RolloutEngine(model, None, RolloutConfig(**base, sampling=SamplingParams(cfg["temperature"])))
  samp = lambda key: SamplingParams(cfg["temperature"], seed=reseed(key, seed))  # noqa: E731
  rows, curve = [], {"batch": []}
  for b in cfg["batches"]:
    tot: dict[str, list[float]] = {}
    t0 = time.perf_counter()
    for k in range(cfg["lookup_sets"]):
      prompts = prompts_fn(b, np.random.default_rng(reseed(1000 * b + k, seed)))
      g = cfg["group_size"] - 1  # the other responses of a GRPO group, sampled first
      sib = generate(model, [p for p in prompts for _ in range(g)], max_new_tokens=cfg["max_new"],
                     stop_tokens=stops, sampling=samp(500 + k))
      refs = [[np.asarray(t) for t in sib.tokens[i * g:(i + 1) * g]] for i in range(b)]
      runs = {"engine vanilla": dict(speculative=False), "lookup, own history": dict(force_strategy=look),
              "lookup + 3 siblings": dict(force_strategy=look, references=refs)}
      if k == 0:  # compile
        for kw in runs.values():
          eng.generate(prompts, seed=reseed(0, seed), **kw)
        generate(model, prompts, max_new_tokens=cfg["max_new"], stop_tokens=stops, sampling=samp(0))
      for rep in range(cfg["repeats"]):
        for name, kw in list(runs.items()) + [("generate", None)]:
          t = tot.setdefault(name, [0.0, 0.0, 0.0, 0.0, 0.0])  # tokens, seconds, acc x rounds, rounds, plain
          if kw is None:
            r = generate(model, prompts, max_new_tokens=cfg["max_new"], stop_tokens=stops,
                         sampling=samp(1 + rep + 10 * k))
            t[0] += sum(len(x) - 1 for x in r.tokens)
            t[1] += r.decode_seconds
            continue
          r = eng.generate(prompts, seed=reseed(1 + rep + 10 * k, seed), **kw)
          t[0] += sum(len(x) - 1 for x in r.tokens)
          t[1] += r.stats["seconds"]
          if "force_strategy" in kw:
            t[2] += (r.stats["mean_accepted"] + 1) * r.stats["spec_steps"]
            t[3] += r.stats["spec_steps"]
            t[4] += r.stats.get("lookup_plain_rounds", 0)
    tput = {k: v[0] / v[1] for k, v in tot.items()}
    curve["batch"].append(b)
    for key, v in tput.items():
      curve.setdefault(key, []).append(v)
    for key in ("lookup, own history", "lookup + 3 siblings"):
      t = tot[key]
      rows.append(Row(metric=f"{key} ({look.name}) decode throughput @ batch {b}",
                      unit="tokens/s (ratio = ours/baseline)", baseline=tput["engine vanilla"],
                      baseline_name="vanilla (same engine)", ours=tput[key],
                      ratio=tput[key] / tput["engine vanilla"],
                      goal=">= 2.2" if b == 1 else None,
                      note=f"{t[2] / max(t[3], 1):.2f} tokens/round, {t[4] / max(t[3], 1):.0%} of rounds "
                           f"without a match (a vanilla step); engine vanilla {tput['engine vanilla']:.1f}, "
                           f"generate {tput['generate']:.1f} tokens/s; {int(t[0])} tokens over "
                           f"{cfg['lookup_sets']} prompt sets x {cfg['repeats']} seeds"))
    print(f"[tlt/smollm2] lookup @ batch {b}: tokens/s {tput} ({time.perf_counter() - t0:.0f}s)", flush=True)

  if out is not None:
    _plot(curve, out / "tlt_lookup.png")

  # Greedy losslessness: lookup drafting never changes what is emitted.
  lp = prompts_fn(cfg["n_lossless"], np.random.default_rng(reseed(5, seed)))
  ref = generate(model, lp, max_new_tokens=cfg["lossless_new"], stop_tokens=stops).tokens
  geng = RolloutEngine(model, None, RolloutConfig(**dict(base, max_new=cfg["lossless_new"],
                                                         batch_buckets=(cfg["n_lossless"],)),
                                                  sampling=GREEDY))
  got = geng.generate(lp, force_strategy=look)
  same = sum(g == r for g, r in zip(got.tokens, ref))
  rows.append(Row(metric="greedy lookup decoding == vanilla (SmolLM2, token for token)", unit="prompts",
                  ours=float(same), baseline=float(len(lp)), baseline_name="prompts", ratio=same / len(lp),
                  goal=">= 1.0", note=f"{cfg['lossless_new']} new tokens, {got.stats['mean_accepted'] + 1:.2f} "
                                     "tokens/round"))
  return rows, curve


def _plot(curve, path):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(5.5, 4))
  for key, style in (("generate", "o-"), ("engine vanilla", "s-"), ("lookup, own history", "^--"),
                     ("lookup + 3 siblings", "v--")):
    ax.plot(curve["batch"], curve[key], style, label=key)
  ax.set_xscale("log", base=2)
  ax.set_xlabel("batch (running rollouts)")
  ax.set_ylabel("decode tokens/s")
  ax.set_title("SmolLM2-135M, T=0.7: lookup drafting vs vanilla")
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def grpo(model, tok, stops, cfg, out=None, seed: int = 0) -> tuple[list[Row], dict]:
  """GRPO with lookup drafting in the long tail vs the vanilla rollout, interleaved, same seeds
  (part ``grpo_lookup``). The task mix has the heavier tail the regime row asks for when the
  rollout share ``f`` is below 0.55: sizes up to ``heavy_items[1]`` and ``heavy_max_new`` new
  tokens (the ``grpo`` part: 48 and 160, f = 0.49). No drafter model: the two runs differ only in
  the long tail's decoding (``speculative`` off / on, one lookup strategy, siblings as references).
  On a 24 GB host start it with ``MALLOC_ARENA_MAX=2 MALLOC_MMAP_THRESHOLD_=131072``: measured so,
  it peaked at 12.2 GB; without the mmap threshold it passed 21.5 GB in its second step.
  ``seed``: the run's ``--seed`` (the task sampler, the bandit, GRPO's sampling and minibatches).
  """
  from flax import nnx

  from experiments import _tlt_grpo
  from jaxsys.core.bench import watch_compiles
  from jaxsys.decoding.sampling import SamplingParams
  from jaxsys.rl import grpo as grpo_lib
  from jaxsys.rl.chat_tasks import ChatTaskSampler
  from jaxsys.speculative.bandit import Strategy
  from jaxsys.speculative.engine import RolloutConfig, RolloutEngine
  from jaxsys.speculative.pool import ExecutablePool

  sampler = ChatTaskSampler(tok, items=tuple(cfg["heavy_items"]), seed=reseed(0, seed))
  pool = ExecutablePool(max_entries=256)  # both engines share every executable but the tail loop
  look = Strategy.lookup_chain(cfg["lookup_depth"], cfg["lookup_ngram"])
  n = cfg["prompts_per_step"] * cfg["group_size"]
  rcfg = dict(strategies=(look,), max_new=cfg["heavy_max_new"], max_prompt=sampler.max_prompt,
              stop_tokens=stops, batch_buckets=tuple(sorted(set(cfg["batches"]) | {n})),
              spec_threshold=8, sampling=SamplingParams(cfg["temperature"]),
              lookup_ref=cfg["lookup_ref"], seed=reseed(0, seed))
  # GRPO's seed is the run's seed itself, not reseed(0, seed): the trainer seeds rollout i with
  # grpo.seed * 100003 + i, a uint32, which a reseeded value would overflow.
  gcfg = grpo_lib.GRPOConfig(group_size=cfg["group_size"], prompts_per_step=cfg["prompts_per_step"],
                             lr=cfg["grpo_lr"], kl_coef=0.0, length_bucket=cfg["length_bucket"],
                             seed=seed, remat=True, minibatches=4)
  trainers = {}
  for name, spec in (("vanilla", False), ("lookup", True)):
    policy = nnx.merge(*nnx.split(model))  # each run its own copy, same initial weights
    eng = RolloutEngine(policy, None, RolloutConfig(**rcfg, speculative=spec), pool=pool)
    eng.precompile()
    tr = grpo_lib.GRPOTrainer(policy, eng, sampler, gcfg, reward_fn=sampler.reward_fn,
                              pad_id=sampler.pad_id)
    tr.precompile()
    trainers[name] = tr
  watch_compiles()

  def log(step, hist):
    v, t = hist["vanilla"][-1], hist["lookup"][-1]
    print(f"[tlt/smollm2] grpo_lookup step {step}: vanilla {v['step_seconds']:.1f}s (rollout "
          f"{v['rollout_seconds']:.1f}, len {v['len_mean']:.0f}/{v['len_max']}) reward "
          f"{v['reward_mean']:.3f} | lookup {t['step_seconds']:.1f}s (rollout {t['rollout_seconds']:.1f}, "
          f"len {t['len_mean']:.0f}/{t['len_max']}, {t['mean_accepted'] + 1:.2f} tokens/round) reward "
          f"{t['reward_mean']:.3f} | compiles {v['compilations']}/{t['compilations']}", flush=True)

  hist = _tlt_grpo.interleave(trainers, cfg["lookup_grpo_steps"], log)
  skip = 1 if len(hist["vanilla"]) > 1 else 0
  mean = lambda run, key: float(np.mean([m[key] for m in hist[run][skip:]]))  # noqa: E731
  v_step, t_step = mean("vanilla", "step_seconds"), mean("lookup", "step_seconds")
  v_roll, t_roll = mean("vanilla", "rollout_seconds"), mean("lookup", "rollout_seconds")
  frac = v_roll / v_step
  late = sum(m["compilations"] for k in hist for m in hist[k][skip:])
  steps = f"steps {skip + 1}-{len(hist['vanilla'])}"
  mix = f"items {tuple(cfg['heavy_items'])}, max_new {cfg['heavy_max_new']}"
  rows = [
      Row(metric="GRPO step time, lookup-drafted long tail (SmolLM2, heavier tail)", unit="s",
          baseline=v_step, baseline_name="vanilla rollout", ours=t_step, goal=">= 1.5",
          ideal=1.0 / max(1.0 - frac, 1e-9),
          note=f"mean of {steps}; {mix}; ideal = 1/(1-f); {late} compilations in those steps"),
      Row(metric="GRPO rollout time, lookup-drafted long tail (SmolLM2, heavier tail)", unit="s",
          baseline=v_roll, baseline_name="vanilla rollout", ours=t_roll,
          note=f"{mean('lookup', 'mean_accepted') + 1:.2f} tokens per round in the tail; "
               f"response length mean {mean('vanilla', 'len_mean'):.0f}, longest "
               f"{mean('vanilla', 'len_max'):.0f} (vanilla run)"),
      Row(metric="regime: vanilla rollout share f of the GRPO step (heavier tail)", unit="f",
          ours=frac, goal=">= 0.55", ideal=1.0 / max(1.0 - frac, 1e-9),
          note=f"{mix}; update {mean('vanilla', 'train_seconds'):.1f}s for "
               f"{mean('vanilla', 'train_tokens'):.0f} tokens; ideal = Amdahl bound 1/(1-f)"),
      Row(metric="GRPO mean reward, last 2 steps (heavier tail)", unit="reward",
          baseline=float(np.mean([m["reward_mean"] for m in hist["vanilla"][-2:]])),
          baseline_name="vanilla rollout",
          ours=float(np.mean([m["reward_mean"] for m in hist["lookup"][-2:]]))),
  ]
  if out is not None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(1, 2, figsize=(10, 4))
    _tlt_grpo.plot_rewards(ax[0], hist, ours="lookup", label="lookup-drafted tail",
                           title="rewards (same seeds)")
    _tlt_grpo.plot_rewards(ax[1], hist, "step_seconds", ours="lookup", label="lookup-drafted tail",
                           ylabel="step seconds", title="step time (step 1 compiles)")
    for a in ax:
      a.legend()
    fig.tight_layout()
    fig.savefig(out / "tlt_lookup_grpo.png", dpi=100)
    plt.close(fig)
  return rows, hist
