"""DATE experiment: dual assignment (one-to-one POTO + one-to-many FCOS) vs one-to-one only.

Command: ``python -m experiments.date [--quick] [--seed S]`` (or ``jaxsys reproduce --only date``).
``run(quick, out_dir, seed=0)``: the model / data-order seeds (quick 0 with 240 steps, full 0-5, the AdamW
ablation 0-2) and the data sets (train split seed 1000, eval 2000) are ``reseed(literal, seed)``
(seed 0: the default table).

On the procedural shapes data (``jaxsys.data.shapes``: 64 x 64 images, 5 classes, 1-6
objects with occlusion) the same small detector (``jaxsys.models.vision.date``: residual CNN, 3-level
FPN, shared GN towers) is trained twice per seed with the same data order and optimizer: with the
one-to-many branch (``dual=True``, the paper's DATE) and without (one-to-one only, an end-to-end
POTO detector). The optimizer is the paper's (SGD, lr 0.01 at batch 16, momentum 0.9, weight
decay 1e-4); full mode repeats parts 1's rows with AdamW (lr 2e-3) as an ablation. Measured, for
several seeds in one process:

1. AP (COCO AP@[.5:.95], no NMS) of the one-to-one branch vs training step, plotted
   (``ap_vs_step.png``). Headline: the step at which each reaches a fixed AP, chosen as a fraction
   of the lower of the two mean final APs so that every run reaches it (interpolated between
   evaluations, mean over seeds). Goal: dual <= 0.7x the steps, final AP not lower.
2. NMS-free inference: the one-to-one AP without vs with NMS (goal: within 1 AP point), and the
   one-to-many branch of the same model without NMS (duplicates), with its duplicate rate.
3. Inference time of the dual-trained and the one-to-one-only detector: the same graph, timed
   interleaved (goal: equal within noise, 0.9-1.1).

Our AP is cross-checked against pycocotools on the final predictions (when installed).
"""

from __future__ import annotations

import json
import os
import time

import jax
import numpy as np
from flax import nnx

from experiments._cli import reseed
from jaxsys.core.bench import time_interleaved
from jaxsys.core.results import Row, run_dir, write_result
from jaxsys.data.shapes import ShapesConfig, make_shapes
from jaxsys.eval.detection import coco_ap, duplicate_rate, from_batch
from jaxsys.models.vision.date import DATE, DATEConfig, make_detect_fn, predict_dataset, train_detector

NAME = "date"
NMS_IOU = 0.6
VARIANTS = ("dual", "o2o")
THRESHOLD_FRACTION = 0.8  # the fixed AP = this x the lower mean final AP of the two variants


def _settings(quick: bool, seed: int = 0) -> dict:
  """``seed``: the run's ``--seed``; every list of model / data-order seeds is under ``reseed``."""
  # The paper's optimizer (mmdet: SGD, lr 0.01 at batch 16, momentum 0.9, weight decay 1e-4).
  # Full mode repeats the comparison with AdamW as an ablation: Adam's per-parameter step sizes
  # largely make up for the one-to-one branch's sparse gradient, so dual assignment gains less.
  if quick:
    # one seed of 240 steps (~35-45 s per detector on 2 cores, convolutions outside YNNPACK:
    # jaxsys.core.xla_cpu): the quick run's budget is ~2 minutes. Dual vs one-to-one-only
    # steps-to-AP read 0.71 / 0.85 / 0.81 over seeds 0-2 at 240 steps, the dual detector's final
    # AP ahead in all three (experiments/README.md)
    return {"seeds": [reseed(0, seed)], "steps": 240, "eval_every": 40,
            "train_images": 4096, "eval_images": 128, "batch_size": 16, "warmup_steps": 60,
            "optimizers": {"sgd": {"optimizer": "sgd", "learning_rate": 1e-2}}}
  # Six seeds for the headline: the one-to-one-only run's steps-to-AP varies by ~200 steps
  # between seeds (522..712 over seeds 0-2), as much as the effect measured; the ablation keeps 3.
  return {"seeds": [reseed(i, seed) for i in range(6)], "steps": 800, "eval_every": 50,
          "train_images": 4096, "eval_images": 128, "batch_size": 16, "warmup_steps": 60,
          "optimizers": {"sgd": {"optimizer": "sgd", "learning_rate": 1e-2},
                         "adamw": {"optimizer": "adamw", "learning_rate": 2e-3,
                                   "seeds": [reseed(i, seed) for i in range(3)]}}}


def steps_to(curve, level: float) -> float:
  """First step at which the AP curve ``[(step, ap), ...]`` reaches ``level``, linearly
  interpolated between evaluations; inf when it never does."""
  prev_s, prev_a = 0, 0.0
  for s, a in curve:
    if a >= level:
      if a == prev_a:
        return float(s)
      return prev_s + (level - prev_a) / (a - prev_a) * (s - prev_s)
    prev_s, prev_a = s, a
  return float("inf")


def _fmt(steps) -> str:
  return "[" + ", ".join(str(round(s)) if np.isfinite(s) else "never" for s in steps) + "]"


def _plot(curves, level, path, suffix=""):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(6, 3.8))
  colours = {"dual": "tab:blue", "o2o": "tab:orange"}
  names = {"dual": "dual assignment (DATE)", "o2o": "one-to-one only"}
  for variant, runs in curves.items():
    for i, c in enumerate(runs):
      s, a = zip(*c)
      ax.plot(s, 100 * np.asarray(a), color=colours[variant], alpha=0.35, lw=1)
    mean = np.mean([[a for _, a in c] for c in runs], 0)
    ax.plot([s for s, _ in runs[0]], 100 * mean, color=colours[variant], lw=2.2,
            label=f"{names[variant]} (mean of {len(runs)})")
  ax.axhline(100 * level, color="gray", ls="--", lw=1, label=f"fixed AP {100 * level:.1f}")
  ax.set(xlabel="training step", ylabel="one-to-one AP, no NMS (%)",
         title=f"DATE on procedural shapes: AP vs step{suffix}")
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def accuracy_rows(curves: dict, finals: dict, n: int, tag: str = "", steps_goal: str = "<= 0.7"):
  """Rows 1-2 (steps to the fixed AP, final AP, NMS-free AP, duplicates) from the AP curves and
  final evaluations of each variant; returns ``(rows, level, steps_at_other_levels)``. ``tag``
  (an ablation's name) suffixes the metrics of the first two rows."""
  rows: list[Row] = []
  mean = lambda v, key, m="AP": float(np.mean([r[key][m] for r in finals[v]]))  # noqa: E731
  fin = {v: mean(v, "o2o_AP") for v in VARIANTS}
  level = THRESHOLD_FRACTION * min(fin.values())
  stp = {v: [steps_to(c, level) for c in curves[v]] for v in VARIANTS}
  # A seed that never reaches the level within the run is censored: counted as the run's length,
  # a lower bound on its steps (so a censored baseline makes the ratio an upper bound).
  length = max(s for c in curves["o2o"] + curves["dual"] for s, _ in c)
  ms = {v: float(np.mean([min(x, length) for x in stp[v]])) for v in VARIANTS}
  ratio = ms["dual"] / ms["o2o"] if ms["o2o"] > 0 else float("nan")
  censored = {v: sum(not np.isfinite(x) for x in stp[v]) for v in VARIANTS}
  cens = ""
  if censored["o2o"] or censored["dual"]:
    cens = (f"; runs that never reach it count as {length} steps (o2o-only {censored['o2o']}, dual "
            f"{censored['dual']}), so the ratio is an {'upper' if censored['o2o'] else 'lower'} bound")
  rows.append(Row(metric=f"steps to one-to-one AP {100 * level:.1f} (mean of {n} seeds){tag}",
                  unit="steps (ratio = dual/o2o-only)", baseline_name="one-to-one only",
                  baseline=ms["o2o"], ours=ms["dual"], ratio=ratio, goal=steps_goal,
                  met=False if censored["dual"] else None,  # None: evaluated from the goal
                  note=f"fixed AP = {THRESHOLD_FRACTION} x the lower mean final AP; per seed "
                       f"o2o-only {_fmt(stp['o2o'])}, dual {_fmt(stp['dual'])}{cens}"))
  extra_levels = {}
  for frac in (0.5, 0.7, 0.9):
    lv = frac * min(fin.values())
    extra_levels[f"{frac}"] = {v: [steps_to(c, lv) for c in curves[v]] for v in VARIANTS}
  rows.append(Row(metric=f"final one-to-one AP@[.5:.95], no NMS (mean of {n} seeds){tag}",
                  unit="AP (ratio = dual - o2o-only, AP points)", baseline_name="one-to-one only",
                  baseline=fin["o2o"], ours=fin["dual"], ratio=100 * (fin["dual"] - fin["o2o"]),
                  goal=">= 0", note=f"AP50 {mean('o2o', 'o2o_AP', 'AP50'):.3f} -> "
                                    f"{mean('dual', 'o2o_AP', 'AP50'):.3f}"))
  for v, label in (("dual", "dual-trained"), ("o2o", "one-to-one-only")):
    nms_ap = mean(v, "o2o_nms_AP")
    rows.append(Row(metric=f"{label} one-to-one AP: no NMS vs NMS@{NMS_IOU}",
                    unit="AP (ratio = |no NMS - NMS|, AP points)", baseline_name="with NMS",
                    baseline=nms_ap, ours=fin[v], ratio=100 * abs(fin[v] - nms_ap),
                    goal="<= 1" if v == "dual" else None))
  o2m, o2m_nms = mean("dual", "o2m_AP"), mean("dual", "o2m_nms_AP")
  dup = {key: float(np.mean([r[key] for r in finals["dual"]])) for key in ("o2m_dup", "o2m_nms_dup", "o2o_dup")}
  rows.append(Row(metric="one-to-many (FCOS) branch AP: no NMS vs NMS", unit="AP (ratio = no NMS / NMS)",
                  baseline_name="with NMS", baseline=o2m_nms, ours=o2m, ratio=o2m / max(o2m_nms, 1e-9),
                  note="the collapse from duplicates without NMS"))
  rows.append(Row(metric="duplicate rate without NMS (score >= 0.3): one-to-one vs one-to-many",
                  unit="fraction of detections (ratio = o2m / o2o)", baseline_name="one-to-many, no NMS",
                  baseline=dup["o2m_dup"], ours=dup["o2o_dup"],
                  ratio=dup["o2m_dup"] / max(dup["o2o_dup"], 1e-9),
                  note=f"one-to-many with NMS: {dup['o2m_nms_dup']:.3f}"))
  return rows, level, extra_levels


def _train_all(st, opt: dict, cfgs, train, ev, gts, out, tag):
  """Both variants for every seed under one optimizer: AP curves, final evaluations, the last
  trained parameters per variant and the jitted detect functions. ``opt`` holds
  ``train_detector``'s optimizer arguments and optionally its own ``seeds``."""
  k = next(iter(cfgs.values())).num_classes
  opt = dict(opt)
  seeds = opt.pop("seeds", st["seeds"])
  detect, curves = {}, {"dual": [], "o2o": []}
  finals: dict[str, list[dict]] = {"dual": [], "o2o": []}
  last = {}
  for seed in seeds:
    for variant, cfg in cfgs.items():
      model = DATE(cfg, rngs=nnx.Rngs(seed))
      if variant not in detect:
        gd = nnx.split(model, nnx.Param, ...)[0]
        detect[variant] = {"o2o": make_detect_fn(gd), "o2o_nms": make_detect_fn(gd, nms_iou=NMS_IOU)}
        if cfg.dual:
          detect[variant]["o2m"] = make_detect_fn(gd, branch="o2m")
          detect[variant]["o2m_nms"] = make_detect_fn(gd, branch="o2m", nms_iou=NMS_IOU)
      curve = []

      def on_eval(s, p, r, variant=variant, curve=curve):
        curve.append((s, coco_ap(predict_dataset(detect[variant]["o2o"], p, r, ev.images), gts,
                                 num_classes=k)["AP"]))

      t1 = time.perf_counter()
      params, rest, _, hist = train_detector(
          model, train, steps=st["steps"], batch_size=st["batch_size"], warmup_steps=st["warmup_steps"],
          seed=seed, eval_every=st["eval_every"], on_eval=on_eval, **opt)
      res = {"seed": seed, "train_s": round(time.perf_counter() - t1, 1),
             "loss_first": hist[0]["loss"], "loss_last": hist[-1]["loss"]}
      for name, fn in detect[variant].items():
        preds = predict_dataset(fn, params, rest, ev.images)
        res[f"{name}_AP"] = coco_ap(preds, gts, num_classes=k)
        res[f"{name}_dup"] = duplicate_rate(preds, gts)
        if name == "o2o" and variant == "dual":
          last["preds"] = preds
      curves[variant].append(curve)
      finals[variant].append(res)
      last[variant] = (params, rest)
      # kept as training goes, so a long run leaves its curves even if it stops early
      (out / f"partial_{tag}.json").write_text(json.dumps({"curves": curves, "finals": finals}, default=str))
      print(f"[date] {tag} seed {seed} {variant}: final o2o AP {res['o2o_AP']['AP']:.3f} "
            f"({res['train_s']}s)", flush=True)
  return curves, finals, last, detect


def setup(st: dict, seed: int):
  """The data and the two detector configs every run of this experiment uses:
  ``(data_cfg, train, ev, gts, {"dual": cfg, "o2o": cfg})``; ``seed``: the run's ``--seed``."""
  data_cfg = ShapesConfig()
  train = make_shapes(data_cfg, seed=reseed(1000, seed), count=st["train_images"])
  ev = make_shapes(data_cfg, seed=reseed(2000, seed), count=st["eval_images"])
  gts = from_batch(ev.boxes, None, ev.labels, ev.valid)
  cfgs = {"dual": DATEConfig(num_classes=data_cfg.num_classes, dual=True),
          "o2o": DATEConfig(num_classes=data_cfg.num_classes, dual=False)}
  return data_cfg, train, ev, gts, cfgs


def run(quick: bool, out_dir: str, seed: int = 0) -> list[Row]:
  """``seed``: base seed of the data sets and of the model / data-order seeds (0: the default table)."""
  out = run_dir(NAME, out_dir)
  # identical programs recur across seeds: reuse their compilations
  jax.config.update("jax_compilation_cache_dir", os.path.join(out, ".jax_cache"))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  st = _settings(quick, seed)
  t0 = time.perf_counter()
  data_cfg, train, ev, gts, cfgs = setup(st, seed)
  config = {"settings": st, "seed": seed, "data": data_cfg.__dict__, "nms_iou": NMS_IOU,
            "data_s": round(time.perf_counter() - t0, 1),
            "machine": f"{os.cpu_count()}-core CPU; times are interleaved A/B in one process"}
  config["model"] = {k: v.__dict__ for k, v in cfgs.items()}
  k = data_cfg.num_classes
  rows: list[Row] = []
  details = {}
  main_opt, *ablations = st["optimizers"]
  for name in (main_opt, *ablations):
    curves, finals, last, detect = _train_all(st, st["optimizers"][name], cfgs, train, ev, gts, out, name)
    tag = "" if name == main_opt else f", {name} ablation"
    # quick (one seed, 240 steps) read 0.71 / 0.85 / 0.81 over seeds 0-2:
    # the dual detector is faster in every run, by less than full mode's six-seed 0.7
    r, level, extra_levels = accuracy_rows(curves, finals, len(curves["dual"]), tag,
                                           steps_goal="<= 0.95" if quick else "<= 0.7")
    rows += r if name == main_opt else r[:2]
    details[name] = {"curves": curves, "finals": finals, "steps_to_levels": extra_levels, "threshold": level}
    _plot(curves, level, out / ("ap_vs_step.png" if name == main_opt else f"ap_vs_step_{name}.png"),
          f" ({name})")
    if name == main_opt:
      main = (last, detect)
  last, detect = main
  # 3. inference time: the same one-to-one graph, interleaved on one batch
  x = ev.images[:32]
  fns = {v: (detect[v]["o2o"], (*last[v], x)) for v in cfgs}
  tm = time_interleaved(fns, rounds=15 if quick else 40, warmup=2)
  r_t = tm["o2o"].min / tm["dual"].min
  rows.append(Row(metric="inference time, batch 32 (one-to-one, no NMS)", unit="ms",
                  baseline_name="one-to-one-only detector", baseline=tm["o2o"].ms, ours=tm["dual"].ms,
                  ratio=r_t, goal="0.9 to 1.1 (equal within noise)", met=bool(0.9 <= r_t <= 1.1),
                  note=f"medians {1e3 * tm['o2o'].median:.1f} vs {1e3 * tm['dual'].median:.1f} ms"))
  try:
    from jaxsys.eval.detection import pycocotools_ap
    ref = pycocotools_ap(last["preds"], gts, num_classes=k)["AP"]
    ours = coco_ap(last["preds"], gts, num_classes=k)["AP"]
    rows.append(Row(metric="our AP vs pycocotools on the final predictions", unit="|AP difference|",
                    baseline_name="pycocotools", baseline=ref, ours=abs(ours - ref), goal="<= 0.001 (ours)"))
  except ImportError:
    pass
  write_result(NAME, rows, config=config, quick=quick, out_dir=out_dir, extra={"details": details})
  return rows


if __name__ == "__main__":
  import sys
  from experiments._cli import main
  sys.exit(main(NAME))
