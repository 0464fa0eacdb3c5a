"""LongVILA-R1 MR-SP: video GRPO with cached vision embeddings and sequence-parallel passes.

``python -m experiments.mrsp [--quick] [--mesh ulysses=U] [--seed S] [--dtype D]`` (8 simulated CPU devices by
default), or ``jaxsys reproduce --only mrsp``; ``run(quick, out_dir, parts=None, mesh=None, seed=0)``.

``--mesh ulysses=U``: the sequence-parallel mesh of ``cached_sp`` (default every device; video
GRPO's SP is Ulysses only, and U must divide the LMs' 8 heads). ``--seed S`` draws another visual
world, other task videos, initial weights, rollouts and held-out sets (seed 0: the default table).

1. Time per RL step (rollout with a shared prefill, old and reference log-probs, update) vs
   frame count (quick: 128 alone, without ``cached_sp``) for ``recompute`` (re-encode the frames
   in every pass), ``cached`` (stage 1) and
   ``cached_sp`` (stage 1 + Ulysses SP over U = 8 devices), timed interleaved in one process; and
   the frame encoder's share of the baseline step. Goal: ``cached`` >= 1.8x ``recompute`` at the
   two largest frame counts (quick: at 128, where the ratio is the lower of 64's and 128's).
2. Compiled peak memory per device of one update micro-batch (forward + backward; the
   compiler's plan, nothing allocated) vs frame count (quick: 64 and 1024) for the three modes, and the largest
   frame count that fits a fixed per-device budget. Goal: ``cached_sp`` on U = 8 devices fits
   >= 4x the frames of ``cached`` on 1.
3. FSDP x SP: ``cached_sp`` on ``data=2 x ulysses=U/2`` with the LM's parameters and Adam
   moments sharded over "data" (``rules="fsdp"``) against ``ulysses=U`` replicated, on the same
   devices: trained state per device (goal <= 0.55x, ideal 0.5), the update's gradients against
   one device (goal <= 1e-5 max abs diff) and (full mode) the RL step time.
4. RL: a VLM warmed up by a supervised phase that stops at ``SFT_TARGET`` validation accuracy,
   then GRPO in ``cached_sp`` mode (60 steps quick, 160 full) on the verifiable video QA tasks
   (needle, count, order); held-out reward and accuracy (G samples per video, and greedy) and
   V-NIAH-style needle accuracy over depths before and after, with the curves plotted. Goal:
   the sampled held-out reward rises.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time

import jax
import numpy as np
from flax import nnx

from experiments._cli import reseed
from jaxsys.core.bench import time_fn, time_interleaved
from jaxsys.core.errors import ConfigError
from jaxsys.core.mesh import make_mesh
from jaxsys.core.results import Row, run_dir, write_result
from jaxsys.data import video
from jaxsys.eval.vniah import Grid, plot_heatmap
from jaxsys.models import DecoderConfig
from jaxsys.models.vlm import VLM, VLMConfig
from jaxsys.rl import video_grpo as vg
from jaxsys.rl import video_tasks as vt

NAME = "mrsp"
DEVICES = 8
MESH_EXAMPLE = "ulysses=8"
MODES = ("recompute", "cached", "cached_sp")
BUDGET_MIB = 64  # fixed per-device memory budget of part 2


def _setup(seed: int = 0, dtype: str = "float32"):
  # The encoder works on 16 patches per frame (8x the LM's 2 tokens per frame) through 6 blocks,
  # so encoding is more than half of the baseline step at every frame count, as the ViT is for
  # LongVILA-R1 (where caching alone gives ~2x). With 4 blocks its share fell from 0.65 at 32
  # frames to 0.45 at 512, where the LM's attention over 1027-token rows dominates.
  # The spec's seed fixes the visual world (marker and glyph prototypes): data, so it follows --seed.
  spec = video.VideoSpec(patches=16, patch_dim=16, seed=reseed(video.VideoSpec.seed, seed))
  cfg = VLMConfig(patches=16, patch_dim=16, tokens_per_frame=2, vision_hidden=64, vision_layers=6,
                  vision_heads=4,
                  lm=DecoderConfig(vocab_size=vt.VOCAB, hidden_size=64, intermediate_size=128,
                                   num_layers=2, num_heads=8, num_kv_heads=8, max_position_embeddings=16384,
                                   dtype=dtype))
  return spec, cfg


def sp_axes(mesh: dict | None, devices: int) -> dict:
  """The ``--mesh`` of the ``cached_sp`` passes, checked: ``{"ulysses": U}``, default every device."""
  axes = dict(mesh or {"ulysses": devices})
  if set(axes) - {"ulysses"}:
    raise ConfigError(f"--mesh {axes}: mrsp takes ulysses=U (video GRPO's sequence parallelism is "
                      "Ulysses only)")
  need = axes["ulysses"]
  if devices < need:
    raise ConfigError(f"mrsp's mesh {axes} needs {need} devices; found {devices}. On CPU: "
                      f"--devices {need} (simulated); on GPUs/TPUs use more chips or a smaller --mesh")
  heads = {c.lm.num_heads for c in (_setup()[1], rl_setup()[1])}
  if any(h % need for h in heads):  # Ulysses gives each device whole heads
    raise ConfigError(f"--mesh {axes}: Ulysses splits the LMs' {sorted(heads)} attention heads, so U "
                      "must divide them")
  return axes


def _trainers(model, tasks, mesh, seed: int = 0, **kw):
  # GRPO's seed is the run's seed itself, not reseed(0, seed): the trainer derives each rollout's
  # seed as grpo.seed * 100003 + step, so the seeds stay apart without a second stride
  grpo = dataclasses.replace(kw.pop("grpo", vg.RECIPE), seed=seed)
  return {m: vg.VideoGRPOTrainer(model, tasks, vg.VideoGRPOConfig(mode=m, grpo=grpo, **kw),
                                 mesh=mesh if m == "cached_sp" else None) for m in MODES}


def timing(quick, rows, config, out, axes, seed, dtype="float32"):
  spec, cfg = _setup(seed, dtype)
  mesh = make_mesh(axes)
  model = VLM(cfg, rngs=nnx.Rngs(reseed(0, seed)))
  # each length compiles 3 programs per mode; quick times the goal's harder point alone (64 frames
  # read 3.09 and 128 frames 2.68 in the table before; 64's programs were ~18 s of the quick run)
  frames = [128] if quick else [32, 64, 128, 256, 512]
  rounds = 3 if quick else 5
  # quick times the two modes of the goal rows: ``cached_sp``'s step on simulated devices that
  # share 2 cores (no goal; ~30 s of SPMD compiles) is the full mode's, as is part 3's fsdp timing
  modes = MODES[:2] if quick else MODES
  config.update(time_frames=frames, time_rounds=rounds, time_modes=list(modes))
  res = {m: [] for m in modes}
  share = []
  for f in frames:
    tasks = vt.VideoTaskSampler(spec, n_frames=f, seed=reseed(0, seed))
    tr = _trainers(model, tasks, mesh, seed)
    ex = tasks.sample(tr["cached"].config.grpo.prompts_per_step)
    t = time_interleaved({m: (lambda m=m: tr[m].step(ex)) for m in modes}, rounds=rounds)
    for m in modes:
      res[m].append(t[m].min)
    # encoder share of the baseline step: its per-video encode time x the videos it encodes
    base = tr["recompute"]
    before = base.encoded_videos
    base.step(ex)
    per_step = base.encoded_videos - before
    g = base.config.grpo.group_size
    vids = np.repeat(np.stack([e.frames for e in ex]), g, axis=0)  # one pass's worth of videos
    enc = time_fn(lambda: base.encode(vids), iters=rounds).min / len(vids)
    share.append(min(1.0, enc * per_step / t["recompute"].min))
    print(f"[mrsp] {f} frames: " + ", ".join(f"{m} {t[m].min:.3f}s" for m in modes)
          + f", encoder share of recompute {share[-1]:.2f}", flush=True)
  for i, f in enumerate(frames):
    big = i >= len(frames) - 2
    rows.append(Row(metric=f"RL step time @{f} frames: cached", unit="s", baseline_name="recompute",
                    baseline=res["recompute"][i], ours=res["cached"][i], goal=">= 1.8" if big else None,
                    note=f"encoder share of the recompute step {share[i]:.2f}"))
    if "cached_sp" in res:
      rows.append(Row(metric=f"RL step time @{f} frames: cached_sp ({axes['ulysses']} devices)", unit="s",
                      baseline_name="recompute", baseline=res["recompute"][i], ours=res["cached_sp"][i],
                      note=f"{axes['ulysses']} simulated devices share the 2 CPU cores"))
  _plot(out / "step_time.png", frames, res, "frames", "seconds per RL step", "RL step time")
  config["step_seconds"] = {m: [round(x, 4) for x in v] for m, v in res.items()}
  config["encoder_share_recompute"] = [round(x, 3) for x in share]


def memory(quick, rows, config, out, axes, seed, dtype="float32"):
  # Compiled memory plans depend on shapes only; the seed is threaded for uniformity.
  spec, cfg = _setup(seed, dtype)
  mesh = make_mesh(axes)
  model = VLM(cfg, rngs=nnx.Rngs(reseed(0, seed)))
  # quick: the two ends (every count compiles 3 update programs); the budget line falls between them
  frames = [64, 1024] if quick else [64, 128, 256, 512, 1024, 2048, 4096]
  tr = _trainers(model, vt.VideoTaskSampler(spec, n_frames=frames[0], seed=reseed(0, seed)), mesh, seed)
  mb = tr["cached"].config.grpo.prompts_per_step * tr["cached"].config.grpo.group_size
  peak = {m: [] for m in MODES}
  for f in frames:
    for m in MODES:
      mem = tr[m].update_memory(f, mb)
      peak[m].append(None if mem is None else mem["peak_bytes"] / 2**20)
    print(f"[mrsp] memory @{f} frames: " + ", ".join(f"{m} {peak[m][-1]:.1f} MiB" for m in MODES), flush=True)
  config.update(memory_frames=frames, memory_rows=mb, budget_mib=BUDGET_MIB,
                peak_mib={m: [round(x, 2) for x in v] for m, v in peak.items()})

  def largest(m):
    fit = [f for f, p in zip(frames, peak[m]) if p is not None and p <= BUDGET_MIB]
    return max(fit) if fit else 0

  top = {m: largest(m) for m in MODES}
  u = axes["ulysses"]
  for f, a, b, c in zip(frames, peak["recompute"], peak["cached"], peak["cached_sp"]):
    rows.append(Row(metric=f"peak memory per device @{f} frames: cached_sp ({u}) vs cached (1)",
                    unit="MiB (ratio = cached/cached_sp)", baseline_name="cached", baseline=b, ours=c,
                    ratio=b / c, note=f"recompute {a:.1f} MiB"))
  capped = top["cached_sp"] == frames[-1]
  rows.append(Row(metric=f"largest frame count in {BUDGET_MIB} MiB/device: cached_sp ({u}) vs cached (1)",
                  unit="frames (ratio = ours/baseline)", baseline_name="cached", baseline=top["cached"],
                  ours=top["cached_sp"], ratio=top["cached_sp"] / max(top["cached"], 1), goal=">= 4",
                  note=(f"recompute fits {top['recompute']}" + ("; cached_sp fits the largest count tried"
                                                                 if capped else ""))))
  _plot(out / "peak_memory.png", frames, peak, "frames", "MiB per device", "update peak memory",
        hline=BUDGET_MIB)


def fsdp_axes(axes: dict) -> dict:
  """Part 4's mesh: the SP degree halved and a "data" axis of 2 beside it (same device count)."""
  return {"data": 2, "ulysses": max(1, axes["ulysses"] // 2)}


def _state_bytes(tree) -> int:
  """Bytes one device holds of ``tree`` (its first addressable shard of every array)."""
  return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree))


def fsdp(quick, rows, config, out, axes, seed, dtype="float32"):
  """MR-SP inside FSDP: ``cached_sp`` on ``data=2 x ulysses=U/2`` with the LM's parameters and
  Adam moments sharded over "data" (rules "fsdp") against ``ulysses=U`` with them replicated:
  the trained state per device, the update's loss and gradients against one device, and the RL
  step time."""
  spec, cfg = _setup(seed, dtype)
  model = VLM(cfg, rngs=nnx.Rngs(reseed(0, seed)))
  tasks = vt.VideoTaskSampler(spec, n_frames=64, seed=reseed(0, seed))
  grpo = dataclasses.replace(vg.RECIPE, seed=seed)
  fx = fsdp_axes(axes)
  if jax.device_count() < 2 * fx["ulysses"]:
    print(f"[mrsp] fsdp: skipped, {fx} needs {2 * fx['ulysses']} devices", flush=True)
    return
  tr = {"one": vg.VideoGRPOTrainer(model, tasks, vg.VideoGRPOConfig(mode="cached", grpo=grpo))}
  for name, ax in (("replicated", axes), ("fsdp", fx)):
    tr[name] = vg.VideoGRPOTrainer(model, tasks, vg.VideoGRPOConfig(mode="cached_sp", grpo=grpo),
                                   mesh=make_mesh(ax), rules="fsdp")
  state = {k: _state_bytes((t.params, t.opt_state)) for k, t in tr.items() if k != "one"}
  rows.append(Row(metric=f"trained LM state per device (parameters + Adam moments): cached_sp data=2 x "
                         f"ulysses={fx['ulysses']} (fsdp) vs ulysses={axes['ulysses']} (replicated)",
                  unit="KiB (ratio = ours/baseline)", baseline_name="replicated", baseline=state["replicated"] / 1024,
                  ours=state["fsdp"] / 1024, ratio=state["fsdp"] / state["replicated"], ideal=0.5, goal="<= 0.55"))
  # the same update on one device and on the FSDP x SP mesh (rows padded to each one's layout)
  ex = tasks.sample(grpo.prompts_per_step)
  resp = [[1, 2, video.EOS], [3, video.EOS]] * (len(ex) // 2) + [[4, video.EOS]] * (len(ex) % 2)
  adv = np.linspace(-1, 1, len(ex)).astype(np.float32)
  r = {k: tr[k].layout().response for k in ("one", "fsdp")}
  old = np.full((len(ex), r["fsdp"]), -2.9, np.float32)
  (l1, _), g1 = tr["one"].loss_and_grads(ex, resp, adv, old[:, :r["one"]], old[:, :r["one"]] + 0.1)
  (l2, _), g2 = tr["fsdp"].loss_and_grads(ex, resp, adv, old, old + 0.1)
  err = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) for a, b in
            zip(jax.tree.leaves(g1), jax.tree.leaves(g2)))
  scale = max(float(np.max(np.abs(np.asarray(a)))) for a in jax.tree.leaves(g1))
  rows.append(Row(metric="update gradients: cached_sp fsdp x SP vs cached on one device", unit="max abs diff",
                  baseline_name="one device", ours=err, goal="<= 1e-5 (ours)",
                  note=f"largest gradient entry {scale:.3g}; loss {float(l2):.6f} vs {float(l1):.6f}"))
  if not quick:  # quick skips it: two more sets of RL-step programs (~15 s) for a row with no goal
    t = time_interleaved({k: (lambda k=k: tr[k].step(ex)) for k in ("replicated", "fsdp")}, rounds=5)
    rows.append(Row(metric=f"RL step time @64 frames: cached_sp fsdp (data=2 x ulysses={fx['ulysses']})",
                    unit="s", baseline_name=f"replicated (ulysses={axes['ulysses']})",
                    baseline=t["replicated"].min, ours=t["fsdp"].min,
                    note="simulated devices share the CPU cores: the ratio shows overhead, not speed"))
  config.update(fsdp_mesh=fx, fsdp_state_bytes=state, fsdp_grad_max_abs_diff=err)
  print(f"[mrsp] fsdp: state {state['fsdp']} vs {state['replicated']} bytes/device, grad diff {err:.2e}",
        flush=True)


def rl_setup(seed: int = 0, dtype: str = "float32"):
  # The RL part asks whether GRPO improves a policy, so it needs a warm-up that can read the
  # glyphs within a CPU budget: the default small world (4 patches of 8 features, 8 glyph
  # classes) and 8 frames; 8 LM heads for Ulysses over 8 devices. Its prototypes follow --seed.
  spec = video.VideoSpec(seed=reseed(video.VideoSpec.seed, seed))
  cfg = VLMConfig(lm=dataclasses.replace(VLMConfig().lm, vocab_size=vt.VOCAB, num_heads=8, num_kv_heads=8,
                                         max_position_embeddings=4096, dtype=dtype))
  return spec, cfg


#: The warm-up stops once greedy accuracy on a validation set reaches this (checked every
#: SFT_CHECK_EVERY steps): a policy that solves only `count` (needle and order at chance, 1/64)
#: leaves GRPO no signal on them, since every rollout of such a group scores the same and its
#: advantages are 0; one that solves everything leaves nothing to learn.
SFT_TARGET = 0.55
SFT_CHECK_EVERY = 50


#: GRPO settings of part 3: LongVILA-R1's objective (clip 0.2/0.3, dual-clip 3, token-mean, k3 KL
#: 1e-2) with 8 prompts x G=8 rollouts and 4 update micro-batches per step (lr 3e-4 and 1e-3 moved
#: the policy away from the warm-up faster than the reward rose: KL 0.1-1 within 20-60 steps).
RL_GRPO = dataclasses.replace(vg.RECIPE, prompts_per_step=8, group_size=8, minibatches=4, lr=1e-4)


def rl(quick, rows, config, out, axes, seed, dtype="float32"):
  spec, cfg = rl_setup(seed, dtype)
  f = 8
  sft_max, rl_steps = (3000, 60) if quick else (3000, 160)
  tasks = vt.VideoTaskSampler(spec, n_frames=f, seed=reseed(0, seed))
  val = vt.VideoTaskSampler(spec, n_frames=f, seed=reseed(55, seed)).sample(96)
  checks = []

  def competent(m):  # greedy validation accuracy of the warm-up so far
    checks.append(vg.VideoGRPOTrainer(m, tasks, vg.VideoGRPOConfig(mode="cached")).evaluate(val)["accuracy"])
    return checks[-1] >= SFT_TARGET

  t0 = time.perf_counter()
  model, sft_loss = vg.pretrain_video_policy(VLM(cfg, rngs=nnx.Rngs(reseed(0, seed))), tasks, steps=sft_max,
                                             batch=32, lr=5e-3, seed=reseed(0, seed), until=competent,
                                             check_every=SFT_CHECK_EVERY)
  sft_steps = SFT_CHECK_EVERY * len(checks)
  config.update(rl_frames=f, sft_steps=sft_steps, sft_target=SFT_TARGET, sft_val_accuracy=checks,
                sft_loss=round(sft_loss, 4), rl_steps=rl_steps, sft_seconds=round(time.perf_counter() - t0, 1))
  print(f"[mrsp] warm-up: {sft_steps} steps, validation accuracy {checks[-1]:.2f}", flush=True)
  mesh = make_mesh(axes)
  grpo = dataclasses.replace(RL_GRPO, seed=seed)  # the run's seed itself, as in _trainers
  tr = vg.VideoGRPOTrainer(model, tasks, vg.VideoGRPOConfig(mode="cached_sp", grpo=grpo), mesh=mesh)
  rng = np.random.default_rng(reseed(123, seed))
  depths = [0.0, 0.25, 0.5, 0.75, 1.0]
  per = 16 if quick else 32
  held = vt.VideoTaskSampler(spec, n_frames=f, seed=reseed(77, seed)).sample(192 if quick else 384)
  needles = [vt.make_example(spec, rng, "needle", f, depth=d) for d in depths for _ in range(per)]

  eval_seed = reseed(999, seed)  # the same sampling key before and after RL

  def evaluate():
    e = {"greedy": tr.evaluate(held), "sampled": tr.evaluate(held, sampled=True, seed=eval_seed)}
    e["kinds"] = {k: float(np.mean([h for x, h in zip(held, e["sampled"]["hits"]) if x.kind == k]))
                  for k in vt.KINDS}
    hits = tr.evaluate(needles, sampled=True, seed=eval_seed)["hits"].reshape(len(depths), per).mean(1)
    return e, hits

  before, nb = evaluate()
  curve, acc_curve, kl = [], [], []
  for _ in _progress(range(rl_steps), "GRPO steps"):
    m = tr.step()
    curve.append(m["reward_mean"])
    acc_curve.append(m["accuracy"])
    kl.append(m["kl"])
  after, na = evaluate()
  config.update(reward_curve=[round(x, 3) for x in curve], accuracy_curve=[round(x, 3) for x in acc_curve],
                kl_curve=[round(x, 4) for x in kl], held_out=len(held),
                sampled_accuracy_by_kind={"before": before["kinds"], "after": after["kinds"]},
                grpo={k: getattr(RL_GRPO, k) for k in ("group_size", "prompts_per_step", "minibatches", "clip_low",
                                                        "clip_high", "dual_clip", "loss_agg", "kl_coef", "lr")})
  g = RL_GRPO.group_size
  for how, goal in (("sampled", ">= 1"), ("greedy", None)):
    what = f"{g} samples per video at T=1" if how == "sampled" else "greedy"
    for key in ("reward", "accuracy"):
      b, a = before[how][key], after[how][key]
      rows.append(Row(metric=f"held-out {key} ({what}), before vs after {rl_steps} GRPO steps (cached_sp)",
                      unit=f"{key} (ratio = after/before)", baseline_name="after SFT warm-up", baseline=b,
                      ours=a, ratio=a / max(b, 1e-9), goal=goal if key == "reward" else None,
                      note=f"{len(held)} held-out videos, {f} frames"))
  rows.append(Row(metric=f"V-NIAH-style needle accuracy over {len(depths)} depths @{f} frames, before vs after RL",
                  unit="accuracy (ratio = after/before)", baseline_name="after SFT warm-up",
                  baseline=float(nb.mean()), ours=float(na.mean()),
                  ratio=float(na.mean()) / max(float(nb.mean()), 1e-9),
                  note=f"{g} samples x {per} videos per depth; chance 1/{spec.num_classes ** 2}"))
  q = max(rl_steps // 4, 1)
  rows.append(Row(metric="mean training reward: last quarter vs first quarter of RL steps",
                  unit="reward (ratio = last/first)", baseline_name="first quarter",
                  baseline=float(np.mean(curve[:q])), ours=float(np.mean(curve[-q:])),
                  ratio=float(np.mean(curve[-q:])) / max(float(np.mean(curve[:q])), 1e-9)))
  plot_heatmap(Grid([f], depths, nb[None]), out / "vniah_before.png", title="needle accuracy before RL")
  plot_heatmap(Grid([f], depths, na[None]), out / "vniah_after.png", title="needle accuracy after RL")
  _plot(out / "rl_curves.png", list(range(1, rl_steps + 1)),
        {"reward": curve, "accuracy": acc_curve, "reward (running mean of 10)": _running(curve, 10)},
        "RL step", "mean over rollouts", f"GRPO (cached_sp) at {f} frames")


def _running(xs, k):
  c = np.cumsum(np.concatenate([[0.0], xs]))
  return [(c[i + 1] - c[max(0, i + 1 - k)]) / (i + 1 - max(0, i + 1 - k)) for i in range(len(xs))]


def _progress(it, desc):
  from tqdm.auto import tqdm
  return tqdm(it, desc=f"[mrsp] {desc}", leave=False, mininterval=5, dynamic_ncols=True)


def _plot(path, xs, series, xlabel, ylabel, title, hline=None):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(5, 3.4))
  for label, ys in series.items():
    ax.plot(xs, ys, marker="o", ms=3, label=label)
  if hline is not None:
    ax.axhline(hline, color="gray", ls="--", lw=1, label="budget")
  if xlabel == "frames":
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
  ax.set_xlabel(xlabel)
  ax.set_ylabel(ylabel)
  ax.set_title(title, fontsize=9)
  ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


PARTS = ("time", "memory", "fsdp", "rl")


def run(quick: bool = False, out_dir=None, parts=None, mesh: dict | None = None, seed: int = 0,
        dtype: str = "float32") -> list[Row]:
  """``mesh``: the ``cached_sp`` passes' ``{"ulysses": U}`` (default every device); ``seed``: the
  run's ``--seed`` (every part gets it); ``dtype``: the LM's compute dtype (``--dtype``; the
  parameters and the frame encoder stay float32)."""
  axes = sp_axes(mesh, jax.device_count())  # before any part: a bad --mesh fails at once
  parts = parts or PARTS
  name = NAME if tuple(parts) == PARTS else f"{NAME}_{'_'.join(parts)}"
  out = run_dir(name, out_dir)
  rows: list[Row] = []
  config = {"devices": jax.device_count(), "mesh": axes, "seed": seed, "dtype": dtype, "modes": MODES,
            "machine": f"{os.cpu_count()}-core CPU; ratios are measured side by side in one process"}
  for part, fn in (("time", timing), ("memory", memory), ("fsdp", fsdp), ("rl", rl)):
    if part in parts:
      t0 = time.perf_counter()
      fn(quick, rows, config, out, axes, seed, dtype)
      config[f"{part}_seconds"] = round(time.perf_counter() - t0, 1)
  write_result(name, rows, config=config, quick=quick, out_dir=out_dir)
  return rows


if __name__ == "__main__":
  from experiments._cli import main
  sys.exit(main(NAME))
