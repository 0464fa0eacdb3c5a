"""A training process SIGKILLed five times (mid-save among others) and resumed each time ends
with parameters bit-identical to an uninterrupted run, and a clean checkpoint folder and log."""

import importlib.util
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np

from jaxsys import train as T
from jaxsys.core.checkpoint import Checkpointer

JOB = Path(__file__).with_name("_train_job.py")


def _job():
  spec = importlib.util.spec_from_file_location("_train_job", JOB)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


def test_sigkilled_training_resumes_bit_identical(tmp_path):
  job = _job()
  ref_model = job.Tiny()
  T.train(ref_model, job.batches, job.CFG, loss_fn=job.loss_fn, progress=False)
  ref = job.params(ref_model)

  rng = np.random.default_rng(0)
  # Five kills: two at exact points of a save (before orbax's commit rename, before the
  # manifest's rename) and three on timers that land anywhere in a save or the next step.
  # Each attempt advances at most 3 steps, so 5 kills never reach job.STEPS (20).
  kills = [["--kill-at", f"{rng.integers(1, 3)}:commit"],
           ["--kill-at", f"{rng.integers(1, 3)}:manifest"]]
  kills += [["--kill-timer", f"{rng.integers(1, 3)}:{rng.uniform(0, 0.08):.3f}"] for _ in range(3)]
  kills = [kills[i] for i in rng.permutation(len(kills))]
  env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "xla"),  # compile once
         "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
         "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}
  work, out = tmp_path / "run", tmp_path / "final.npz"
  logs = []
  for args in kills + [[]]:
    p = subprocess.run([sys.executable, str(JOB), str(work), str(out), *args], env=env,
                       capture_output=True, text=True, timeout=300)
    logs.append(p.stdout + p.stderr)
    want = 0 if not args else -signal.SIGKILL
    assert p.returncode == want, f"{args}: rc={p.returncode}\n{logs[-1][-3000:]}"

  final = np.load(out)
  assert sorted(final.files) == sorted(ref)
  for k, v in ref.items():
    np.testing.assert_array_equal(final[k], v, err_msg=k)  # bit for bit
  firsts = [int(line.split()[-1]) for log in logs for line in log.splitlines()
            if line.startswith("first step")]
  assert firsts[0] == 1 and firsts[-1] > 1 and len(set(firsts)) > 2  # really resumed
  # the kill before the manifest's rename left a step without one; the next start skipped it
  after = kills.index(next(k for k in kills if k[1].endswith(":manifest"))) + 1
  assert "no manifest" in logs[after], logs[after][-3000:]
  rows = [json.loads(line)["step"] for line in (work / "metrics.jsonl").read_text().splitlines()]
  assert rows == list(range(1, job.STEPS + 1))  # each step once, none torn
  ck = Checkpointer(work / "checkpoints", max_to_keep=2)
  assert ck.intact_steps() == [job.STEPS - 1, job.STEPS] == ck.all_steps()
  assert not [p.name for p in ck.directory.iterdir() if "tmp" in p.name]
