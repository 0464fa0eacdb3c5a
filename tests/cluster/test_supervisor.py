"""The supervisor never gets stuck: malformed heartbeats, its own failure (exception, Ctrl-C,
SIGTERM), jobs that leave processes behind, commands that do not exist, corrupted checkpoints.

Jobs here are tiny Python scripts (no JAX) with heartbeats every few tens of milliseconds.
"""

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jaxsys.cluster import cli, supervisor
from jaxsys.cluster.supervisor import supervise
from jaxsys.core.errors import ConfigError

# A job: optionally ignores SIGTERM, starts a grandchild, writes "<pid> <grandchild pid>" to
# argv[1], then beats forever (or writes the beats given as JSON in argv[3] and exits 0).
JOB = r"""
import json, os, signal, subprocess, sys, time
pids, mode = sys.argv[1], sys.argv[2]
if mode == "ignore-term":
  signal.signal(signal.SIGTERM, signal.SIG_IGN)  # inherited by the grandchild across exec
grand = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
with open(pids + ".tmp", "w") as f:
  f.write(f"{os.getpid()} {grand.pid}")
os.replace(pids + ".tmp", pids)
hb = os.environ["JAXSYS_HEARTBEAT"]

def write(text):
  with open(hb + ".tmp", "w") as f:
    f.write(text)
  os.replace(hb + ".tmp", hb)

if mode == "beats":
  for text in json.loads(sys.argv[3]):
    write(text)
    time.sleep(0.15)
  sys.exit(0)
step = 0
while True:
  step += 1
  write(json.dumps({"step": step, "loss": "abc" if mode == "bad-beats" else 1.0, "time": time.time()}))
  time.sleep(0.05)
"""


@pytest.fixture
def job(tmp_path):
  """job(mode, *args) -> (command, pids file); kills what is left of the jobs at teardown."""
  made = []

  def make(mode, *extra):
    script = tmp_path / "job.py"
    script.write_text(JOB)
    pids = tmp_path / f"pids{len(made)}"
    made.append(pids)
    return [sys.executable, str(script), str(pids), mode, *extra], pids

  yield make
  for pids in made:
    for p in (int(p) for p in pids.read_text().split()) if pids.exists() else ():
      if _alive(p):
        os.kill(p, signal.SIGKILL)


def _alive(pid: int) -> bool:
  try:
    stat = Path(f"/proc/{pid}/stat").read_text()
  except OSError:
    return False
  return stat.rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited


def _assert_gone(pids_file: Path, timeout: float = 5.0):
  pids = [int(p) for p in pids_file.read_text().split()]
  deadline = time.monotonic() + timeout
  while any(map(_alive, pids)) and time.monotonic() < deadline:
    time.sleep(0.05)
  left = [p for p in pids if _alive(p)]
  assert not left, f"processes {left} of the job outlived the supervisor"


def _wait_for(path: Path, timeout: float = 10.0):
  deadline = time.monotonic() + timeout
  while not path.exists():
    assert time.monotonic() < deadline, f"{path} never appeared"
    time.sleep(0.02)


@pytest.mark.parametrize("exc,mode,kw", [(RuntimeError, "beat", {}), (KeyboardInterrupt, "beat", {}),
                                         (RuntimeError, "ignore-term", {"kill_grace": 0.3})],
                         ids=["exception", "keyboard-interrupt", "job-ignores-sigterm"])
def test_supervisor_failure_stops_the_job_process_group(tmp_path, job, monkeypatch, exc, mode, kw):
  cmd, pids = job(mode)

  def fail_once_running(self, heartbeat_timeout):
    if pids.exists() and self.attempt.restored_step is not None:
      raise exc("failure inside the supervisor loop")
    return False

  monkeypatch.setattr(supervisor._Beats, "stalled", fail_once_running)
  with pytest.raises(exc, match="inside the supervisor"):
    supervise(cmd, ckpt_dir=tmp_path / "ck", heartbeat_timeout=30, poll=0.02, **kw)
  _assert_gone(pids)


def test_sigterm_to_the_supervisor_stops_the_job(tmp_path, job):
  cmd, pids = job("beat")
  sup = subprocess.Popen([sys.executable, "-m", "jaxsys.cluster.cli", "supervise", "--ckpt-dir",
                          str(tmp_path / "ck"), "--", *cmd], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
  try:
    _wait_for(pids)
    sup.send_signal(signal.SIGTERM)
    out, err = sup.communicate(timeout=20)
  finally:
    if sup.poll() is None:
      sup.kill()
  _assert_gone(pids)
  assert sup.returncode == 128 + signal.SIGTERM, (out, err)
  assert "Traceback" not in err
  assert f"job log: {tmp_path / 'supervisor' / 'job.log'}" in out


def test_a_finished_job_leaves_no_process_behind(tmp_path, job):
  cmd, pids = job("beats", json.dumps([json.dumps({"step": 1, "loss": 0.5})]))
  rep = supervise(cmd, ckpt_dir=tmp_path / "ck", heartbeat_timeout=30, poll=0.02)
  assert rep.success and rep.attempts[0].last_step == 1, rep.summary()
  _assert_gone(pids)  # the grandchild it started and never waited for


def test_malformed_heartbeats_are_logged_missed_beats(tmp_path, job, caplog):
  beats = ["{not json", json.dumps({"step": 1, "loss": "abc"}), json.dumps({"step": 2}),
           json.dumps([3, 0.5]), json.dumps({"step": "four", "loss": 0.5}),
           json.dumps({"step": 3, "loss": 0.25, "time": 1.0})]
  cmd, _ = job("beats", json.dumps(beats))
  with caplog.at_level(logging.WARNING, logger=supervisor.__name__):
    rep = supervise(cmd, ckpt_dir=tmp_path / "ck", heartbeat_timeout=30, poll=0.01)
  a = rep.attempts[0]
  assert rep.success and a.last_step == 3 and a.restored_step == 0, rep.summary()
  assert 1 <= a.malformed_beats <= 5
  assert "malformed heartbeat" in caplog.text and "'loss' is missing or not a number" in caplog.text
  # Only malformed beats: no progress, so the job is stopped as stalled (never a crash).
  cmd, pids = job("bad-beats")
  rep = supervise(cmd, ckpt_dir=tmp_path / "ck2", max_restarts=0, startup_timeout=1.5, poll=0.02)
  a = rep.attempts[0]
  assert not rep.success and a.detected == "stall" and a.malformed_beats >= 1, rep.summary()
  _assert_gone(pids)
  # In-process jobs: a heartbeat with a malformed loss is counted the same way.

  def fn(ctx):
    ctx.heartbeat(1, "abc")
    ctx.heartbeat(2, 0.5)
    return "done"

  rep = supervise(fn, ckpt_dir=tmp_path / "ck3", heartbeat_timeout=30)
  assert rep.success and rep.result == "done" and rep.attempts[0].malformed_beats == 1


def test_missing_command_is_a_one_line_error(tmp_path, capsys):
  with pytest.raises(ConfigError, match="'no-such-command-jaxsys' was not found on PATH"):
    supervise(["no-such-command-jaxsys", "--x"], ckpt_dir=tmp_path / "ck")
  script = tmp_path / "train.sh"
  script.write_text("echo hi\n")  # not executable
  with pytest.raises(ConfigError, match="is not executable"):
    supervise([str(script)], ckpt_dir=tmp_path / "ck")
  with pytest.raises(ConfigError, match="does not exist"):
    supervise([str(tmp_path / "absent.sh")], ckpt_dir=tmp_path / "ck")
  assert cli.main(["supervise", "--ckpt-dir", str(tmp_path / "ck"), "--", "no-such-command-jaxsys"]) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and "'no-such-command-jaxsys' was not found" in err


def test_job_log_is_printed_and_settable(tmp_path, capsys):
  log = tmp_path / "logs" / "train.log"
  job = [sys.executable, "-c", "print('hello from the job')"]
  assert cli.main(["supervise", "--ckpt-dir", str(tmp_path / "ck"), "--log", str(log), "--", *job]) == 0
  out = capsys.readouterr().out
  assert f"job log: {log}" in out and "success=True" in out
  assert "hello from the job" in log.read_text()
