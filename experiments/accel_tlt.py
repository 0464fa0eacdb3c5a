"""TLT on the GPU: the EAGLE drafter trained on SmolLM2 rollouts, then GRPO, TLT vs vanilla.

  python -m experiments.accel_tlt --seconds 300 --out "$OUT"                    # both phases
  python -m experiments.accel_tlt --phases grpo --drafter smollm2-135m-instruct-eagle   # shipped drafter

Both phases call the tlt experiment's full mode (``experiments._tlt_smollm2.run``: SmolLM2 as the
policy, its chat tasks, T = 0.7, 160 new tokens, chain(4,1,5) / tree(4,2,5), K = 4096 draft
vocabulary) with its settings, except the warm-up data (``--warm-rollouts`` x 8 responses,
``--warm-steps``; the CPU runs had 16 x 8 and 400):

* ``drafter``: parts ``speedup``: the warm-up rollouts, the drafter's training on them (held-out
  top-1 reported), then speculative decode vs the same engine's vanilla mode (with the decoding
  core's ``generate`` timed in the same rounds as a cross-check) at batch 1, 2, 4, 8 with the accepted tokens per
  round. The drafter goes to ``<out>/drafters/<name>.npz`` (``jaxsys.assets``: float16 weights and
  the draft vocabulary's ids, with the settings; ``drafter_from_asset`` rebuilds it), the rows to
  ``<out>/tlt_speedup/result.json``.
* ``grpo``: parts ``grpo`` with that drafter restored (``JAXSYS_TLT_DRAFTER``; with ``--phases
  grpo`` the asset ``--drafter``): 10 GRPO steps each of TLT and the vanilla rollout, interleaved,
  4 prompts x G = 4: step time, rollout share f (and its Amdahl bound), accepted tokens per round
  of the frozen and the online drafter; ``<out>/tlt_grpo/result.json``. It starts only with
  ``--grpo-min-seconds`` left.

Scratch (plots, orbax checkpoints, the engine's compilation cache) goes to ``--work`` (default
``$JAXSYS_HOME/accel-work``, so a rerun on the same machine reuses the compiled executables).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import time
from pathlib import Path
from unittest import mock

import numpy as np

from experiments import _tlt_smollm2 as T
from experiments.accel import MODEL, Budget, add_common_args, device_note, stand_in, work_dir

DEFAULT_NAME = f"{MODEL}-eagle"
PHASES = ("drafter", "grpo")
# --smoke: every size of the experiment's config at its smallest (tiny stand-in model, CPU)
SMOKE = dict(max_new=8, warm_rollouts=2, warm_batch=2, warm_steps=2, draft_vocab=64, batches=(1, 2),
             repeats=1, items=(2, 3), grpo_steps=2, prompts_per_step=4, group_size=2, spot_steps=1,
             online_buffer=2, n_eval=1)


def drafter_arrays(drafter) -> dict[str, np.ndarray]:
  """The drafter's state, one array per state path; floating weights as float16 (an error names a
  weight float16 cannot hold)."""
  import jax
  from flax import nnx
  out = {}
  for p, x in jax.tree_util.tree_flatten_with_path(nnx.state(drafter))[0]:
    key, x = jax.tree_util.keystr(p), np.asarray(x)
    if np.issubdtype(x.dtype, np.floating):
      if not np.all(np.abs(x) < np.finfo(np.float16).max):
        raise ValueError(f"drafter weight {key} has values float16 cannot hold (max |x| {np.abs(x).max():.3g})")
      x = x.astype(np.float16)
    out[key] = x
  return out


def target_config(smoke: bool):
  """The policy's ``DecoderConfig`` (read from the GGUF's metadata; the stand-in's with ``smoke``)."""
  from jaxsys.models.llm.interop.gguf import config_from_gguf
  from jaxsys.models.llm.interop.pretrained import model_path
  return stand_in()[0].config if smoke else config_from_gguf(model_path(MODEL))


def drafter_from_asset(spec: str, target_config):
  """An ``EagleDrafter`` for a target of ``target_config`` from a drafter asset (a name in
  ``jaxsys.assets``, or a ``.../drafters/<name>.npz`` path); state paths and shapes are checked."""
  import jax
  import jax.numpy as jnp
  from flax import nnx

  import jaxsys.assets as A
  from jaxsys.models.llm.drafter import DrafterConfig, EagleDrafter
  p = Path(spec)
  arrays, meta = A.read_arrays("drafters", p.stem, p.parents[1]) if p.suffix == ".npz" else \
      A.read_arrays("drafters", spec)
  cfg = DrafterConfig.for_target(target_config, draft_vocab=meta.get("draft_vocab"))
  gdef, state = nnx.split(nnx.eval_shape(lambda: EagleDrafter(cfg, rngs=nnx.Rngs(0))))
  leaves, treedef = jax.tree_util.tree_flatten_with_path(state)
  keys = [jax.tree_util.keystr(k) for k, _ in leaves]
  if sorted(keys) != sorted(arrays):
    raise ValueError(f"drafter asset {spec}: state paths {sorted(arrays)} are not the target's drafter's {sorted(keys)}")
  vals = []
  for k, (_, like) in zip(keys, leaves):
    if arrays[k].shape != like.shape:
      raise ValueError(f"drafter asset {spec}: {k} has shape {arrays[k].shape}, the target's drafter {like.shape}")
    vals.append(jnp.asarray(arrays[k], like.dtype))
  return nnx.merge(gdef, jax.tree_util.tree_unflatten(treedef, vals))


@contextlib.contextmanager
def _experiment(overrides: dict, smoke: bool, drafter_ckpt: str | None = None):
  """``_tlt_smollm2.run`` with ``overrides`` on its config (and, ``smoke``, the stand-in model)."""
  import jaxsys.models
  base = T._config
  with contextlib.ExitStack() as stack:
    stack.enter_context(mock.patch.object(T, "_config", lambda seed=0: {**base(seed), **overrides}))
    if smoke:
      stack.enter_context(mock.patch.object(jaxsys.models, "load_pretrained",
                                            lambda name, dtype=None: stand_in()))
    env = {"JAXSYS_TLT_DRAFTER": drafter_ckpt} if drafter_ckpt else {}
    stack.enter_context(mock.patch.dict(os.environ, env))
    if not drafter_ckpt:
      os.environ.pop("JAXSYS_TLT_DRAFTER", None)
    yield


def _keep(work: Path, out: Path, name: str, since: float) -> dict:
  """Copies the result.json the experiment wrote under ``work`` after ``since`` (its folder's name
  is not always ``name``: ``_tlt_smollm2.run`` reuses ``name`` as a loop variable in its speedup
  part) to ``out/<name>/``, prints its rows and returns it."""
  fresh = [p for p in work.glob("*/result.json") if p.stat().st_mtime >= since]
  if not fresh:
    raise FileNotFoundError(f"the experiment wrote no result.json under {work}")
  src = max(fresh, key=lambda p: p.stat().st_mtime)
  res = json.loads(src.read_text())
  (out / name).mkdir(parents=True, exist_ok=True)
  shutil.copyfile(src, out / name / "result.json")
  for r in res["rows"]:
    print(f"[tlt] {r['metric']}: ours {r.get('ours')} baseline {r.get('baseline')} ratio "
          f"{r.get('ratio')} ideal {r.get('ideal')} | {r.get('note', '')}", flush=True)
  return res


def drafter_phase(args, overrides, work: Path, out: Path) -> str:
  """Warm-up and speedup rows; writes the asset; returns the orbax checkpoint for ``grpo``."""
  import jaxsys.assets as A
  from jaxsys.models.llm.drafter import DrafterConfig
  from jaxsys.speculative.online import load_drafter
  t0 = time.time()
  with _experiment(overrides, args.smoke):
    T.run(str(work), parts=("speedup",), seed=args.seed, dtype=args.dtype)
  res = _keep(work, out, "tlt_speedup", t0)
  ckpt = max((work / "tlt_speedup" / "drafter_ckpt").glob("smollm2_*"), key=lambda p: p.stat().st_mtime)
  cfg = res["config"]
  drafter = load_drafter(ckpt, DrafterConfig.for_target(target_config(args.smoke), draft_vocab=cfg["draft_vocab"]))
  arrays = drafter_arrays(drafter)
  settings = dict(model=MODEL if not args.smoke else "smoke stand-in", checkpoint=str(ckpt), seed=args.seed,
                  heldout_top1=res.get("warm", {}).get("drafter_warm", {}).get("heldout_top1"),
                  **{k: cfg[k] for k in ("draft_vocab", "warm_rollouts", "warm_batch", "warm_steps",
                                         "temperature", "max_new", "items", "draft_coverage")},
                  weights=int(sum(a.size for a in arrays.values() if a.dtype == np.float16)), **device_note())
  path = A.write_arrays("drafters", args.name, arrays, settings, root=out)
  print(f"[tlt] wrote {path} ({path.stat().st_size / 1e6:.1f} MB)", flush=True)
  return str(ckpt)


def grpo_phase(args, overrides, work: Path, out: Path, ckpt: str | None) -> None:
  if ckpt is None:  # the drafter from an asset, as the checkpoint the experiment restores
    from jaxsys.speculative.online import save_drafter
    ckpt = str(work / "drafter_from_asset")
    save_drafter(ckpt, drafter_from_asset(args.drafter, target_config(args.smoke)))
  t0 = time.time()
  with _experiment(overrides, args.smoke, drafter_ckpt=ckpt):
    T.run(str(work), parts=("grpo",), seed=args.seed, dtype=args.dtype)
  _keep(work, out, "tlt_grpo", t0)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="python -m experiments.accel_tlt", description=__doc__.splitlines()[0])
  add_common_args(p, seconds=300)
  p.add_argument("--phases", default=",".join(PHASES), help=f"comma-separated, among {PHASES}")
  p.add_argument("--warm-rollouts", type=int, default=96, help="warm-up rollouts of 8 responses (default 96)")
  p.add_argument("--warm-steps", type=int, default=3000, help="drafter warm-up steps (default 3000)")
  p.add_argument("--grpo-min-seconds", type=float, default=120,
                 help="start the grpo phase only with this much time left (default 120)")
  p.add_argument("--drafter", default=DEFAULT_NAME, help="--phases grpo: drafter asset name or .npz path")
  p.add_argument("--name", default=DEFAULT_NAME, help=f"asset name of the trained drafter ({DEFAULT_NAME})")
  p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
  args = p.parse_args(argv)
  phases = [x for x in args.phases.split(",") if x]
  if not phases or set(phases) - set(PHASES):
    p.error(f"--phases={args.phases!r}: each must be one of {PHASES}")
  for name in ("warm_rollouts", "warm_steps"):
    if getattr(args, name) < 1:
      p.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
  budget = Budget(args.seconds)
  overrides = dict(SMOKE) if args.smoke else dict(warm_rollouts=args.warm_rollouts, warm_steps=args.warm_steps)
  work, out = work_dir(args), Path(args.out)
  ckpt = drafter_phase(args, overrides, work, out) if "drafter" in phases else None
  if "grpo" in phases:
    if budget.left() < args.grpo_min_seconds:
      print(f"[tlt] grpo skipped: {budget.left():.0f} s left, --grpo-min-seconds {args.grpo_min_seconds:g}",
            flush=True)
      return 3
    grpo_phase(args, overrides, work, out, ckpt)
  print(f"[tlt] done in {budget.spent():.0f} s", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
