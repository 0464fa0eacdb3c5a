"""Scheduling policies for the event-driven simulator: FIFO, SJF (oracle), SRTF (preemptive),
Tiresias-style discretised LAS (preemptive) and Helios QSSF.

A policy orders jobs by a priority key (smaller runs first). Non-preemptive policies compute the
key once, at submission; preemptive ones recompute it for running jobs at every scheduling point.

* FIFO:  key = submit time.
* SJF:   key = true duration (an oracle; the upper bound a perfect estimator reaches).
* SRTF:  key = remaining run time (true), preemptive; a resumed job pays a checkpoint/restore
         overhead that grows with its size (7 / 30 / 60 s for <= 1, <= 8, > 8 GPUs by default).
* LAS:   Tiresias 2D-LAS (Gu et al., NSDI'19): key = (queue level of attained GPU-seconds,
         submit); a job is demoted when its attained service crosses a threshold. Needs no
         duration knowledge.
* QSSF:  Helios Quasi-Shortest-Service-First (Hu et al., SC'21): key = predicted duration x GPUs,
         prediction from an estimator at submission, estimator updated online as jobs finish.
"""

from __future__ import annotations

import bisect
import dataclasses

from jaxsys.core.errors import ConfigError

__all__ = ["FIFO", "LAS", "make_policy", "Policy", "QSSF", "restore_overhead", "SJF", "SRTF"]


class Policy:
  """Base policy: non-preemptive FIFO."""
  name = "fifo"
  preemptive = False

  def on_submit(self, sj, now: float):
    """Called once when a job arrives (estimators predict here)."""

  def on_finish(self, sj, now: float):
    """Called when a job completes (online estimators learn here)."""

  def key(self, sj, now: float) -> tuple:
    return (sj.submit, sj.idx)

  def next_change(self, sj, now: float) -> float | None:
    """For preemptive policies: the time a running job's key changes class (a demotion)."""
    return None


class FIFO(Policy):
  name = "fifo"


class SJF(Policy):
  name = "sjf"

  def key(self, sj, now):
    return (sj.duration, sj.submit, sj.idx)


def restore_overhead(gpus: int, overheads: tuple[float, float, float] = (7.0, 30.0, 60.0)) -> float:
  """Checkpoint + restore seconds paid when a preempted job resumes (by job size in GPUs)."""
  small, medium, large = overheads
  return small if gpus <= 1 else medium if gpus <= 8 else large


class SRTF(Policy):
  name = "srtf"
  preemptive = True

  def key(self, sj, now):
    return (sj.remaining_at(now), sj.submit, sj.idx)


@dataclasses.dataclass
class LAS(Policy):
  """Discretised 2D-LAS: queue level = number of thresholds (GPU-seconds) already passed."""
  thresholds: tuple[float, ...] = (3600.0, 36000.0, 360000.0)
  name: str = "las"
  preemptive: bool = True

  def __post_init__(self):
    if list(self.thresholds) != sorted(self.thresholds) or any(t <= 0 for t in self.thresholds):
      raise ConfigError(f"thresholds={self.thresholds} must be positive and increasing")

  def level(self, attained: float) -> int:
    return bisect.bisect_right(self.thresholds, attained)

  def key(self, sj, now):
    return (self.level(sj.attained_at(now)), sj.submit, sj.idx)

  def next_change(self, sj, now):
    att = sj.attained_at(now)
    lvl = self.level(att)
    if lvl >= len(self.thresholds) or sj.gpus == 0:
      return None
    return now + (self.thresholds[lvl] - att) / sj.gpus + 1e-6


@dataclasses.dataclass
class QSSF(Policy):
  """Priority = estimator.predict(job) x GPUs; ``estimator.update`` sees each finished job."""
  estimator: object = None
  name: str = "qssf"
  preemptive: bool = False

  def __post_init__(self):
    if self.estimator is None or not hasattr(self.estimator, "predict"):
      raise ConfigError(f"estimator={self.estimator!r} must have predict(job) -> seconds")

  def prepare(self, jobs):
    if hasattr(self.estimator, "precompute"):
      self.estimator.precompute(jobs)

  def on_submit(self, sj, now):
    sj.pred = max(float(self.estimator.predict(sj.job)), 1e-3)

  def on_finish(self, sj, now):
    update = getattr(self.estimator, "update", None)
    if update is not None:
      update(sj.job)

  def key(self, sj, now):
    return (sj.pred * max(sj.gpus, 1), sj.submit, sj.idx)


def make_policy(name: str, estimator=None, **kwargs) -> Policy:
  """``fifo | sjf | srtf | las | qssf`` (qssf needs an estimator)."""
  table = {"fifo": FIFO, "sjf": SJF, "srtf": SRTF, "las": LAS}
  if name == "qssf":
    return QSSF(estimator=estimator, **kwargs)
  if name not in table:
    raise ConfigError(f"policy={name!r} must be one of {sorted(table) + ['qssf']}")
  return table[name](**kwargs)
