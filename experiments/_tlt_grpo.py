"""TLT vs vanilla GRPO, interleaved in one process: the comparison both TLT modes run.

``compare`` builds the two pipelines (``make_tlt(speculative) -> jaxsys.rl.tlt.TLT``, i.e.
``make_tlt_trainer`` with the experiment's settings), compiles every rollout executable and every
update width before step 1 (``TLT.precompile``), then runs ``steps`` GRPO steps of each, alternating (same machine
load), and after each step measures the accepted length of a drafter trained once (``drafter0``)
and of the online one on the current TLT policy (``eval_prompts``, ``strategy`` forced). Compiles
inside each timed step are counted (``jaxsys.core.bench.compile_count``).

``seed`` (the run's ``--seed``) moves the sampling keys of those accepted-length rollouts.

``rows`` turns the history into the experiment's rows (steps 2+; the first compiles small eager
ops): step / rollout / update time, step time with the drafter's updates added (a host with no
idle resources), the final reward of both runs and the accepted length, online vs frozen. The
step row's ``ideal`` is the Amdahl bound ``1 / (1 - f)`` of a free rollout, ``f`` the vanilla
rollout's share of the step. The drafter's update time is set against the rollout's idle slots
(the idle share of its row-steps, ``1 - mean / longest response length``, times its time).
``plot_rewards`` overlays the two reward curves.
"""

from __future__ import annotations

import numpy as np

from experiments._cli import reseed
from jaxsys.core.results import Row

__all__ = ["compare", "interleave", "plot_rewards", "rows"]


def interleave(runs: dict, steps: int, after_step=None) -> dict:
  """``steps`` GRPO steps of every trainer in ``runs`` (name -> object with ``step()``), one of
  each in turn (same machine load), compiles inside each step counted. ``after_step(step, hist)``
  runs after each round. Returns ``{name: [step metrics]}``."""
  from jaxsys.core.bench import compile_count
  hist = {name: [] for name in runs}
  for step in range(steps):
    for name, tr in runs.items():
      n0 = compile_count()
      m = tr.step()
      m.pop("responses")
      m["compilations"] = compile_count() - n0
      hist[name].append(m)
    if after_step is not None:
      after_step(step, hist)
  return hist


def compare(make_tlt, policy, drafter0, rollout_cfg, eval_prompts, strategy, pool, steps: int,
            tag: str = "tlt", seed: int = 0) -> dict:
  """Runs the interleaved comparison; returns ``{"tlt": [...], "vanilla": [...], "acc_frozen":
  [...], "acc_online": [...]}`` (per-step metrics of ``GRPOTrainer.step`` and accepted lengths).
  ``seed``: the run's ``--seed`` (the accepted-length rollouts' sampling keys)."""
  from jaxsys.core.bench import watch_compiles
  from jaxsys.speculative.engine import RolloutEngine

  tlt, van = make_tlt(True), make_tlt(False)
  # Every executable either rollout can need (all buckets, every shrink, both long-tail loops)
  # and the update at every minibatch width, before step 1: no timed step may compile.
  tlt.precompile()
  van.precompile()
  watch_compiles()
  frozen_eval = RolloutEngine(policy, drafter0, rollout_cfg, pool=pool)
  online_eval = RolloutEngine(policy, drafter0, rollout_cfg, pool=pool)
  acc = {"acc_frozen": [], "acc_online": []}

  def after_step(step, hist):
    frozen_eval.set_weights(tlt.trainer.policy)
    online_eval.set_weights(tlt.trainer.policy)
    online_eval.set_drafter(tlt.engine.dstate)
    for key, eng in (("acc_frozen", frozen_eval), ("acc_online", online_eval)):
      r = eng.generate(eval_prompts, seed=reseed(step, seed), force_strategy=strategy)
      acc[key].append(r.stats["mean_accepted"] + 1)
    v, t = hist["vanilla"][-1], hist["tlt"][-1]
    print(f"[{tag}] grpo step {step}: vanilla {v['step_seconds']:.2f}s (cpu {v['step_cpu_seconds']:.2f}, "
          f"rollout {v['rollout_seconds']:.2f}) reward {v['reward_mean']:.3f} len {v['len_mean']:.1f}/"
          f"{v['len_max']} | tlt {t['step_seconds']:.2f}s (cpu {t['step_cpu_seconds']:.2f}, rollout "
          f"{t['rollout_seconds']:.2f}) reward {t['reward_mean']:.3f} acc {t['mean_accepted']:.2f} "
          f"spec rounds {t['spec_steps']} drafter {t['drafter_seconds']:.2f}s | compiles "
          f"{v['compilations']}/{t['compilations']} | eval acc frozen {acc['acc_frozen'][-1]:.2f} "
          f"online {acc['acc_online'][-1]:.2f}", flush=True)

  return dict(interleave({"vanilla": van, "tlt": tlt}, steps, after_step), **acc)


def _mean(hist, run: str, key: str, skip: int) -> float:
  return float(np.mean([m[key] for m in hist[run][skip:]]))


def rows(hist: dict, spot_steps: int, decode_step_ms: float | None = None,
         label: str = "") -> tuple[list[Row], dict]:
  """The GRPO rows (``label`` is appended to each metric) and a summary dict."""
  skip = 1 if len(hist["tlt"]) > 1 else 0  # step 1 compiles the policy update and log-prob jits
  v_step, t_step = _mean(hist, "vanilla", "step_seconds", skip), _mean(hist, "tlt", "step_seconds", skip)
  v_roll, t_roll = _mean(hist, "vanilla", "rollout_seconds", skip), _mean(hist, "tlt", "rollout_seconds", skip)
  v_cpu, t_cpu = _mean(hist, "vanilla", "step_cpu_seconds", skip), _mean(hist, "tlt", "step_cpu_seconds", skip)
  v_train, t_train = _mean(hist, "vanilla", "train_seconds", skip), _mean(hist, "tlt", "train_seconds", skip)
  t_dr = _mean(hist, "tlt", "drafter_seconds", skip)
  # Idle share of the vanilla rollout: the row-steps of finished responses while the longest one
  # decodes, 1 - mean length / longest (per step); TLT trains the drafter on those slots.
  idle = float(np.mean([1.0 - m["len_mean"] / max(m["len_max"], 1) for m in hist["vanilla"][skip:]]))
  late = sum(m["compilations"] for k in ("tlt", "vanilla") for m in hist[k][skip:])
  # Amdahl: speculation only shortens the rollout. With the vanilla rollout a fraction f of the
  # step, no rollout speedup can make the step more than 1/(1-f) faster ("ideal" below).
  frac = v_roll / v_step
  train_tokens = _mean(hist, "vanilla", "train_tokens", skip)
  train_us = 1e6 * v_train / train_tokens
  update_note = f"{train_tokens:.0f} tokens/step ({train_us:.0f} us/token)"
  if decode_step_ms is not None:
    update_note += (f"; decode step @ batch 1 {decode_step_ms:.2f} ms = "
                    f"{1e3 * decode_step_ms / train_us:.1f} update tokens")
  v_final = float(np.mean([m["reward_mean"] for m in hist["vanilla"][-2:]]))
  t_final = float(np.mean([m["reward_mean"] for m in hist["tlt"][-2:]]))
  out = [
      Row(metric=f"GRPO step time (long-tail lengths){label}", unit="s", baseline=v_step,
          baseline_name="vanilla rollout", ours=t_step, goal=">= 1.5", ideal=1.0 / max(1.0 - frac, 1e-9),
          note=f"mean of steps {skip + 1}-{len(hist['tlt'])}; ideal = Amdahl bound 1/(1-f), vanilla "
               f"rollout fraction f = {frac:.2f}; {late} compilations in those steps"),
      Row(metric=f"GRPO rollout time{label}", unit="s", baseline=v_roll, baseline_name="vanilla rollout",
          ours=t_roll),
      Row(metric=f"GRPO policy update time (length-grouped minibatches){label}", unit="s",
          baseline=v_train, baseline_name="vanilla-run update", ours=t_train, note=update_note),
      Row(metric=f"GRPO step CPU time (excl. drafter training){label}", unit="s",
          baseline=v_cpu, baseline_name="vanilla rollout", ours=t_cpu),
      Row(metric=f"GRPO step time incl. drafter training (no spare resources){label}", unit="s",
          baseline=v_step, baseline_name="vanilla rollout", ours=t_step + t_dr,
          note=f"drafter training {t_dr:.2f}s/step ({spot_steps} updates between rollouts)"),
      Row(metric=f"drafter training vs the rollout's idle slots{label}", unit="s",
          baseline=idle * v_roll, baseline_name="idle share x vanilla rollout", ours=t_dr,
          ratio=idle * v_roll / t_dr if t_dr else None,
          note=f"idle share {idle:.2f} = 1 - mean/longest response length; ratio >= 1: the "
               "drafter's updates fit in the slots the long tail leaves idle"),
      Row(metric=f"final reward (mean of last 2 steps){label}", unit="reward (ratio = ours/baseline)",
          baseline=v_final, baseline_name="vanilla", ours=t_final,
          ratio=t_final / v_final if v_final else None),
      Row(metric=f"accepted length on the drifted policy (last step){label}", unit="tokens/step",
          baseline=hist["acc_frozen"][-1], baseline_name="drafter trained once",
          ours=hist["acc_online"][-1], ratio=hist["acc_online"][-1] / hist["acc_frozen"][-1]),
  ]
  summary = dict(step_vanilla=v_step, step_tlt=t_step, rollout_fraction=frac, amdahl=1 / max(1 - frac, 1e-9),
                 idle_share=idle,
                 drafter_seconds=t_dr, compilations_in_steps_2plus=late)
  return out, summary


def plot_rewards(ax, hist: dict, key: str = "reward_mean", ours: str = "tlt",
                 label: str = "TLT rollout", ylabel: str = "mean reward",
                 title: str = "learning is unchanged") -> None:
  """``key`` (default the mean reward) per GRPO step of the vanilla run and ``ours``, overlaid."""
  steps = np.arange(1, len(hist[ours]) + 1)
  ax.plot(steps, [m[key] for m in hist["vanilla"]], "o-", label="vanilla rollout")
  ax.plot(steps, [m[key] for m in hist[ours]], "s--", label=label)
  ax.set(xlabel="GRPO step", ylabel=ylabel, title=title)
