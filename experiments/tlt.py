"""TLT: speculative decoding in RL rollouts (adaptive drafter + adaptive rollout engine).

Measures, on CPU with the shipped tiny trained LM (``jaxsys.models.load_tiny_lm``) as the RL
policy and target, on prompts of ``jaxsys.data.synthetic`` (``jaxsys.rl.tasks.LongTailMix``:
mostly short recall/arith answers, ``long_fraction`` copy prompts of 40+ tokens; reward
``synthetic.reward``):

1. mean accepted length and decode speedup vs batch size (1..32; quick: batch 1) for a chain and a tree strategy
   on long copy prompts (sampled at the GRPO temperature);
2. acceptance of a drafter trained once vs one trained online while GRPO moves the policy;
3. end-to-end GRPO step time with the long-tailed response length: TLT engine vs the same engine
   without speculation, same seeds, interleaved in one process; reward curves overlaid.

Both engines run the rollout engine's on-device phases (``jaxsys.speculative.fused``): vanilla decoding of the full batch is
one on-device while_loop until fewer than ``spec_threshold`` rows run; the batch then shrinks
and the long tail is one while_loop too, speculative (TLT; its bandit may also pick plain
decoding, ``vanilla_arm``) or vanilla (baseline). Steps 2+ are compared (every rollout
executable and every minibatch width of the update is compiled before step 1, which still
compiles a few small eager ops; compilations per step are counted). The step row's ``ideal`` is the Amdahl bound ``1/(1-f)`` of a free
rollout, ``f`` = the vanilla rollout's share of the step. The TLT drafter gets ``spot_steps`` updates between
rollouts, timed apart ("drafter training time"): TLT runs them on resources the long tail leaves
idle, which a 2-core CPU host does not have, so the step time is also given with them added.

Run: ``python -m experiments.tlt --quick``. ``run(quick, out_dir, parts=None, seed=0)``: ``--seed S``
draws other prompts, drafter initialisation, rollouts, buffer samples and GRPO seeds in both modes
(seed 0: the default table); the policies (the tiny LM, SmolLM2) are fixed checkpoints.

Full mode (``python -m experiments.tlt``) runs the TLT decode measurements on SmolLM2-135M-Instruct
(``experiments/_tlt_smollm2.py``): the regime row, then speculative decode speedup at batch 1-8,
chain and tree, full vs reduced draft vocabulary, greedy losslessness, and GRPO (TLT vs vanilla
rollout, online vs frozen drafter); ``--parts`` runs some of them.
"""

from __future__ import annotations

import time

import numpy as np

from experiments import _tlt_grpo, _tlt_smollm2
from experiments._cli import reseed, with_compute_dtype
from jaxsys.core.results import Row, run_dir, write_result

NAME = "tlt"
PARTS = _tlt_smollm2.PARTS  # --parts: the full (SmolLM2) mode's parts


def run_smollm2(out_dir: str, parts=None, seed: int = 0, dtype: str = "float32") -> list[Row]:
  return _tlt_smollm2.run(out_dir, parts, seed=seed, dtype=dtype)


def _config(quick: bool) -> dict:
  return dict(
      # The warm-up data must be large enough for the drafter to learn *copying*, not the
      # sequences: on 2 rollouts x 32 prompts (~32 copy responses) 100 steps reach top-1 0.85 on
      # the training data but 0.11 on fresh rollouts (memorised), and speculation accepts ~0.1
      # tokens/round. 8 rollouts and 400 steps: ~0.66 on held-out rollouts.
      drafter_warm_steps=400 if quick else 1000,
      drafter_warm_rollouts=8,
      repeats=3 if quick else 5,  # best-of-N timings
      batches=(1, 8, 32) if quick else (1, 2, 4, 8, 16, 32),  # buckets (GRPO's 32 prompts: 32)
      # the batch sizes timed in part 1; quick times batch 1 alone (the sweep's rows carry no goal;
      # batch 8's chain and tree programs were ~15 s of the quick run)
      sweep=(1,) if quick else (1, 2, 4, 8, 16, 32),
      long_copy=(40, 60) if quick else (40, 100),
      chain=(4, 1, 5), tree=(4, 2, 5),  # same verify_tokens: shared tree sizes
      grpo_steps=4 if quick else 10,
      prompts_per_step=8, group_size=4,
      long_fraction=0.15,
      spot_steps=15 if quick else 40,
      online_buffer=6, online_lr=5e-4,
      spec_threshold=8,
      temperature=1.0,
  )


def run(quick: bool, out_dir: str, parts=None, seed: int = 0, dtype: str = "float32") -> list[Row]:
  """``parts`` (full mode only): names from ``_tlt_smollm2.PARTS`` to run alone. ``seed``: the
  run's ``--seed`` (both modes). ``dtype``: the policy's compute dtype (``--dtype``, both modes;
  the drafter follows the policy's config)."""
  if not quick:
    return run_smollm2(out_dir, parts, seed=seed, dtype=dtype)
  if parts:
    raise ValueError(f"parts={list(parts)}: --parts selects parts of the full (SmolLM2) mode; "
                     "--quick runs the whole tiny-LM pipeline")
  return run_tiny(quick, out_dir, seed=seed, dtype=dtype)


def run_tiny(quick: bool, out_dir: str, seed: int = 0, dtype: str = "float32") -> list[Row]:
  """The tiny trained LM as policy (the whole pipeline, GRPO included; see the module docstring).
  ``seed``: the run's ``--seed``; the policy is the shipped checkpoint whatever it is."""
  from flax import nnx

  from jaxsys.data import synthetic
  from jaxsys.models import load_tiny_lm
  from jaxsys.models.llm.drafter import DrafterConfig, EagleDrafter
  from jaxsys.rl import grpo, tasks
  from jaxsys.rl.tlt import TLTConfig, make_tlt_trainer, warm_up_drafter
  from jaxsys.speculative import online
  from jaxsys.speculative.bandit import Strategy
  from jaxsys.speculative.engine import RolloutConfig, RolloutEngine
  from jaxsys.speculative.pool import ExecutablePool
  from jaxsys.decoding.sampling import SamplingParams

  cfg = _config(quick)
  out = run_dir(NAME, out_dir)
  t_start = time.perf_counter()
  log = {}

  # ---- policy and initial drafter --------------------------------------------------------
  policy = with_compute_dtype(load_tiny_lm(), dtype)
  mix = dict(long_copy=cfg["long_copy"])
  long_sampler = tasks.LongTailMix(long_fraction=1.0, seed=reseed(5, seed), **mix)
  chain, tree = Strategy(*cfg["chain"]), Strategy(*cfg["tree"])
  # One sampling config and one executable pool for every engine below: each (loop, bucket)
  # compiles once for the whole experiment.
  base = dict(strategies=(chain, tree), max_new=long_sampler.max_response,
              max_prompt=long_sampler.max_prompt, stop_tokens=(synthetic.VOCAB.eos,),
              batch_buckets=cfg["batches"], spec_threshold=cfg["spec_threshold"],
              sampling=SamplingParams(cfg["temperature"]),
              seed=reseed(0, seed))  # the bandit's exploration
  pool = ExecutablePool(max_entries=256)
  drafter = EagleDrafter(DrafterConfig.for_target(policy.config), rngs=nnx.Rngs(reseed(1, seed)))
  sampler = tasks.LongTailMix(long_fraction=0.5, seed=reseed(11, seed), **mix)
  n_warm = cfg["drafter_warm_rollouts"]
  # Rollouts of the initial policy are the drafter's warm-up data; a held-out rollout (other
  # prompts and seed) measures top-1, since top-1 on the training data alone hides memorisation.
  ho_sampler = tasks.LongTailMix(long_fraction=0.5, seed=reseed(99, seed), **mix)
  warm = warm_up_drafter(policy, drafter, RolloutConfig(**base),
                         [[list(e.prompt) for e in sampler.sample(32)] for _ in range(n_warm)],
                         seeds=[reseed(123 + k, seed) for k in range(n_warm)],
                         steps=cfg["drafter_warm_steps"], lr=3e-3, batch=16,
                         heldout=([list(e.prompt) for e in ho_sampler.sample(32)], reseed(7, seed)),
                         heldout_rows=64, buffer_seed=reseed(0, seed), pool=pool)
  drafter0, warm_rollouts = warm.drafter, warm.rollouts  # drafter0: "trained once"
  log["drafter_warm"] = warm.metrics
  online.save_drafter(out / "drafter_ckpt" / f"warm_{int(time.time())}", drafter0)
  print(f"[tlt] warm-up done in {time.perf_counter() - t_start:.0f}s: {log['drafter_warm']}")

  # ---- 1) acceptance and speedup vs batch size (sampled, long responses) ------------------
  spec_engine = RolloutEngine(policy, drafter0, RolloutConfig(**base), pool=pool)
  rng = np.random.default_rng(reseed(3, seed))
  rows, curve = [], {"batch": [], "chain_acc": [], "tree_acc": [], "chain_speedup": [], "tree_speedup": []}
  for b in cfg["sweep"]:
    prompts = [list(e.prompt) for e in long_sampler.sample(b, rng)]
    tput, acc, cpu = {}, {}, {}
    for name, strat in (("vanilla", None), ("chain", chain), ("tree", tree)):
      kw = dict(force_strategy=strat, speculative=strat is not None)
      spec_engine.generate(prompts, seed=reseed(0, seed), **kw)  # compile / warm-up
      best, best_cpu = 0.0, 0.0
      for rep in range(cfg["repeats"]):  # best of N: short runs on a shared CPU are noisy
        t0, c0 = time.perf_counter(), time.process_time()
        r = spec_engine.generate(prompts, seed=reseed(1 + rep, seed), **kw)
        n_tok = sum(len(t) for t in r.tokens)
        best = max(best, n_tok / (time.perf_counter() - t0))
        best_cpu = max(best_cpu, n_tok / max(time.process_time() - c0, 1e-9))
      tput[name], acc[name], cpu[name] = best, r.stats["mean_accepted"] + 1, best_cpu
    curve["batch"].append(b)
    curve.setdefault("vanilla_tput", []).append(tput["vanilla"])
    for name in ("chain", "tree"):
      curve[f"{name}_acc"].append(acc[name])  # tokens per verify step (accepted + bonus)
      curve[f"{name}_speedup"].append(tput[name] / tput["vanilla"])
      curve.setdefault(f"{name}_cpu_speedup", []).append(cpu[name] / cpu["vanilla"])
      rows.append(Row(metric=f"{name} decode throughput @ batch {b}", unit="tokens/s (ratio = ours/baseline)",
                      baseline=tput["vanilla"], baseline_name="vanilla sampling", ours=tput[name],
                      ratio=tput[name] / tput["vanilla"],
                      note=f"accepted length {acc[name]:.2f} tokens/step; CPU-time ratio {cpu[name] / cpu['vanilla']:.2f}"))
    print(f"[tlt] batch {b}: tokens/s {tput} accepted chain {acc['chain']:.2f} tree {acc['tree']:.2f}", flush=True)

  # ---- 2 + 3) GRPO: TLT (online drafter) vs vanilla, same seeds; frozen-drafter acceptance --
  # TLT (online drafter, speculative long tail) vs the same pipeline without speculation, both
  # from the same policy and warm drafter (jaxsys.rl.tlt assembles them). The online buffer is
  # seeded with the last warm-up rollouts: a GRPO step has only ~5 long responses, and training
  # on 2 steps' worth alone memorises them (the failure mode of the warm-up above) instead of
  # tracking the policy. The drafter gets spot_steps updates between rollouts, timed apart: on
  # a 2-core host a background thread would race the rollout for the cores (online.SpotTrainer).
  # GRPO's seed is the run's seed itself, not reseed(0, seed): the trainer seeds rollout i with
  # grpo.seed * 100003 + i, a uint32, which a reseeded value would overflow. The online buffer's
  # seed is TLTConfig's default (1), moved by the run's.
  tlt_cfg = TLTConfig(grpo=grpo.GRPOConfig(group_size=cfg["group_size"],
                                           prompts_per_step=cfg["prompts_per_step"], seed=seed),
                      online_buffer=cfg["online_buffer"], drafter_lr=cfg["online_lr"],
                      drafter_batch=16, spot_steps=cfg["spot_steps"], synchronous=True,
                      buffer_seed=reseed(1, seed))
  rollout = RolloutConfig(**base)

  def make_tlt(speculative: bool):
    tsamp = tasks.LongTailMix(long_fraction=cfg["long_fraction"], seed=reseed(7, seed), **mix)
    return make_tlt_trainer(policy, drafter0, tsamp, rollout, tlt_cfg, speculative=speculative,
                            warm_rollouts=warm_rollouts, pool=pool, reward_fn=synthetic.reward,
                            pad_id=synthetic.VOCAB.pad)

  eval_prompts = [list(e.prompt) for e in long_sampler.sample(8, np.random.default_rng(reseed(9, seed)))]
  hist = _tlt_grpo.compare(make_tlt, policy, drafter0, rollout, eval_prompts, chain, pool,
                           cfg["grpo_steps"], seed=seed)
  step_ms_b1 = 1e3 / curve["vanilla_tput"][0] if curve["batch"][0] == 1 else None
  grpo_rows, summary = _tlt_grpo.rows(hist, cfg["spot_steps"], step_ms_b1)
  rows += grpo_rows
  _plots(out, curve, hist)
  config = dict(cfg, policy={k: str(v) for k, v in policy.config.__dict__.items()},
                chain=chain.name, tree=tree.name, compilations=pool.compilations, **summary,
                seconds=time.perf_counter() - t_start, seed=seed, dtype=dtype)
  write_result(NAME, rows, config=config, quick=quick, out_dir=out_dir,
               extra={"curves": curve, "grpo": {k: v for k, v in hist.items()}, "warm": log})
  return rows


def _plots(out, curve, hist):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(1, 3, figsize=(15, 4))
  for name in ("chain", "tree"):
    ax[0].plot(curve["batch"], curve[f"{name}_acc"], "o-", label=name)
    ax[1].plot(curve["batch"], curve[f"{name}_speedup"], "o-", label=name)
  ax[0].set(xscale="log", xlabel="batch", ylabel="tokens per verify step", title="accepted length")
  ax[1].axhline(1.0, color="gray", lw=0.5)
  ax[1].set(xscale="log", xlabel="batch", ylabel="speedup vs vanilla", title="decode speedup")
  _tlt_grpo.plot_rewards(ax[2], hist)
  for a in ax:
    a.legend()
  fig.tight_layout()
  fig.savefig(out / "tlt.png", dpi=100)
  plt.close(fig)


if __name__ == "__main__":
  import sys
  from experiments._cli import main
  sys.exit(main("tlt"))
