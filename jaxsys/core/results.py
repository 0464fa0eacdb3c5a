"""Experiment results: rows of (metric, baseline, ours, ratio, ideal, goal) in ``result.json``.

Format (DESIGN.md "Benchmarks")::

  {"name": ..., "hardware": ..., "config": {...}, "quick": true,
   "rows": [{"metric": ..., "unit": ..., "baseline_name": ..., "baseline": ..., "ours": ...,
             "ratio": ..., "ideal": ..., "goal": ..., "met": ...}]}

``ratio`` is baseline/ours for times (higher is better); for other units the row says what the
ratio means in ``unit``. ``goal`` is a short rule such as ``">= 2"`` (on the ratio) or
``">= 0.5 of ideal"``; ``met`` is evaluated from the measured numbers, never written by hand.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from pathlib import Path
from typing import Any

from jaxsys.core.errors import ConfigError

__all__ = ["evaluate_goal", "Row", "run_dir", "write_result"]


@dataclasses.dataclass
class Row:
  metric: str
  unit: str
  ours: float | None
  baseline: float | None = None
  baseline_name: str | None = None
  ratio: float | None = None
  ideal: float | None = None
  goal: str | None = None
  note: str | None = None
  met: bool | None = None

  def __post_init__(self):
    if self.ratio is None and self.baseline is not None and self.ours not in (None, 0):
      if self.unit in ("ms", "s", "us", "seconds"):
        self.ratio = self.baseline / self.ours
    if self.met is None and self.goal:
      self.met = evaluate_goal(self.goal, self)

  def to_json(self) -> dict[str, Any]:
    d = dataclasses.asdict(self)
    return {k: _clean(v) for k, v in d.items() if v is not None}


def _clean(v):
  if isinstance(v, float) and not math.isfinite(v):
    return None
  if hasattr(v, "item"):
    return v.item()
  return v


_GOAL = re.compile(r"^\s*(>=|<=|>|<)\s*([0-9.eE+-]+)\s*(of ideal)?\s*(?:\((\w+)\))?\s*$")


def evaluate_goal(goal: str, row: Row) -> bool | None:
  """Evaluates ``">= X"``, ``"<= X"``, ``">= X of ideal"``; ``(ours)`` targets ``ours``.

  The default target is the ratio. Returns None for a goal written in words.
  """
  m = _GOAL.match(goal)
  if not m:
    return None
  op, num, of_ideal, target = m.groups()
  value = row.ours if target == "ours" else row.ratio
  bound = float(num)
  if of_ideal:
    if row.ideal is None:
      return None
    bound *= row.ideal
  if value is None or (isinstance(value, float) and not math.isfinite(value)):
    return False
  return {">=": value >= bound, "<=": value <= bound, ">": value > bound, "<": value < bound}[op]


def write_result(name: str, rows: list[Row], *, config: dict | None = None, quick: bool = False,
                 out_dir: str | os.PathLike | None = None, extra: dict | None = None) -> Path:
  """Writes ``<out_dir>/<name>/result.json`` (out_dir defaults to ``$JAXSYS_RUNS`` or ``runs``).

  Atomic (a temporary file renamed over the old one). In a multi-process job only process 0
  writes; the others return the path without touching it.
  """
  import jax

  from jaxsys.core.bench import hardware_string
  if not rows:
    raise ConfigError(f"experiment {name!r} produced no rows")
  out = Path(out_dir or os.environ.get("JAXSYS_RUNS", "runs")) / name
  path = out / "result.json"
  if jax.process_index() != 0:
    return path
  out.mkdir(parents=True, exist_ok=True)
  payload = {"name": name, "hardware": hardware_string(), "config": config or {},
             "quick": quick, "processes": jax.process_count(), "rows": [r.to_json() for r in rows]}
  if extra:
    payload.update(extra)
  tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
  tmp.write_text(json.dumps(payload, indent=2, default=str))
  os.replace(tmp, path)
  return path


def run_dir(name: str, out_dir: str | os.PathLike | None = None) -> Path:
  """The folder an experiment writes its plots into (created)."""
  out = Path(out_dir or os.environ.get("JAXSYS_RUNS", "runs")) / name
  out.mkdir(parents=True, exist_ok=True)
  return out
