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


SUBCOMMANDS = ("summary", "simulate", "sweep", "ces", "diagnose", "supervise")


def test_help_for_the_group_and_each_subcommand(capsys):
  assert cli.main(["--help"]) == 0
  out = capsys.readouterr().out
  assert out.startswith("usage: jaxsys cluster") and all(s in out for s in SUBCOMMANDS)
  for sub in SUBCOMMANDS:
    assert cli.main([sub, "--help"]) == 0, sub
    assert capsys.readouterr().out.startswith(f"usage: jaxsys cluster {sub}"), sub


def test_user_errors_are_one_line_with_exit_2(tmp_path, capsys):
  bad = tmp_path / "pods.csv"
  bad.write_text("name,cpu_milli,memory_mib,num_gpu,pod_phase,creation_time,deletion_time,scheduled_time\n"
                 "p0,1000,10,one,Running,0,10,5\n")
  cases = {
      ("summary", str(tmp_path / "absent.csv")): "absent.csv does not exist",
      ("summary", str(bad)): "row 2 column 'num_gpu': is not a number",
      ("summary", str(bad), "--format", "nope"): "fmt='nope' must be one of",
      ("summary", str(tmp_path)): "Is a directory",
      ("diagnose", str(tmp_path / "absent.log")): "No such file or directory",
      ("ces", str(tmp_path / "absent.csv")): "does not exist",
      ("simulate", "--nodes", "abc"): "argument --nodes: invalid int value: 'abc'",
      ("simulate", "--policy", "nope"): "policy='nope' must be one of",
      ("simulate", "--policy", "qssf", "--estimator", "nope"): "--estimator 'nope' must be one of",
      ("sweep", "--nodes", "0"): "nodes=0",
      ("supervise", "--ckpt-dir", str(tmp_path / "ck")): "needs a command after --",
      ("supervise", "--ckpt-dir", str(tmp_path / "ck"), "--max-restarts", "-1", "--", "true"):
          "max_restarts=-1 must be >= 0",
      ("summary", "--no-such-option"): "unrecognized arguments: --no-such-option",
      (): "required: cmd",
  }
  for argv, expected in cases.items():
    assert cli.main(list(argv)) == 2, argv
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("jaxsys cluster") and expected in err, (argv, err)


def test_module_entry_point_reports_errors_without_traceback(tmp_path):
  import subprocess
  import sys
  proc = subprocess.run([sys.executable, "-m", "jaxsys.cluster.cli", "summary", str(tmp_path / "x.csv")],
                        capture_output=True, text=True, timeout=60)
  assert proc.returncode == 2 and "Traceback" not in proc.stderr
  assert proc.stderr.strip().splitlines() == [
      f"jaxsys cluster summary: error: trace file {tmp_path / 'x.csv'} does not exist"]
