"""Fault-tolerant training supervisor (Acme, NSDI'24, Sec. 6): detect, diagnose, recover.

``supervise(job, ckpt_dir=...)`` runs a training job -- a command (subprocess) or a function
(in-process) -- and watches three failure signals:

* the job exits non-zero (or raises, in-process);
* the heartbeat reports a NaN / infinite loss;
* the heartbeat stalls for ``heartbeat_timeout`` seconds (hang, lost node).

On a failure it diagnoses the cause from the job's log (``diagnosis.diagnose``), deletes
checkpoints newer than the last step with a finite loss (so the job restores the latest *good*
checkpoint), and restarts the job when the failure is retryable, up to ``max_restarts`` times.
Non-retryable failures (OOM, script errors) end the run with a report. The report records per
attempt: the detected failure, diagnosis, steps lost (last heartbeat step - step restored by
the next attempt) and recovery time (failure detected -> first new training step).

Job contract: it resumes from the latest checkpoint in ``ckpt_dir`` and reports heartbeats.
A command receives ``JAXSYS_CKPT_DIR`` and ``JAXSYS_HEARTBEAT`` (a JSON file path) in its
environment and rewrites that file atomically each step with ``{"step", "loss", "restored",
"time"}`` and optionally ``"first_bad"`` (first step with a non-finite loss, so a NaN between two
polls is not missed); a function receives a :class:`JobContext` (``ctx.ckpt_dir``, ``ctx.heartbeat``).

Usage::

  report = supervise([sys.executable, "-m", "jaxsys.cluster.demo_job", "--steps", "60"],
                     ckpt_dir="/tmp/ck", heartbeat_timeout=30)
  print(report.success, [a.diagnosis.kind for a in report.attempts if a.diagnosis])
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import subprocess
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path

from jaxsys.cluster.diagnosis import Diagnosis, ModelDiagnoser, diagnose
from jaxsys.core.errors import ConfigError


class NaNLoss(FloatingPointError):
  pass


class JobStalled(RuntimeError):
  pass


@dataclasses.dataclass
class Attempt:
  index: int
  restored_step: int | None = None  # step the attempt resumed from (None until it reports)
  last_step: int = 0                # last step with a heartbeat
  last_good_step: int = 0           # last step whose loss was finite
  detected: str | None = None       # None (success) | exit | nan | stall
  exit_code: int | None = None
  diagnosis: Diagnosis | None = None
  lost_steps: int | None = None     # filled when the next attempt restores
  recovery_s: float | None = None   # failure detected -> first training step of the next attempt
  wall_s: float = 0.0
  detected_at: float | None = None


@dataclasses.dataclass
class SupervisorReport:
  success: bool
  attempts: list[Attempt]
  reason: str
  result: object = None

  @property
  def failures(self) -> list[Attempt]:
    return [a for a in self.attempts if a.detected]

  def summary(self) -> str:
    lines = [f"success={self.success} attempts={len(self.attempts)}: {self.reason}"]
    for a in self.attempts:
      d = a.diagnosis
      lines.append(f"  #{a.index}: restored={a.restored_step} last_step={a.last_step} "
                   f"detected={a.detected} exit={a.exit_code} "
                   f"diagnosis={(d.category + '/' + d.kind) if d else '-'} "
                   f"retryable={d.retryable if d else '-'} lost_steps={a.lost_steps} "
                   f"recovery_s={None if a.recovery_s is None else round(a.recovery_s, 2)}")
    return "\n".join(lines)


class JobContext:
  """What an in-process job gets: checkpoint folder, heartbeat callback, attempt index."""

  def __init__(self, ckpt_dir: str, attempt: Attempt, on_beat: Callable):
    self.ckpt_dir, self.attempt, self._on_beat = ckpt_dir, attempt, on_beat
    self.cancelled = False
    self.log_lines: list[str] = []

  def log(self, msg: str):
    self.log_lines.append(str(msg))

  def heartbeat(self, step: int, loss: float, restored: int = 0):
    if self.cancelled:
      raise JobStalled(f"heartbeat stalled: job cancelled by the supervisor at step {step}")
    self._on_beat(step, loss, restored)
    if not math.isfinite(loss):
      raise NaNLoss(f"NaN loss at step {step}: loss became {loss}")


def prune_checkpoints(ckpt_dir: str | os.PathLike, keep_upto: int) -> list[int]:
  """Deletes checkpoint step folders newer than ``keep_upto``; returns the deleted steps."""
  removed = []
  root = Path(ckpt_dir)
  if not root.exists():
    return removed
  for p in root.iterdir():
    if p.is_dir() and p.name.isdigit() and int(p.name) > keep_upto:
      shutil.rmtree(p, ignore_errors=True)
      removed.append(int(p.name))
  return sorted(removed)


class _Beats:
  """Tracks heartbeats of one attempt."""

  def __init__(self, attempt: Attempt, prev: Attempt | None):
    self.attempt, self.prev = attempt, prev
    self.last_time = time.monotonic()
    self.first_bad: int | None = None
    self.startup_timeout = 600.0

  def stalled(self, heartbeat_timeout: float) -> bool:
    """No heartbeat for ``heartbeat_timeout`` s (``startup_timeout`` before the first one)."""
    limit = heartbeat_timeout if self.attempt.restored_step is not None else self.startup_timeout
    return time.monotonic() - self.last_time > limit

  def beat(self, step: int, loss: float, restored: int):
    a = self.attempt
    self.last_time = time.monotonic()
    if a.restored_step is None:
      a.restored_step = int(restored)
      if self.prev is not None:
        self.prev.lost_steps = max(self.prev.last_step - int(restored), 0)
        if self.prev.detected_at is not None:
          self.prev.recovery_s = time.monotonic() - self.prev.detected_at
    a.last_step = int(step)
    if math.isfinite(loss):
      if self.first_bad is None:
        a.last_good_step = int(step)
    elif self.first_bad is None:
      self.first_bad = int(step)

  def mark_bad(self, step: int):
    if self.first_bad is None or step < self.first_bad:
      self.first_bad = step
      self.attempt.last_good_step = min(self.attempt.last_good_step, step - 1)


def _read_heartbeat(path: Path) -> dict | None:
  try:
    hb = json.loads(path.read_text())
  except (OSError, json.JSONDecodeError):
    return None
  hb["loss"] = float(hb["loss"])
  return hb


def _run_command(cmd, attempt, beats, env, log_path, hb_path, heartbeat_timeout, poll):
  if hb_path.exists():
    hb_path.unlink()
  with open(log_path, "a") as log:
    log.write(f"\n===== attempt {attempt.index} =====\n")
    log.flush()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                            shell=isinstance(cmd, str))
    seen = None
    while True:
      code = proc.poll()
      hb = _read_heartbeat(hb_path)
      if hb is not None and hb.get("time") != seen:
        seen = hb.get("time")
        beats.beat(hb["step"], hb["loss"], hb.get("restored", 0))
        if hb.get("first_bad") is not None:  # a NaN beat we may have missed between polls
          beats.mark_bad(int(hb["first_bad"]))
      if code is not None:
        attempt.exit_code = code
        if beats.first_bad is not None:
          return "nan"
        return "exit" if code != 0 else None
      if beats.first_bad is not None:
        proc.kill()
        proc.wait()
        attempt.exit_code = proc.returncode
        return "nan"
      if beats.stalled(heartbeat_timeout):
        proc.kill()
        proc.wait()
        attempt.exit_code = proc.returncode
        return "stall"
      time.sleep(poll)


def _run_function(fn, attempt, beats, ckpt_dir, heartbeat_timeout, poll):
  ctx = JobContext(ckpt_dir, attempt, beats.beat)
  box = {}

  def target():
    try:
      box["result"] = fn(ctx)
    except BaseException as e:  # noqa: BLE001 - the supervisor classifies every failure
      box["error"] = e
      box["log"] = "\n".join(ctx.log_lines + [traceback.format_exc()])

  th = threading.Thread(target=target, daemon=True, name=f"supervised-attempt-{attempt.index}")
  th.start()
  while th.is_alive():
    th.join(poll)
    if th.is_alive() and beats.stalled(heartbeat_timeout):
      ctx.cancelled = True
      th.join(heartbeat_timeout)
      if th.is_alive():
        box["log"] = "job hung: heartbeat stalled and the job ignored cancellation"
        return "stall", box
      box.setdefault("log", "heartbeat stalled")
      return "stall", box
  if "error" in box:
    return ("nan" if isinstance(box["error"], NaNLoss) else
            "stall" if isinstance(box["error"], JobStalled) else "exit"), box
  return None, box


def supervise(job: Sequence[str] | str | Callable, *, ckpt_dir: str | os.PathLike,
              workdir: str | os.PathLike | None = None, max_restarts: int = 5,
              heartbeat_timeout: float = 60.0, startup_timeout: float = 600.0, poll: float = 0.05,
              model: ModelDiagnoser | None = None, env: dict | None = None) -> SupervisorReport:
  """Runs ``job`` until it succeeds, fails non-retryably, or exhausts ``max_restarts``.

  ``startup_timeout`` bounds the time to the first heartbeat of an attempt (imports, restore,
  compilation); ``heartbeat_timeout`` the gap between later heartbeats.
  """
  if max_restarts < 0:
    raise ConfigError(f"{max_restarts=} must be >= 0")
  if heartbeat_timeout <= 0:
    raise ConfigError(f"{heartbeat_timeout=} must be positive")
  ckpt_dir = os.path.abspath(ckpt_dir)
  workdir = Path(workdir or Path(ckpt_dir).parent / "supervisor")
  workdir.mkdir(parents=True, exist_ok=True)
  log_path, hb_path = workdir / "job.log", workdir / "heartbeat.json"
  attempts: list[Attempt] = []
  for i in range(max_restarts + 1):
    attempt = Attempt(index=i)
    beats = _Beats(attempt, attempts[-1] if attempts else None)
    beats.startup_timeout = startup_timeout
    attempts.append(attempt)
    t0 = time.monotonic()
    if callable(job):
      detected, box = _run_function(job, attempt, beats, ckpt_dir, heartbeat_timeout, poll)
      log_text = box.get("log", "")
      result = box.get("result")
    else:
      run_env = dict(os.environ if env is None else env)
      run_env.update(JAXSYS_CKPT_DIR=ckpt_dir, JAXSYS_HEARTBEAT=str(hb_path))
      start = log_path.stat().st_size if log_path.exists() else 0
      detected = _run_command(job, attempt, beats, run_env, log_path, hb_path, heartbeat_timeout, poll)
      with open(log_path) as f:
        f.seek(start)
        log_text = f.read()
      result = None
    attempt.wall_s = time.monotonic() - t0
    attempt.detected = detected
    if detected is None:
      return SupervisorReport(True, attempts, f"finished after {i} restart(s)", result)
    attempt.detected_at = time.monotonic()
    if detected == "nan":
      attempt.diagnosis = diagnose(f"NaN loss at step {beats.first_bad}", model=None)
    elif detected == "stall":
      attempt.diagnosis = diagnose(log_text + "\nstalled heartbeat: no progress for "
                                   f"{heartbeat_timeout}s", attempt.exit_code, model)
    else:
      attempt.diagnosis = diagnose(log_text, attempt.exit_code, model)
    if detected == "nan":
      # Restart from the latest good checkpoint: drop those taken at or after the NaN step.
      prune_checkpoints(ckpt_dir, beats.first_bad - 1)
    if not attempt.diagnosis.retryable:
      return SupervisorReport(False, attempts, f"non-retryable {attempt.diagnosis.category} failure "
                              f"({attempt.diagnosis.kind}): {attempt.diagnosis.evidence}")
  return SupervisorReport(False, attempts, f"gave up after {max_restarts} restarts")
