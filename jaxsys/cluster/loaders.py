"""Trace loaders: Alibaba GPU v2023 (openb), Helios ``cluster_log.csv``, Philly
``cluster_job_log`` (JSON) and Acme (``trace_<cluster>.csv``), all into :class:`Trace`.

Every loader takes ``on_error="raise"`` (the first malformed row raises a TraceError naming the
file, row and column) or ``"skip"`` (the row is dropped and counted under its reason in
``Trace.skipped``). Files are UTF-8 with or without a byte-order mark; a row holding bytes that
are not UTF-8 is malformed like any other. Times become seconds from the earliest submit time.

Usage::

  from jaxsys.cluster import load_alibaba
  trace = load_alibaba()          # the bundled copy of openb_pod_list_default.csv
  print(len(trace.runnable()), trace.skipped)
"""

from __future__ import annotations

import collections
import datetime as dt
import json
import re
from collections.abc import Callable
from pathlib import Path

from jaxsys.cluster.trace import (Job, RowReader, Trace, TraceError, normalise_state, read_csv_rows,
                                  read_header, read_text)
from jaxsys.core.errors import ConfigError

__all__ = [
    "ALIBABA_NODES", "ALIBABA_PODS", "alibaba_template", "ASSETS", "data_path", "HELIOS_SUMMARY",
    "load_acme", "load_alibaba", "load_alibaba_nodes", "load_helios", "load_philly", "load_trace",
    "parse_time", "PHILLY_NODES", "SHARED",
]

ASSETS = Path(__file__).resolve().parents[1] / "assets" / "traces"
SHARED = Path(__file__).resolve().parents[3] / "shared" / "data" / "traces"
ALIBABA_PODS = "alibaba_v2023_openb_pod_list_default.csv"
ALIBABA_NODES = "alibaba_v2023_openb_node_list_gpu_node.csv"
PHILLY_NODES = "philly_node_sequence.csv"
HELIOS_SUMMARY = "helios_cluster_summary.csv"


def data_path(name: str) -> Path:
  """The bundled compressed copy of a trace file, else ``../shared/data/traces/<name>``."""
  for p in (ASSETS / (name + ".gz"), ASSETS / name, SHARED / name):
    if p.exists():
      return p
  raise FileNotFoundError(f"trace {name!r} is neither bundled in {ASSETS} nor present in {SHARED}")


def _check_on_error(on_error: str):
  if on_error not in ("raise", "skip"):
    raise ConfigError(f"{on_error=} must be 'raise' or 'skip'")


def _collect(path: Path, rows, parse: Callable[[RowReader], Job | None], on_error: str) -> Trace:
  _check_on_error(on_error)
  jobs, skipped, first_row = [], collections.Counter(), {}
  for i, row in rows:
    reader = RowReader(path.name, i, row)
    try:
      reader.check_decoded()
      job = parse(reader)
      if job is not None and job.id in first_row:  # one record per job: the simulator keys on it
        raise TraceError(f"{path.name}: row {i}: job id {job.id!r} duplicates row {first_row[job.id]}")
    except TraceError as e:
      if on_error == "raise":
        raise
      skipped[_reason(str(e))] += 1
      continue
    if job is not None:
      first_row[job.id] = i
      jobs.append(job)
  return _rebase(jobs, str(path), dict(skipped))


def _reason(message: str) -> str:
  # "file: row 12 column 'x': why (value ...)" -> "column 'x': why"; "file: row 3: why" -> "why"
  m = re.match(r".*?: row \d+:? (.*)", message, re.S)
  return (m.group(1) if m else message).split(" (value")[0]


def _rebase(jobs: list[Job], source: str, skipped: dict) -> Trace:
  """Shifts times so the earliest submit is 0 and sorts by (submit, id)."""
  if not jobs:
    return Trace([], source, skipped)
  t0 = min(j.submit for j in jobs)
  shift = lambda t: None if t is None else t - t0  # noqa: E731
  out = [Job(j.id, j.user, j.vc, j.name, j.gpus, j.cpus, j.nodes, j.submit - t0, shift(j.start),
             shift(j.end), j.duration, j.state, j.type, j.extra) for j in jobs]
  out.sort(key=lambda j: (j.submit, j.id))
  return Trace(out, source, skipped)


def _times(r: RowReader, submit: float, start: float | None, end: float | None, state: str):
  """Checks ordering and returns (start, end, duration); never-started jobs get duration 0."""
  if start is None or state == "pending":
    return None, end, 0.0
  if start < submit:
    r.fail("start", f"start {start} is before submit {submit}")
  if end is None:
    r.fail("end", "is missing for a job that started")
  if end < start:
    r.fail("end", f"negative duration: end {end} is before start {start}")
  return start, end, end - start


# ------------------------------------------------------------------------------- Alibaba v2023

_ALIBABA_STATES = {"Succeeded": "completed", "Failed": "failed", "Running": "running",
                   "Pending": "pending"}


def alibaba_template(cpu_milli, memory_mib, num_gpu, gpu_milli, qos) -> str:
  """The trace has no job names; identical resource requests stand in for a job template."""
  return f"tpl-c{int(cpu_milli)}-m{int(memory_mib)}-g{int(num_gpu)}x{int(gpu_milli)}-{qos}"


def _parse_alibaba(r: RowReader) -> Job:
  cpu = r.number("cpu_milli", minimum=0)
  mem = r.number("memory_mib", minimum=0)
  gpus = r.number("num_gpu", integer=True, minimum=0)
  milli = r.number("gpu_milli", minimum=0, required=False, default=0.0)
  qos = r.raw("qos", required=False) or "unknown"
  phase = r.raw("pod_phase")
  if phase not in _ALIBABA_STATES:
    r.fail("pod_phase", f"must be one of {sorted(_ALIBABA_STATES)}")
  state = _ALIBABA_STATES[phase]
  submit = r.number("creation_time", minimum=0)
  start = r.number("scheduled_time", required=False, default=None)
  end = r.number("deletion_time", required=False, default=None)
  start, end, dur = _times(r, submit, start, end, state)
  return Job(id=r.raw("name"), user="unknown", vc=qos,
             name=alibaba_template(cpu, mem, gpus, milli, qos), gpus=gpus, cpus=cpu / 1000,
             nodes=1, submit=submit, start=start, end=end, duration=dur, state=state,
             type="gpu" if gpus > 0 else "cpu",
             extra={"memory_mib": mem, "gpu_milli": milli, "qos": qos, "gpu_spec": r.raw(
                 "gpu_spec", required=False) or ""})


def load_alibaba(path: str | Path | None = None, *, on_error: str = "raise") -> Trace:
  """Alibaba ``openb_pod_list_*.csv`` (Weng et al., ATC'23). Default: the bundled default list."""
  path = Path(path) if path else data_path(ALIBABA_PODS)
  header, rows = read_csv_rows(path)
  need = {"name", "num_gpu", "creation_time", "deletion_time", "scheduled_time", "pod_phase"}
  if missing := need - set(header):
    raise TraceError(f"{path.name}: header lacks columns {sorted(missing)}")
  return _collect(path, rows, _parse_alibaba, on_error)


def load_alibaba_nodes(path: str | Path | None = None) -> list[tuple[str, int, str]]:
  """(node id, GPUs, model) of ``openb_node_list_gpu_node.csv``."""
  path = Path(path) if path else data_path(ALIBABA_NODES)
  _, rows = read_csv_rows(path)
  out = []
  for i, row in rows:
    r = RowReader(path.name, i, row)
    r.check_decoded()
    out.append((r.raw("sn"), r.number("gpu", integer=True, minimum=0), r.raw("model", required=False) or ""))
  return out


# --------------------------------------------------------------------------------------- Helios

def parse_time(r: RowReader, column: str, *aliases: str, required=True) -> float | None:
  """Seconds: a number, or an ISO date-time ("2020-04-01 00:00:35") as POSIX seconds (UTC)."""
  text = r.raw(column, *aliases, required=required)
  if text is None or text.lower() in ("nan", "none", "null", "nat"):
    if required:
      r.fail(column, "is missing")
    return None
  try:
    return float(text)
  except ValueError:
    pass
  try:
    t = dt.datetime.fromisoformat(text)
  except ValueError:
    r.fail(column, "is neither seconds nor an ISO date-time")
  if t.tzinfo is None:
    t = t.replace(tzinfo=dt.timezone.utc)
  return t.timestamp()


def _parse_helios(r: RowReader) -> Job:
  gpus = r.number("gpu_num", integer=True, minimum=0)
  state = _state(r, "state")
  submit = parse_time(r, "submit_time")
  start = parse_time(r, "start_time", required=False)
  end = parse_time(r, "end_time", required=False)
  start, end, dur = _times(r, submit, start, end, state)
  return Job(id=r.raw("job_id"), user=r.raw("user", required=False) or "unknown",
             vc=r.raw("vc", required=False) or "default",
             name=r.raw("jobname", "job_name", "name", required=False) or "",
             gpus=gpus, cpus=r.number("cpu_num", required=False, default=0.0, minimum=0),
             nodes=r.number("node_num", integer=True, required=False, default=1, minimum=0),
             submit=submit, start=start, end=end, duration=dur, state=state,
             type="gpu" if gpus > 0 else "cpu")


def _state(r: RowReader, column: str) -> str:
  try:
    return normalise_state(r.raw(column))
  except ValueError as e:
    r.fail(column, str(e))


# Columns every Helios-style job log (Helios, Acme) must have; the rest are optional.
_JOB_LOG_COLUMNS = {"job_id", "gpu_num", "state", "submit_time", "start_time", "end_time"}


def _load_job_log(path: Path, label: str, parse, on_error: str) -> Trace:
  header, rows = read_csv_rows(path)
  if missing := _JOB_LOG_COLUMNS - set(header):
    raise TraceError(f"{path.name}: header lacks {label} columns {sorted(missing)}")
  return _collect(path, rows, parse, on_error)


def load_helios(path: str | Path, *, on_error: str = "raise") -> Trace:
  """Helios ``cluster_log.csv`` (job_id, user, vc, jobname, gpu_num, cpu_num, node_num, state,
  submit_time, start_time, end_time, duration, queue)."""
  return _load_job_log(Path(path), "Helios", _parse_helios, on_error)


# ---------------------------------------------------------------------------------------- Acme

def _parse_acme(r: RowReader) -> Job:
  gpus = r.number("gpu_num", integer=True, minimum=0)
  state = _state(r, "state")
  submit = parse_time(r, "submit_time")
  start = parse_time(r, "start_time", required=False)
  end = parse_time(r, "end_time", "fail_time", "stop_time", required=False)
  start, end, dur = _times(r, submit, start, end, state)
  workload = r.raw("type", required=False) or "Other"
  return Job(id=r.raw("job_id"), user=r.raw("user", required=False) or "unknown",
             vc=r.raw("vc", required=False) or "default", name=r.raw("name", required=False) or workload,
             gpus=gpus, cpus=r.number("cpu_num", required=False, default=0.0, minimum=0),
             nodes=r.number("node_num", integer=True, required=False, default=1, minimum=0),
             submit=submit, start=start, end=end, duration=dur, state=state,
             type="gpu" if gpus > 0 else "cpu", extra={"workload": workload})


def load_acme(path: str | Path, *, on_error: str = "raise") -> Trace:
  """AcmeTrace ``trace_seren.csv`` / ``trace_kalos.csv`` (job_id, user, node_num, gpu_num,
  cpu_num, type, state, submit_time, start_time, end_time, ...; Hu et al., NSDI'24)."""
  return _load_job_log(Path(path), "Acme", _parse_acme, on_error)


# -------------------------------------------------------------------------------------- Philly

_PHILLY_STATES = {"Pass": "completed", "Killed": "cancelled", "Failed": "failed",
                  "Running": "running", "Queued": "pending"}


def _list_of(r: RowReader, value, what: str, item: type | None = None) -> list:
  """``value`` as a list (None -> []); anything else is a TraceError naming the row and field."""
  if value is None:
    return []
  if not isinstance(value, list):
    r.fail("attempts", f"{what} must be a list, got {type(value).__name__}")
  for k, v in enumerate(value):
    if item is not None and not isinstance(v, item):
      r.fail("attempts", f"{what}[{k}] must be a JSON {'object' if item is dict else item.__name__}, "
             f"got {type(v).__name__}")
  return value


def _parse_philly(r: RowReader) -> Job | None:
  if not isinstance(r.row, dict):
    r.fail_row(f"must be a JSON object, got {type(r.row).__name__}")
  status = r.raw("status")
  if status not in _PHILLY_STATES:
    r.fail("status", f"must be one of {sorted(_PHILLY_STATES)}")
  # attempts: [{"start_time", "end_time", "detail": [{"ip", "gpus": [name, ...]}, ...]}, ...]
  attempts = _list_of(r, r.row.get("attempts"), "attempts", dict)
  details = [_list_of(r, a.get("detail"), f"attempts[{k}].detail", dict) for k, a in enumerate(attempts)]
  for k, detail in enumerate(details):
    for n, d in enumerate(detail):
      _list_of(r, d.get("gpus"), f"attempts[{k}].detail[{n}].gpus")
  submit = parse_time(r, "submitted_time")
  state = _PHILLY_STATES[status]
  start = end = None
  gpus = nodes = 0
  if attempts:
    sub = [RowReader(r.source, r.row_number, a) for a in attempts]
    start = parse_time(sub[0], "start_time", required=False)
    end = parse_time(sub[-1], "end_time", required=False)
    nodes = len(details[-1])
    gpus = sum(len(d.get("gpus") or []) for d in details[-1])
  if start is None:
    state = "pending" if state in ("running", "pending") else state
  start, end, dur = _times(r, submit, start, end, "pending" if start is None else state)
  return Job(id=r.raw("jobid"), user=r.raw("user", required=False) or "unknown",
             vc=r.raw("vc", required=False) or "default", name="", gpus=gpus, cpus=0.0,
             nodes=nodes, submit=submit, start=start, end=end, duration=dur, state=state,
             type="gpu" if gpus > 0 else "cpu", extra={"attempts": len(attempts)})


def load_philly(path: str | Path, *, on_error: str = "raise") -> Trace:
  """Philly ``cluster_job_log`` (JSON list of jobs with attempts; Jeon et al., ATC'19)."""
  path = Path(path)
  try:
    records = json.loads(read_text(path))
  except json.JSONDecodeError as e:
    raise TraceError(f"{path.name}: not valid JSON: {e}") from e
  if not isinstance(records, list):
    raise TraceError(f"{path.name}: expected a JSON list of jobs, got {type(records).__name__}")
  return _collect(path, enumerate(records), _parse_philly, on_error)


def load_trace(path: str | Path, fmt: str = "auto", *, on_error: str = "raise") -> Trace:
  """Loads any supported trace; ``fmt`` is alibaba | helios | acme | philly | auto (by header)."""
  path = Path(path)
  loaders = {"alibaba": load_alibaba, "helios": load_helios, "acme": load_acme, "philly": load_philly}
  if fmt == "auto":
    if path.suffix == ".json":
      fmt = "philly"
    else:
      header = read_header(path)
      fmt = ("alibaba" if "pod_phase" in header else "acme" if "fail_time" in header or
             "mem_per_pod_GB" in header else "helios")
  if fmt not in loaders:
    raise ConfigError(f"{fmt=} must be one of {sorted(loaders)} or 'auto'")
  return loaders[fmt](path, on_error=on_error)
