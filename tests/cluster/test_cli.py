"""``jaxsys cluster`` subcommands."""

import json

from jaxsys.cluster import cli


def test_summary_and_diagnose(tmp_path, capsys):
  assert cli.main(["summary", "--gpu-num", "6212"]) == 0
  out = json.loads(capsys.readouterr().out)
  assert out["job_num"] == 8152 and out["gpu_num"] == 6212
  assert cli.main(["summary", "--compare"]) == 0
  table = capsys.readouterr().out
  assert "| avg_run_time_gpu |" in table and "Venus" in table
  log = tmp_path / "job.log"
  log.write_text("step 10 loss 1.2\nKeyError: 'labels'\n")
  assert cli.main(["diagnose", str(log), "--exit-code", "1"]) == 0
  d = json.loads(capsys.readouterr().out)
  assert (d["category"], d["kind"], d["retryable"]) == ("script", "key", False)


def test_simulate_and_sweep(tmp_path, capsys):
  assert cli.main(["simulate", "--policy", "qssf", "--estimator", "history", "--nodes", "3",
                   "--plot", str(tmp_path / "run.png")]) == 0
  out = capsys.readouterr().out
  metrics = json.loads(out[:out.index("plot:")])
  assert metrics["jobs"] == 3102 and metrics["avg_jct"] >= metrics["avg_queue"]
  assert (tmp_path / "run.png").stat().st_size > 0
  assert cli.main(["sweep", "--policies", "fifo", "sjf", "--nodes", "3", "--out", str(tmp_path / "s.json")]) == 0
  rows = json.loads((tmp_path / "s.json").read_text())
  assert [r["policy"] for r in rows] == ["fifo", "sjf"]
  assert rows[1]["avg_jct"] < rows[0]["avg_jct"]  # oracle SJF beats FIFO on the contended cluster
