"""Video needle-in-a-haystack before / after the long-context extension stage (LongVILA).

A tiny VLM (ViT-style frame encoder + MLP projector + decoder LM) is trained on synthetic
video QA in two stages with ``jaxsys.train``:

1. short-context stage: videos of ``2..F1`` frames;
2. long-context extension stage: RoPE theta rescaled (x ``theta_scale``) and training continued
   on videos of ``2..F2`` frames (short videos mixed in).

Both checkpoints are evaluated with 2D hybrid sequence parallelism (ring 2 x ulysses 4 on 8
devices, two-stage multimodal sharding) on a frames x depth grid up to ``2 * F2`` frames;
exact match of the greedy two-digit answer. Heatmaps are saved for both.

``--seed S`` draws another visual world (the marker and glyph prototypes), other training and
evaluation videos and other initial weights (seed 0: the default table).
"""

import time

import jax
from flax import nnx

from experiments._cli import reseed
from jaxsys.core.errors import ConfigError
from jaxsys.core.mesh import make_mesh
from jaxsys.core.results import Row, run_dir, write_result
from jaxsys.data import video
from jaxsys.eval.vniah import plot_heatmap, seq_bucket, vniah_grid
from jaxsys.models.vlm import VLM, VLMConfig, rebuild, vlm_loss, with_rope_theta
from jaxsys.nn.rope import RopeConfig
from jaxsys.parallel import api, multimodal, zigzag
from jaxsys.train import TrainConfig, train

NAME = "vniah"
DEVICES = 8  # simulated CPU devices by default (--devices N)
MESH_EXAMPLE = "ring=2,ulysses=4"


def _batches(spec, cfg, plan, *, frames, max_frames, batch_size, seed, sharded):
  seq = seq_bucket(frames[1], spec, plan.chunk_multiple())
  nft = cfg.num_frame_tokens(max_frames)

  def batches(step):
    raw = video.video_qa_batch(spec, seed=seed, step=step, batch_size=batch_size, n_frames=frames,
                               seq_len=seq, max_frames=max_frames)
    b = multimodal.prepare_mm_batch(raw, plan, nft)
    if not sharded:
      b.pop("send_idx"), b.pop("recv_pos")
    return b
  return batches, seq


def train_stage(model, spec, *, frames, steps, lr, batch_size, seed, mesh, plan):
  max_frames = zigzag.pad_len(frames[1], plan.degree)
  batches, seq = _batches(spec, model.cfg, plan, frames=frames, max_frames=max_frames,
                          batch_size=batch_size, seed=seed, sharded=model.plan is not None)
  cfg = TrainConfig(total_steps=steps, warmup_steps=min(50, steps // 10), learning_rate=lr,
                    log_every=max(steps // 10, 1), weight_decay=0.0)
  t0 = time.perf_counter()
  res = train(model, batches, cfg, loss_fn=vlm_loss, mesh=mesh, progress=False)
  return res.history, time.perf_counter() - t0, seq


def run(quick: bool, out_dir: str, mesh: dict | None = None, seed: int = 0, dtype: str = "float32"):
  """``mesh``: the evaluation's (and full mode's training) ring x ulysses mesh, default 2 x 4.
  ``seed``: the run's ``--seed`` (the visual world, the videos and the initial weights).
  ``dtype``: the LM's compute dtype (``--dtype``; parameters and the frame encoder stay float32)."""
  axes = dict(mesh or {"ring": 2, "ulysses": 4})
  if set(axes) - {"ring", "ulysses"}:
    raise ConfigError(f"--mesh {axes}: vniah takes ring=R,ulysses=U")
  need = axes.get("ring", 1) * axes.get("ulysses", 1)
  if jax.device_count() < need:
    raise ConfigError(f"vniah's mesh {axes} needs {need} devices; found {jax.device_count()}. On CPU: "
                      f"--devices {need} (simulated); on GPUs/TPUs use more chips or a smaller --mesh")
  # The spec's own seed fixes the "visual world" (marker and glyph prototypes): data, so it follows
  # the run's seed like the videos drawn from it.
  spec = video.VideoSpec(seed=reseed(video.VideoSpec.seed, seed))
  f1, f2 = 8, 32                      # short stage / extension stage frame counts
  theta, theta_scale = 1e4, 4.0
  if quick:
    s1, s2, bs, lr = 300, 150, 32, 5e-3
    grid_frames, depths, samples = [8, 32, 64], [0.0, 0.5, 1.0], 4
    train_sp = False                  # CPU budget: the train step is verified equal under SP by tests
  else:
    s1, s2, bs, lr = 800, 400, 32, 5e-3
    grid_frames, depths, samples = [4, 8, 16, 32, 48, 64], [0.0, 0.25, 0.5, 0.75, 1.0], 8
    train_sp = True
  cfg = VLMConfig()
  cfg = VLMConfig(lm=cfg.lm.replace(rope=RopeConfig(theta=theta), dtype=dtype))
  sp_mesh = make_mesh({"ring": axes.get("ring", 1), "ulysses": axes.get("ulysses", 1)})
  single = make_mesh({"ring": 1}, jax.devices()[:1])
  train_mesh = sp_mesh if train_sp else None
  model = VLM(cfg, rngs=nnx.Rngs(reseed(0, seed)), mesh=train_mesh, strategy="hybrid")
  plan = model.plan or api.make_plan(single, "ring")

  h1, t1, seq1 = train_stage(model, spec, frames=(2, f1), steps=s1, lr=lr, batch_size=bs,
                             seed=reseed(0, seed), mesh=train_mesh, plan=plan)
  short_model = rebuild(model)  # a frozen copy of the short-stage weights
  extended = with_rope_theta(model, theta * theta_scale)
  h2, t2, seq2 = train_stage(extended, spec, frames=(2, f2), steps=s2, lr=lr / 2, batch_size=bs // 2,
                             seed=reseed(1, seed), mesh=train_mesh, plan=plan)

  # Evaluation: hybrid 2D sequence parallelism on the 8-device mesh.
  # Both checkpoints on the same videos: vniah_grid's own default seed (7), moved by the run's.
  t0 = time.perf_counter()
  before = vniah_grid(rebuild(short_model, mesh=sp_mesh, strategy="hybrid"), spec,
                      frames=grid_frames, depths=depths, samples=samples, seed=reseed(7, seed))
  after = vniah_grid(rebuild(extended, mesh=sp_mesh, strategy="hybrid"), spec,
                     frames=grid_frames, depths=depths, samples=samples, seed=reseed(7, seed))
  t_eval = time.perf_counter() - t0

  out = run_dir(NAME, out_dir)
  plot_heatmap(before, out / "heatmap_before_extension.png",
               title=f"V-NIAH before extension (trained <= {f1} frames)")
  plot_heatmap(after, out / "heatmap_after_extension.png",
               title=f"V-NIAH after extension (trained <= {f2} frames, theta x{theta_scale:g})")
  beyond = [f for f in grid_frames if f > f2]
  rows = [
      Row(f"V-NIAH exact match, frames <= {f2} (extension length): after vs before extension",
          "exact match (ratio = after/before)", after.up_to(f2), baseline=before.up_to(f2),
          baseline_name="before extension",
          ratio=after.up_to(f2) / before.up_to(f2) if before.up_to(f2) else None,
          goal=">= 0.95 (ours)"),
      Row(f"V-NIAH exact match, frames <= {f1} (short-stage length)", "exact match",
          after.up_to(f1), baseline=before.up_to(f1), baseline_name="before extension"),
  ]
  if beyond:
    sel = [grid_frames.index(f) for f in beyond]
    a, b = float(after.accuracy[sel].mean()), float(before.accuracy[sel].mean())
    rows.append(Row(f"V-NIAH exact match at {beyond} frames (2x beyond extension)", "exact match",
                    a, baseline=b, baseline_name="before extension",
                    note="beyond every training length: length generalisation, measured"))
  chance = 1.0 / spec.num_classes ** 2
  rows.append(Row("chance level (random two-digit code)", "exact match", chance))
  config = {"short_stage": {"frames": [2, f1], "steps": s1, "batch": bs, "lr": lr, "seq_len": seq1,
                            "rope_theta": theta, "seconds": round(t1, 1)},
            "extension_stage": {"frames": [2, f2], "steps": s2, "batch": bs // 2, "lr": lr / 2,
                                "seq_len": seq2, "rope_theta": theta * theta_scale,
                                "seconds": round(t2, 1)},
            "train_under_sp_mesh": train_sp, "seed": seed, "dtype": dtype,
            "eval": {"strategy": "hybrid", "mesh": dict(sp_mesh.shape), "frames": grid_frames,
                     "depths": depths, "samples_per_cell": samples, "seconds": round(t_eval, 1)},
            "model": {"vision_hidden": cfg.vision_hidden, "vision_layers": cfg.vision_layers,
                      "lm_hidden": cfg.lm.hidden_size, "lm_layers": cfg.lm.num_layers,
                      "heads": cfg.lm.num_heads, "tokens_per_frame": cfg.tokens_per_frame},
            "video": {"patches": spec.patches, "patch_dim": spec.patch_dim,
                      "classes": spec.num_classes, "noise": spec.noise},
            "note": ("quick mode trains without SP (one device) to fit the CPU budget; the SP "
                     "training step equals the unsharded one (tests/models/test_vlm.py)")
            if not train_sp else "trained under the hybrid SP mesh"}
  extra = {"grid_before": before.to_json(), "grid_after": after.to_json(),
           "history_short": h1, "history_extension": h2}
  write_result(NAME, rows, config=config, quick=quick, out_dir=out_dir, extra=extra)
  return rows


if __name__ == "__main__":
  import sys
  from experiments._cli import main
  sys.exit(main("vniah"))
