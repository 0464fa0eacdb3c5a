"""One job schema for every GPU-cluster trace, validation, and Helios-style summary statistics.

A trace is a list of :class:`Job` records (id, user, vc, name, gpus, cpus, nodes, submit,
start, end, duration, state, type) plus a count of the rows a loader skipped and why.
Times are seconds from the trace origin. ``duration`` is the time the job ran (end - start).
States are normalised to ``completed | failed | cancelled | running | pending | timeout``.

Summary statistics follow the columns of the Helios ``cluster_summary`` table (Hu et al.,
SC'21): job counts split CPU/GPU, mean/median run and queue time, mean GPU count, and the
completed/cancelled/failed shares and GPU time, so a loaded trace can be compared with the
published numbers (``helios_cluster_summary.csv``).
"""

from __future__ import annotations

import collections
import csv
import dataclasses
import math
import re
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from jaxsys.core.errors import InputError, check_min, check_one_of

__all__ = [
    "Job", "load_helios_summary", "normalise_state", "read_csv_rows", "read_header", "read_text",
    "RowReader", "STATES", "summarize", "Trace", "TraceError", "undecodable", "validate",
]

STATES = ("completed", "failed", "cancelled", "running", "pending", "timeout")
_STATE_ALIASES = {
    "completed": "completed", "complete": "completed", "succeeded": "completed", "pass": "completed",
    "success": "completed", "finished": "completed",
    "failed": "failed", "fail": "failed", "node_fail": "failed", "out_of_memory": "failed",
    "killed": "cancelled", "cancelled": "cancelled", "canceled": "cancelled",
    "running": "running", "pending": "pending", "queued": "pending", "timeout": "timeout",
}


class TraceError(InputError):
  """A trace row is malformed; the message names the file, row and column."""


def normalise_state(raw: str) -> str:
  key = str(raw).strip().lower().replace(" ", "_")
  if key.startswith("cancelled") or key.startswith("canceled"):
    return "cancelled"
  if key not in _STATE_ALIASES:
    raise ValueError(f"unknown job state {raw!r}; known: {sorted(_STATE_ALIASES)}")
  return _STATE_ALIASES[key]


@dataclasses.dataclass(frozen=True)
class Job:
  """One job of a GPU-cluster trace. ``extra`` carries loader-specific fields (memory, QoS...)."""
  id: str
  user: str
  vc: str
  name: str
  gpus: int
  cpus: float
  nodes: int
  submit: float
  start: float | None
  end: float | None
  duration: float
  state: str
  type: str  # "gpu" | "cpu"
  extra: dict = dataclasses.field(default_factory=dict, compare=False, hash=False, repr=False)

  def __post_init__(self):
    where = f"job {self.id}: "
    check_min(self, 0, "gpus", "nodes", error=InputError, where=where)
    if not math.isfinite(self.duration) or self.duration < 0:
      raise InputError(f"{where}duration={self.duration} must be finite and >= 0")
    if not math.isfinite(self.submit):
      raise InputError(f"{where}submit={self.submit} must be finite")
    check_one_of("state", self.state, STATES, error=InputError, where=where)
    check_one_of("type", self.type, ("gpu", "cpu"), error=InputError, where=where)

  @property
  def queue(self) -> float | None:
    """Queueing delay recorded in the trace (start - submit), None when it never started."""
    return None if self.start is None else self.start - self.submit


@dataclasses.dataclass
class Trace:
  """Jobs sorted by submit time, the source, and ``skipped``: reason -> number of rows skipped."""
  jobs: list[Job]
  source: str = ""
  skipped: dict[str, int] = dataclasses.field(default_factory=dict)

  def __len__(self):
    return len(self.jobs)

  def __iter__(self):
    return iter(self.jobs)

  def gpu_jobs(self) -> list[Job]:
    return [j for j in self.jobs if j.type == "gpu"]

  def runnable(self) -> list[Job]:
    """GPU jobs that started (the ones a scheduler simulator replays)."""
    return [j for j in self.jobs if j.type == "gpu" and j.start is not None]

  def summary(self, gpu_num: int | None = None) -> dict[str, float]:
    return summarize(self.jobs, gpu_num=gpu_num)


class RowReader:
  """Parses typed fields of one row; every failure names the file, row number and column."""

  def __init__(self, source: str, row_number: int, row: dict):
    self.source, self.row_number, self.row = source, row_number, row

  def fail(self, column: str, why: str):
    value = repr(self.row.get(column) if isinstance(self.row, dict) else None)
    if len(value) > 120:  # a JSON field (Philly attempts) can be long
      value = value[:117] + "..."
    raise TraceError(f"{self.source}: row {self.row_number} column {column!r}: {why} "
                     f"(value {value})")

  def fail_row(self, why: str):
    raise TraceError(f"{self.source}: row {self.row_number}: {why}")

  def check_decoded(self):
    """Fails on a row holding bytes that were not UTF-8 (decoded with ``surrogateescape``)."""
    if isinstance(self.row, dict):
      for column, value in self.row.items():
        if undecodable(column) or undecodable(value):
          self.fail(str(column), "is not valid UTF-8")
    elif undecodable(self.row):
      self.fail_row("is not valid UTF-8")

  def raw(self, column: str, *aliases: str, required: bool = True) -> str | None:
    for c in (column, *aliases):
      if c in self.row and self.row[c] not in (None, ""):
        text = str(self.row[c]).strip()
        if undecodable(text):
          self.fail(c, "is not valid UTF-8")
        return text
    if required:
      self.fail(column, "is missing")
    return None

  def number(self, column: str, *aliases: str, required=True, default=None, integer=False,
             minimum: float | None = None):
    text = self.raw(column, *aliases, required=required)
    if text is None or text.lower() in ("nan", "none", "null"):
      if required and default is None:
        self.fail(column, "is missing")
      return default
    try:
      value = float(text)
    except ValueError:
      self.fail(column, "is not a number")
    if not math.isfinite(value):
      self.fail(column, "is not finite")
    if integer:
      if value != int(value):
        self.fail(column, "must be an integer")
      value = int(value)
    if minimum is not None and value < minimum:
      self.fail(column, f"must be >= {minimum}")
    return value


# Trace files are read as UTF-8 with an optional byte-order mark (Excel and Windows tools write
# one); bytes that are not UTF-8 decode to lone surrogates (U+DC80..U+DCFF) so the row holding
# them can be reported or skipped instead of the whole read raising UnicodeDecodeError.
ENCODING, DECODE_ERRORS = "utf-8-sig", "surrogateescape"
_SURROGATE = re.compile("[\udc80-\udcff]")


def undecodable(value) -> bool:
  """True if ``value`` (a str, or a JSON-like tree of them) holds bytes that were not UTF-8."""
  if isinstance(value, str):
    return _SURROGATE.search(value) is not None
  if isinstance(value, dict):
    return any(undecodable(k) or undecodable(v) for k, v in value.items())
  if isinstance(value, (list, tuple)):
    return any(undecodable(v) for v in value)
  return False


def _open_text(path: Path):
  import gzip
  opener = gzip.open if path.suffix == ".gz" else open
  return opener(path, "rt", encoding=ENCODING, errors=DECODE_ERRORS, newline="")


def read_text(path: str | Path) -> str:
  """A whole trace file (plain or .gz) as text, decoded like the CSV readers."""
  path = Path(path)
  if not path.exists():
    raise FileNotFoundError(f"trace file {path} does not exist")
  with _open_text(path) as f:
    return f.read()


def read_csv_rows(path: str | Path) -> tuple[list[str], Iterable[tuple[int, dict]]]:
  """Returns (header, iterator of (1-based data row number, row dict)); the header is line 1.

  Rows holding non-UTF-8 bytes come through; ``RowReader.check_decoded`` reports them.
  """
  path = Path(path)
  if not path.exists():
    raise FileNotFoundError(f"trace file {path} does not exist")
  f = _open_text(path)
  reader = csv.DictReader(f)
  header = list(reader.fieldnames or [])
  if undecodable(header):
    f.close()
    raise TraceError(f"{path.name}: the header (line 1) is not valid UTF-8: {header}")

  def rows():
    with f:
      for i, row in enumerate(reader, start=2):
        if None in row:
          raise TraceError(f"{path.name}: row {i}: {len(row[None])} more fields than the header")
        yield i, row
  return header, rows()


def read_header(path: str | Path) -> list[str]:
  """The column names of a CSV (plain or .gz) without reading its rows."""
  path = Path(path)
  if not path.exists():
    raise FileNotFoundError(f"trace file {path} does not exist")
  with _open_text(path) as f:
    return next(csv.reader(f), [])


def validate(jobs: Sequence[Job], *, max_gpus: int | None = None) -> None:
  """Raises TraceError naming the job and field for inconsistent records.

  Checks: unique ids; start >= submit; end >= start; duration = end - start within 1 s when
  both are known; gpus <= ``max_gpus`` when given.
  """
  seen = set()
  for i, j in enumerate(jobs):
    where = f"job {j.id!r} (index {i})"
    if j.id in seen:
      raise TraceError(f"{where}: column 'id' duplicates an earlier job")
    seen.add(j.id)
    if j.start is not None and j.start < j.submit - 1e-6:
      raise TraceError(f"{where}: column 'start'={j.start} is before 'submit'={j.submit}")
    if j.start is not None and j.end is not None:
      if j.end < j.start:
        raise TraceError(f"{where}: column 'end'={j.end} is before 'start'={j.start}")
      if abs((j.end - j.start) - j.duration) > 1.0:
        raise TraceError(f"{where}: column 'duration'={j.duration} != end - start = {j.end - j.start}")
    if max_gpus is not None and j.gpus > max_gpus:
      raise TraceError(f"{where}: column 'gpus'={j.gpus} exceeds the cluster's {max_gpus} GPUs")


def _rates(jobs: list[Job], prefix: str = "") -> dict[str, float]:
  n = max(len(jobs), 1)
  c = collections.Counter(j.state for j in jobs)
  return {f"complete_rate{prefix}": c["completed"] / n, f"cancel_rate{prefix}": c["cancelled"] / n,
          f"fail_rate{prefix}": (c["failed"] + c["timeout"]) / n,
          f"running_rate{prefix}": c["running"] / n}


def _stat(values, fn):
  values = [v for v in values if v is not None]
  return float(fn(values)) if values else float("nan")


def summarize(jobs: Sequence[Job], gpu_num: int | None = None) -> dict[str, float]:
  """Helios ``cluster_summary``-style statistics of a job list (times in seconds)."""
  jobs = list(jobs)
  cpu = [j for j in jobs if j.type == "cpu"]
  gpu = [j for j in jobs if j.type == "gpu"]
  out: dict[str, float] = {"gpu_num": float(gpu_num) if gpu_num else float("nan"),
                           "job_num": len(jobs), "cpu_job_num": len(cpu), "gpu_job_num": len(gpu)}
  started = lambda js: [j for j in js if j.start is not None]  # noqa: E731
  for kind, js in (("cpu", cpu), ("gpu", gpu)):
    out[f"avg_run_time_{kind}"] = _stat([j.duration for j in started(js)], np.mean)
    out[f"med_run_time_{kind}"] = _stat([j.duration for j in started(js)], np.median)
    out[f"avg_que_time_{kind}"] = _stat([j.queue for j in started(js)], np.mean)
    out[f"med_que_time_{kind}"] = _stat([j.queue for j in started(js)], np.median)
  out["avg_gpu_num"] = _stat([j.gpus for j in gpu], np.mean)
  out["med_gpu_num"] = _stat([j.gpus for j in gpu], np.median)
  out.update(_rates(jobs))
  out.update(_rates(cpu, "_cpu"))
  out.update(_rates(gpu, "_gpu"))
  for state, key in (("completed", "complete"), ("cancelled", "cancel"), ("failed", "fail")):
    out[f"{key}_gpu_time"] = float(sum(j.gpus * j.duration for j in gpu if j.state == state))
  return out


def load_helios_summary(path: str | Path) -> dict[str, dict[str, float]]:
  """Reads a ``cluster_summary``-style CSV into {cluster id: {column: value}}."""
  header, rows = read_csv_rows(path)
  if "id" not in header:
    raise TraceError(f"{Path(path).name}: header has no 'id' column: {header}")
  out = {}
  for i, row in rows:
    r = RowReader(Path(path).name, i, row)
    r.check_decoded()
    out[row["id"]] = {k: r.number(k) for k in header if k != "id"}
  return out
