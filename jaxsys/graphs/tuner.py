"""Auto-tuner for the ECR density threshold, driven by measured step time and loss progress.

Each candidate threshold gets a fresh training step (``make_step(threshold) -> step``, every
candidate starting from the same model/optimizer state); the tuner compiles it (one warm-up
call), runs ``steps`` timed steps and records the median step time and the loss progress
``loss[0] - loss[-1]``. It picks the fastest candidate whose progress is at least
``(1 - loss_tolerance)`` of the best progress seen. In exact ECR every threshold computes the
same function, so the choice is purely by time; in approximate ECR (densified tiles) the loss
criterion rejects thresholds that densify too much.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Sequence

from jaxsys.core.errors import ConfigError

__all__ = ["tune_threshold", "TunerRecord", "TunerResult"]


@dataclasses.dataclass(frozen=True)
class TunerRecord:
  threshold: float
  step_ms: float
  loss_progress: float
  losses: tuple[float, ...]


@dataclasses.dataclass(frozen=True)
class TunerResult:
  threshold: float
  records: tuple[TunerRecord, ...]

  def as_rows(self) -> list[dict]:
    return [dataclasses.asdict(r) for r in self.records]


def tune_threshold(make_step: Callable[[float], Callable[[], float]], candidates: Sequence[float],
                   *, steps: int = 3, loss_tolerance: float = 0.1,
                   clock: Callable[[], float] = time.perf_counter) -> TunerResult:
  """Returns the chosen threshold and the per-candidate measurements (``clock`` in seconds)."""
  if not candidates:
    raise ConfigError("candidates must not be empty")
  if steps < 2:
    raise ConfigError(f"{steps=} must be >= 2 (loss progress needs two losses)")
  if not 0.0 <= loss_tolerance < 1.0:
    raise ConfigError(f"{loss_tolerance=} must lie in [0, 1)")
  records = []
  for thr in candidates:
    step = make_step(float(thr))
    losses = [float(step())]  # warm-up: compiles; its loss is the starting point
    times = []
    for _ in range(steps):
      t0 = clock()
      losses.append(float(step()))
      times.append(clock() - t0)
    records.append(TunerRecord(float(thr), 1e3 * statistics.median(times),
                               losses[0] - losses[-1], tuple(losses)))
  best_progress = max(r.loss_progress for r in records)
  floor = best_progress - loss_tolerance * abs(best_progress)
  ok = [r for r in records if r.loss_progress >= floor] or records
  chosen = min(ok, key=lambda r: r.step_ms)
  return TunerResult(chosen.threshold, tuple(records))
