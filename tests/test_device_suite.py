"""``python -m experiments.device --smoke``: the device suite's harness, in interpret mode on CPU.

The suite itself (compiled kernels, cuDNN and HBM-bound comparisons) needs a GPU or TPU; here
every part runs at tiny shapes, so a broken case or harness fails before an accelerator is spent."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_smoke_runs_every_part_and_writes_its_rows(tmp_path):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  r = subprocess.run([sys.executable, "-m", "experiments.device", "--smoke", "--out", str(tmp_path)],
                     cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
  saved = json.loads((tmp_path / "device_smoke" / "result.json").read_text())
  metrics = [row["metric"] for row in saved["rows"]]
  assert saved["config"]["failures"] == {}
  for part in ("attention causal 9/3 d=64 f32", "paged decode 32/8 d=128 bf16", "page scores 9/3",
               "graph tiles B=64", "quantized aggregation 2/4/8", "vs cuDNN", "all-visited layout",
               "HBM read bound", "vs f32 segment_sum"):
    assert any(part in m for m in metrics), part
  # correctness rows: the interpreted kernels agree with their XLA twins
  assert all(row["met"] for row in saved["rows"] if "max |kernel - xla|" in row["metric"])


def test_refuses_to_time_a_cpu_host():
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  r = subprocess.run([sys.executable, "-m", "experiments.device"], cwd=ROOT, env=env,
                     capture_output=True, text=True, timeout=120)
  assert r.returncode == 2 and "--smoke" in r.stderr
