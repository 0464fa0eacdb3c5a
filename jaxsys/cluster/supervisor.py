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

Guarantees (the torchrun / Kubernetes conventions):

* A command runs in its own session (process group). However an attempt ends -- success,
  failure, or the supervisor itself failing (an exception, KeyboardInterrupt, SIGTERM/SIGHUP) --
  the whole group gets SIGTERM, then SIGKILL after ``kill_grace`` seconds: no job is orphaned.
  SIGTERM/SIGHUP to the supervisor (main thread, signals at their default action) end it with
  exit status 128 + signal after that cleanup.
* A malformed heartbeat (not JSON, no numeric ``step`` / ``loss``) is logged and counted in
  ``Attempt.malformed_beats`` as a missed beat; enough of them in a row is a stall.
* Checkpoints: a job that saves with :class:`jaxsys.core.checkpoint.Checkpointer` (the demo job
  does) resumes from the newest *intact* checkpoint, so a corrupted or half-written newest one
  costs the steps since the previous one, not the run. After a NaN loss the supervisor deletes
  the checkpoints taken at or after the first bad step.
* A command that cannot be started (not found, not executable) raises ConfigError before
  anything runs. Its output goes to ``log_path`` (default ``<workdir>/job.log``; also in the
  report).

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

import atexit
import contextlib
import dataclasses
import json
import logging
import math
import os
import shutil
import signal
import subprocess
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path

from jaxsys.cluster.diagnosis import Diagnosis, ModelDiagnoser, diagnose
from jaxsys.core.errors import ConfigError

__all__ = [
    "Attempt", "check_command", "job_paths", "JobContext", "JobStalled", "NaNLoss",
    "parse_heartbeat", "prune_checkpoints", "supervise", "SupervisorReport", "SupervisorTerminated",
]

log = logging.getLogger(__name__)

# At most this many malformed heartbeats per attempt are logged one by one; all are counted.
_MALFORMED_LOGGED = 5


class NaNLoss(FloatingPointError):
  pass


class JobStalled(RuntimeError):
  pass


class SupervisorTerminated(SystemExit):
  """SIGTERM / SIGHUP reached the supervisor; the job's process group has been stopped."""

  def __init__(self, signum: int):
    super().__init__(128 + signum)
    self.signum = signum


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
  malformed_beats: int = 0          # heartbeats ignored as malformed (each a missed beat)


@dataclasses.dataclass
class SupervisorReport:
  success: bool
  attempts: list[Attempt]
  reason: str
  result: object = None
  log_path: str | None = None  # the job's output (commands only)

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
                   f"recovery_s={None if a.recovery_s is None else round(a.recovery_s, 2)}"
                   + (f" malformed_beats={a.malformed_beats}" if a.malformed_beats else ""))
    if self.log_path:
      lines.append(f"job log: {self.log_path}")
    return "\n".join(lines)


class JobContext:
  """What an in-process job gets: checkpoint folder, heartbeat callback, attempt index."""

  def __init__(self, ckpt_dir: str, attempt: Attempt, on_beat: Callable,
               on_malformed: Callable[[str], None] | None = None):
    self.ckpt_dir, self.attempt, self._on_beat = ckpt_dir, attempt, on_beat
    self._on_malformed = on_malformed
    self.cancelled = False
    self.log_lines: list[str] = []

  def log(self, msg: str):
    self.log_lines.append(str(msg))

  def heartbeat(self, step: int, loss: float, restored: int = 0):
    if self.cancelled:
      raise JobStalled(f"heartbeat stalled: job cancelled by the supervisor at step {step}")
    beat, why = parse_heartbeat({"step": step, "loss": loss, "restored": restored})
    if beat is None:  # a missed beat, like a malformed heartbeat file
      if self._on_malformed is not None:
        self._on_malformed(why)
      return
    self._on_beat(beat["step"], beat["loss"], beat["restored"])
    if not math.isfinite(beat["loss"]):
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


def _number(x) -> float | None:
  """``x`` as a float when it is a number (a 0-d array too) or a numeric string ("nan"
  included), else None."""
  if x is None or isinstance(x, (bool, bytes)):
    return None
  try:
    return float(x)
  except (TypeError, ValueError):
    return None


def _count(hb: dict, key: str, default=None) -> int | None:
  """A non-negative integer field (step, restored, first_bad) or None when malformed."""
  if hb.get(key) is None and default is not None:
    return default
  v = _number(hb.get(key))
  return int(v) if v is not None and math.isfinite(v) and v >= 0 and v == int(v) else None


def parse_heartbeat(hb) -> tuple[dict | None, str | None]:
  """(``{"step", "loss", "restored", "first_bad"}``, None) or (None, why it is malformed)."""
  if not isinstance(hb, dict):
    return None, f"not a JSON object ({type(hb).__name__})"
  step = _count(hb, "step")
  if step is None:
    return None, f"'step' is missing or not a non-negative integer ({hb.get('step')!r})"
  loss = _number(hb.get("loss"))
  if loss is None:
    return None, f"'loss' is missing or not a number ({hb.get('loss')!r})"
  restored = _count(hb, "restored", default=0)
  if restored is None:
    return None, f"'restored' is not a non-negative integer ({hb.get('restored')!r})"
  first_bad = None if hb.get("first_bad") is None else _count(hb, "first_bad")
  if hb.get("first_bad") is not None and first_bad is None:
    return None, f"'first_bad' is not a non-negative integer ({hb.get('first_bad')!r})"
  return {"step": step, "loss": loss, "restored": restored, "first_bad": first_bad}, None


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

  def malformed(self, why: str):
    """A malformed heartbeat: logged, counted, and otherwise a missed beat (no progress)."""
    a = self.attempt
    a.malformed_beats += 1
    if a.malformed_beats <= _MALFORMED_LOGGED:
      log.warning("attempt %d: ignoring malformed heartbeat #%d: %s", a.index, a.malformed_beats, why)
      if a.malformed_beats == _MALFORMED_LOGGED:
        log.warning("attempt %d: further malformed heartbeats are counted, not logged", a.index)

  def mark_bad(self, step: int):
    if self.first_bad is None or step < self.first_bad:
      self.first_bad = step
      self.attempt.last_good_step = min(self.attempt.last_good_step, step - 1)


def _poll_heartbeat(path: Path, beats: _Beats, seen: str | None) -> str | None:
  """Reads the heartbeat file; a new content is a beat or a malformed beat. Returns the content."""
  try:
    text = path.read_bytes().decode("utf-8", errors="replace")  # garbage is malformed, below
  except OSError:
    return seen  # not written yet: nothing new
  if text == seen:
    return seen
  try:
    beat, why = parse_heartbeat(json.loads(text))
  except json.JSONDecodeError as e:
    beat, why = None, f"not JSON ({e.msg} at char {e.pos})"
  if beat is None:
    beats.malformed(why)
    return text
  beats.beat(beat["step"], beat["loss"], beat["restored"])
  if beat["first_bad"] is not None:  # a NaN beat we may have missed between polls
    beats.mark_bad(beat["first_bad"])
  return text


# ------------------------------------------------------------------------ child process groups

_LIVE: set[subprocess.Popen] = set()  # commands running now, stopped at interpreter exit too


def _signal_group(pid: int, sig: int):
  try:
    os.killpg(pid, sig)  # the child leads its own session: its pgid is its pid
  except (ProcessLookupError, PermissionError):
    pass  # the group is gone


def _stop_group(proc: subprocess.Popen, grace: float):
  """SIGTERM the job's process group, SIGKILL whatever is left after ``grace`` s; reaps the job.

  Also runs after a job exited by itself: what it left running in its group is killed.
  """
  try:
    if proc.poll() is None:
      _signal_group(proc.pid, signal.SIGTERM)
      try:
        proc.wait(grace)
      except subprocess.TimeoutExpired:
        pass
  finally:
    _signal_group(proc.pid, signal.SIGKILL)
    proc.wait()
    _LIVE.discard(proc)


@atexit.register
def _stop_all():
  for proc in list(_LIVE):
    _stop_group(proc, 0.0)


@contextlib.contextmanager
def _terminate_raises():
  """While supervising, SIGTERM / SIGHUP raise :class:`SupervisorTerminated` (once) so the
  ``finally`` blocks stop the job; their default action would end the supervisor and orphan it.
  Signals with a handler of their own, and supervisors off the main thread, are left alone."""
  if threading.current_thread() is not threading.main_thread():
    yield
    return
  fired = []

  def handler(signum, frame):
    if not fired:  # a second signal must not interrupt the cleanup the first one started
      fired.append(signum)
      raise SupervisorTerminated(signum)

  old = {}
  for sig in (signal.SIGTERM, signal.SIGHUP):
    if signal.getsignal(sig) is signal.SIG_DFL:
      old[sig] = signal.signal(sig, handler)
  try:
    yield
  finally:
    for sig, h in old.items():
      signal.signal(sig, h)


def check_command(cmd: Sequence[str] | str, env: dict | None = None):
  """ConfigError unless ``cmd[0]`` is an executable file or found on PATH (shell strings pass)."""
  if isinstance(cmd, str):
    if not cmd.strip():
      raise ConfigError("job command is empty")
    return
  if not cmd:
    raise ConfigError("job command is empty")
  exe = str(cmd[0])
  path = (env if env is not None else os.environ).get("PATH", os.defpath)
  if os.sep in exe:
    if not os.path.isfile(exe):
      raise ConfigError(f"job command {exe!r} does not exist")
    if not os.access(exe, os.X_OK):
      raise ConfigError(f"job command {exe!r} is not executable")
  elif shutil.which(exe, path=path) is None:
    raise ConfigError(f"job command {exe!r} was not found on PATH")


def _run_command(cmd, attempt, beats, env, log_path, hb_path, heartbeat_timeout, poll, kill_grace):
  if hb_path.exists():
    hb_path.unlink()
  with open(log_path, "a") as out:
    out.write(f"\n===== attempt {attempt.index} =====\n")
    out.flush()
    try:
      proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                              shell=isinstance(cmd, str), start_new_session=True)
    except OSError as e:
      raise ConfigError(f"job command {cmd if isinstance(cmd, str) else cmd[0]!r} could not be "
                        f"started: {e.strerror or e}") from e
    _LIVE.add(proc)
    detected = "exit"
    try:
      seen = None
      while True:
        code = proc.poll()
        seen = _poll_heartbeat(hb_path, beats, seen)
        if code is not None:
          detected = "nan" if beats.first_bad is not None else "exit" if code != 0 else None
          break
        if beats.first_bad is not None:
          detected = "nan"
          break
        if beats.stalled(heartbeat_timeout):
          detected = "stall"
          break
        time.sleep(poll)
    finally:
      # However the loop ends (detection, an exception, KeyboardInterrupt, SIGTERM), the job's
      # whole process group goes with it.
      _stop_group(proc, kill_grace)
    attempt.exit_code = proc.returncode
    return detected


def _run_function(fn, attempt, beats, ckpt_dir, heartbeat_timeout, poll):
  ctx = JobContext(ckpt_dir, attempt, beats.beat, beats.malformed)
  box = {}

  def target():
    try:
      box["result"] = fn(ctx)
    except BaseException as e:  # noqa: BLE001 - the supervisor classifies every failure
      box["error"] = e
      box["log"] = "\n".join(ctx.log_lines + [traceback.format_exc()])

  th = threading.Thread(target=target, daemon=True, name=f"supervised-attempt-{attempt.index}")
  th.start()
  try:
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
  finally:
    ctx.cancelled = True  # the supervisor is leaving (maybe failing): the next beat stops the job
  if "error" in box:
    return ("nan" if isinstance(box["error"], NaNLoss) else
            "stall" if isinstance(box["error"], JobStalled) else "exit"), box
  return None, box


def job_paths(ckpt_dir: str | os.PathLike, workdir: str | os.PathLike | None = None,
              log_path: str | os.PathLike | None = None) -> tuple[Path, Path]:
  """(workdir, job log) as :func:`supervise` resolves them: ``<ckpt_dir>/../supervisor`` and
  ``<workdir>/job.log`` unless given."""
  workdir = Path(workdir or Path(os.path.abspath(ckpt_dir)).parent / "supervisor").absolute()
  return workdir, Path(log_path).absolute() if log_path else workdir / "job.log"


def supervise(job: Sequence[str] | str | Callable, *, ckpt_dir: str | os.PathLike,
              workdir: str | os.PathLike | None = None, max_restarts: int = 5,
              heartbeat_timeout: float = 60.0, startup_timeout: float = 600.0, poll: float = 0.05,
              model: ModelDiagnoser | None = None, env: dict | None = None,
              log_path: str | os.PathLike | None = None, kill_grace: float = 10.0) -> SupervisorReport:
  """Runs ``job`` until it succeeds, fails non-retryably, or exhausts ``max_restarts``.

  ``startup_timeout`` bounds the time to the first heartbeat of an attempt (imports, restore,
  compilation); ``heartbeat_timeout`` the gap between later heartbeats. A command's output is
  appended to ``log_path`` (default ``<workdir>/job.log``); stopping it sends SIGTERM to its
  process group and SIGKILL ``kill_grace`` seconds later.
  """
  if max_restarts < 0:
    raise ConfigError(f"{max_restarts=} must be >= 0")
  for name, value in (("heartbeat_timeout", heartbeat_timeout), ("startup_timeout", startup_timeout),
                      ("poll", poll)):
    if not value > 0:
      raise ConfigError(f"{name}={value} must be positive")
  if not kill_grace >= 0:
    raise ConfigError(f"{kill_grace=} must be >= 0")
  run_env = dict(os.environ if env is None else env)
  if not callable(job):
    check_command(job, run_env)
  ckpt_dir = os.path.abspath(ckpt_dir)
  workdir, log_path = job_paths(ckpt_dir, workdir, log_path)
  workdir.mkdir(parents=True, exist_ok=True)
  log_path.parent.mkdir(parents=True, exist_ok=True)
  hb_path = workdir / "heartbeat.json"
  report_log = None if callable(job) else str(log_path)
  attempts: list[Attempt] = []
  with _terminate_raises():
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
        run_env.update(JAXSYS_CKPT_DIR=ckpt_dir, JAXSYS_HEARTBEAT=str(hb_path))
        start = log_path.stat().st_size if log_path.exists() else 0
        detected = _run_command(job, attempt, beats, run_env, log_path, hb_path, heartbeat_timeout,
                                poll, kill_grace)
        with open(log_path, errors="replace") as f:
          f.seek(start)
          log_text = f.read()
        result = None
      attempt.wall_s = time.monotonic() - t0
      attempt.detected = detected
      if detected is None:
        return SupervisorReport(True, attempts, f"finished after {i} restart(s)", result, report_log)
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
                                f"({attempt.diagnosis.kind}): {attempt.diagnosis.evidence}",
                                log_path=report_log)
  return SupervisorReport(False, attempts, f"gave up after {max_restarts} restarts", log_path=report_log)
