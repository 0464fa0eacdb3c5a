"""The accelerator jobs, one entry: each job in its own process, under one time budget.

  python -m experiments.accel --jobs gates,tlt --seconds 420 --out "$OUT"    # on the GPU machine
  python -m experiments.accel --jobs gates,tlt --seconds 120 --smoke --out runs/accel_smoke  # CPU
  python -m experiments.accel collect DIR     # here: check what came back, copy the assets in

Jobs (``JOBS``; each module runs alone too, ``python -m <module> --help``):

* ``gates`` (``experiments.accel_gates``): DuoAttention gate distillation on SmolLM2 at 8K tokens,
  several documents per step, as many steps as fit its share; writes the gates asset
  (``gates/<name>.json``, ``jaxsys.assets``) and its rows; passkey at 2K-8K if asked and time allows.
* ``tlt`` (``experiments.accel_tlt``): the EAGLE drafter trained on SmolLM2 rollouts (the tlt
  experiment's warm-up, more data), the batch-1..8 speculative speedups, saved as a drafter asset
  (``drafters/<name>.npz``); then the GRPO comparison, TLT vs the vanilla rollout, at the tlt
  experiment's full settings.

The budget (``--seconds``) is shared out in order: each job gets ``weight / (weights left)`` of the
time left when it starts (so a job that finishes early leaves its time to the next), plans its
phases inside it, and is stopped ``GRACE`` seconds after it. Everything a job keeps lands flat in
``--out`` (the device returns at most 8 files, 2 folders down): ``accel.log`` (every job's output),
``accel.json`` (per job: exit status, seconds), and the jobs' assets and ``result.json`` files;
their scratch (plots, checkpoints) goes to ``--work``. Arguments the runner does not know go to
every job (so name one job with them: ``--jobs gates --batch-size 2``). ``--smoke`` runs every job on a tiny
random model with SmolLM2's tokenizer at tiny sizes, on CPU (tests/test_accel_jobs.py).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

__all__ = ["Budget", "GRACE", "JOBS", "add_common_args", "collect", "device_note", "main", "run_jobs", "stand_in", "work_dir"]

JOBS = {"gates": ("experiments.accel_gates", 1.0), "tlt": ("experiments.accel_tlt", 1.2)}
GRACE = 20          # seconds a job may run past its share before it is stopped
MIN_SHARE = 10      # a job whose share would be shorter is skipped
MODEL = "smollm2-135m-instruct"


class Budget:
  """Seconds left of ``seconds`` from construction."""

  def __init__(self, seconds: float):
    if not seconds > 0:
      raise ValueError(f"seconds={seconds} must be > 0")
    self.seconds, self.t0 = float(seconds), time.perf_counter()

  def spent(self) -> float:
    return time.perf_counter() - self.t0

  def left(self) -> float:
    return self.seconds - self.spent()


def add_common_args(p: argparse.ArgumentParser, seconds: float) -> None:
  p.add_argument("--seconds", type=float, default=seconds, help=f"time budget (default {seconds:g})")
  p.add_argument("--out", default=os.environ.get("OUT") or "runs/accel",
                 help="where the kept files go (default $OUT, else runs/accel)")
  p.add_argument("--work", default=None, help="scratch folder (default $JAXSYS_HOME/accel-work)")
  p.add_argument("--smoke", action="store_true", help="tiny random model, tiny sizes (CPU, seconds)")
  p.add_argument("--seed", type=int, default=0)


@functools.cache
def _tokenizer():
  from jaxsys.models.llm.interop.gguf import load_tokenizer
  from jaxsys.models.llm.interop.pretrained import model_path
  return load_tokenizer(model_path(MODEL))


def stand_in(max_positions: int = 1024):
  """``(model, tokenizer)`` for ``--smoke``: a new 2-layer random decoder (GQA 4/2, hidden 64) over
  SmolLM2's tokenizer and vocabulary, so every text path (chat template, passkey prompts) runs."""
  from jaxsys.models import DecoderConfig
  from jaxsys.models.llm.decoder import random_model
  tok = _tokenizer()
  cfg = DecoderConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_layers=2,
                      num_heads=4, num_kv_heads=2, max_position_embeddings=max_positions,
                      tie_embeddings=True, eos_token_id=tok.eos_token_id)
  return random_model(cfg, seed=0), tok


def device_note() -> dict:
  import jax
  return {"device": jax.devices()[0].device_kind, "backend": jax.default_backend(), "jax": jax.__version__}


def work_dir(args) -> Path:
  """``--work``, else ``$JAXSYS_HOME/accel-work[-smoke]`` (kept: a rerun reuses its compiled executables)."""
  from jaxsys.models.llm.interop.pretrained import cache_dir
  return Path(args.work) if args.work else cache_dir() / ("accel-work-smoke" if args.smoke else "accel-work")


def run_jobs(jobs, seconds: float, out: Path, smoke: bool = False, extra=()) -> dict:
  """Runs ``jobs`` in order, each in its own process with its share of ``seconds``; returns
  ``{job: {"rc", "seconds", "share"}}`` (also written to ``out/accel.json``)."""
  from jaxsys.experiments import child_env
  budget = Budget(seconds)
  out.mkdir(parents=True, exist_ok=True)
  summary = {}
  env = dict(child_env(argparse.Namespace(compile_cache=None)), JAXSYS_NO_PROGRESS="1")
  with open(out / "accel.log", "a") as log:
    for i, job in enumerate(jobs):
      weights = [JOBS[j][1] for j in jobs[i:]]
      share = budget.left() * weights[0] / sum(weights)
      if share < MIN_SHARE:
        summary[job] = {"rc": None, "note": f"skipped: {budget.left():.0f} s left"}
        continue
      cmd = [sys.executable, "-m", JOBS[job][0], "--seconds", f"{share:.0f}", "--out", str(out),
             *(["--smoke"] if smoke else []), *extra]
      print(f"[accel] {job}: {' '.join(cmd[1:])}", flush=True)
      log.write(f"\n[accel] {job}: {' '.join(cmd)}\n")
      log.flush()
      t0 = time.perf_counter()
      proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
      pump = threading.Thread(target=_pump, args=(proc.stdout, log), daemon=True)
      pump.start()
      try:
        rc = proc.wait(timeout=share + GRACE)
      except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        rc = "stopped past its share"
      pump.join(timeout=5)
      summary[job] = {"rc": rc, "seconds": round(time.perf_counter() - t0, 1), "share": round(share)}
      print(f"[accel] {job}: {summary[job]}", flush=True)
      log.write(f"[accel] {job}: {summary[job]}\n")
  (out / "accel.json").write_text(json.dumps(summary, indent=1))
  return summary


def _pump(stream, log) -> None:
  """Copies a job's output, line by line, to stdout and the log."""
  for line in stream:
    sys.stdout.write(line)
    sys.stdout.flush()
    log.write(line)
    log.flush()


def collect(src: Path, package: Path | None = None, runs: Path = Path("runs/accel")) -> list[str]:
  """Checks the files that came back (``src``: the run's files folder) and copies the assets into
  the package (``jaxsys/assets/<kind>/``) and everything else into ``runs``. Returns what it did."""
  import jaxsys.assets as A
  from jaxsys.serving.streaming import StreamingGates
  done = []
  for f in sorted(p for p in src.rglob("*") if p.is_file()):
    kind = f.parent.name
    if kind in A.KINDS and f.suffix == A.KINDS[kind]:
      if kind == "gates":
        StreamingGates.load(f)                     # a gates file the serving path reads
      made = A.settings(kind, f.stem, f.parents[1])  # (an intact .npz too)
      if made.get("model") != MODEL:
        raise ValueError(f"{f}: made by model {made.get('model')!r}, not {MODEL!r} (a --smoke run?); "
                         "not copied into the package")
      dest = (package or A.ROOT) / kind / f.name
    else:
      dest = runs / f.relative_to(src)
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(f, dest)
    done.append(f"{f} -> {dest}")
  return done


def main(argv=None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  if argv[:1] == ["collect"]:
    p = argparse.ArgumentParser(prog="python -m experiments.accel collect")
    p.add_argument("src", type=Path, help="the files that came back from the device ($OUT's copy)")
    p.add_argument("--runs", type=Path, default=Path("runs/accel"))
    a = p.parse_args(argv[1:])
    for line in collect(a.src, runs=a.runs):
      print(line)
    return 0
  p = argparse.ArgumentParser(prog="python -m experiments.accel", description=__doc__.splitlines()[0])
  p.add_argument("--jobs", default="gates,tlt", help=f"comma-separated, among {sorted(JOBS)}")
  p.add_argument("--seconds", type=float, default=420, help="budget for all jobs (default 420)")
  p.add_argument("--out", default=os.environ.get("OUT") or "runs/accel")
  p.add_argument("--smoke", action="store_true", help="tiny sizes on a tiny random model (CPU)")
  a, extra = p.parse_known_args(argv)
  jobs = [j for j in a.jobs.split(",") if j]
  bad = [j for j in jobs if j not in JOBS]
  if bad or not jobs:
    p.error(f"--jobs={a.jobs!r}: each job must be one of {sorted(JOBS)}")
  if not a.seconds > 0:
    p.error(f"--seconds={a.seconds} must be > 0")
  summary = run_jobs(jobs, a.seconds, Path(a.out), a.smoke, extra)
  return 0 if all(s.get("rc") == 0 for s in summary.values()) else 1


if __name__ == "__main__":
  sys.exit(main())
