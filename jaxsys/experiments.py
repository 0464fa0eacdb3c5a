"""The registry of the experiment scripts (the top-level ``experiments/`` folder) and the runner
behind ``jaxsys reproduce``.

Each experiment runs in its own process as ``python -P -m <module>`` (``-P``: the current directory
is not on ``sys.path``, so a user's own ``experiments`` package cannot shadow the installed
scripts). The runner forwards ``--devices`` to every experiment and ``--mesh`` / ``--dtype`` /
``--seed`` to those whose ``run`` takes them (read from the script's source with ``ast``: nothing is
imported to find out), prints a progress line with the time left, and writes ``summary.md`` (the
table, then a footer with each experiment's wall time, the date and the hardware) and
``summary.json``. The experiments share JAX's persistent compilation cache (``--compile-cache``,
default ``$JAXSYS_HOME/xla-cache``): equal programs compile once per machine, not once per process.
"""

from __future__ import annotations

import argparse
import ast
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

__all__ = [
    "child_env", "compile_cache_dir", "format_footer", "format_mesh", "format_table", "FORWARDED", "MAX_SEED", "parse_mesh", "parse_seed",
    "QUICK_SECONDS", "REGISTRY", "reproduce", "run_params",
]

# name -> (module, system, one-line description). Order is the order of the table.
REGISTRY: dict[str, tuple[str, str, str]] = {
    "attention": ("experiments.attention", "foundation", "blockwise / block-sparse attention vs naive and peers"),
    "decode_speed": ("experiments.decode_speed", "decoder LM", "greedy decode tokens/s, jaxsys vs transformers"),
    "real_lm": ("experiments.real_lm", "decoder LM", "SmolLM2-135M: decode/prefill vs llama.cpp, passkey, bf16/int8 weights"),
    "tiny_lm": ("experiments.tiny_lm", "decoder LM", "tiny trained model: recall vs context length, RoPE scaling"),
    "mmsp": ("experiments.mmsp", "LongVILA MM-SP", "sequence-parallel attention: comm bytes, memory, step time, balance"),
    "vniah": ("experiments.vniah", "LongVILA MM-SP", "video needle-in-a-haystack before/after long-context extension"),
    "mrsp": ("experiments.mrsp", "LongVILA-R1 MR-SP", "video GRPO: cached embeddings + SP passes, step time, memory, reward"),
    "lserve": ("experiments.lserve", "LServe", "sparse decode/prefill attention and engine vs dense"),
    "serving": ("experiments.serving", "LServe", "OpenAI-compatible server under Poisson load over HTTP"),
    "tlt": ("experiments.tlt", "TLT", "speculative decoding acceptance and GRPO rollout speedup"),
    "torchgt": ("experiments.torchgt", "TorchGT", "graph transformer accuracy and attention scaling"),
    "gnn_quant": ("experiments.gnn_quant", "A2Q / MEGA / Sylvie / PalQuant", "quantized GNNs and 1-bit communication"),
    "cluster": ("experiments.cluster", "Helios / Acme / SchedMate", "scheduling, energy saving, fault tolerance"),
    "spiking_nerf": ("experiments.spiking_nerf", "SpikingNeRF", "spiking vs ANN colour MLP: PSNR, energy, TP vs TCP packing"),
    "date": ("experiments.date", "DATE", "dual-assignment NMS-free detection: steps to AP, NMS-free AP, inference time"),
    "scaling": ("experiments.scaling", "decoder LM on a pod", "FSDP/TP loss curves vs 1 device, memory and collectives per device, LoRA state"),
}

#: Wall seconds of each ``--quick`` run on 2 idle CPU cores (the latest cold run of
#: experiments/README.md); only the progress line's estimate of the time left uses them (scaled by
#: how fast the finished experiments ran against these).
QUICK_SECONDS: dict[str, float] = {
    "attention": 36, "decode_speed": 21, "real_lm": 37, "tiny_lm": 43, "mmsp": 43, "vniah": 50,
    "mrsp": 94, "lserve": 69, "serving": 93, "tlt": 101, "torchgt": 82, "gnn_quant": 76,
    "cluster": 23, "spiking_nerf": 69, "date": 91, "scaling": 44
}

#: ``run`` parameter -> the command-line flag that feeds it (``experiments/_cli.py`` adds the flag to
#: an experiment exactly when its ``run`` takes the parameter).
FORWARDED = {"mesh": "--mesh", "dtype": "--dtype", "seed": "--seed"}


def _scripts_dir() -> Path:
  """The installed ``experiments`` folder: built into the same distribution as ``jaxsys``, so it
  sits beside it (site-packages, or the checkout for an editable install)."""
  return Path(__file__).resolve().parent.parent / "experiments"


def run_params(name: str) -> tuple[str, ...]:
  """The parameter names of ``experiments/<name>.py``'s ``run``, read from its source."""
  path = _scripts_dir() / (REGISTRY[name][0].split(".")[-1] + ".py")
  for node in ast.parse(path.read_text(), filename=str(path)).body:
    if isinstance(node, ast.FunctionDef) and node.name == "run":
      a = node.args
      return tuple(x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs))
  raise LookupError(f"{path} defines no run()")


def parse_mesh(text: str) -> dict[str, int]:
  """``"ring=2,ulysses=4"`` -> ``{"ring": 2, "ulysses": 4}`` (``jaxsys.core.mesh.parse_axes``, as
  an argparse type)."""
  from jaxsys.core.errors import ConfigError  # noqa: PLC0415
  from jaxsys.core.mesh import parse_axes  # noqa: PLC0415
  try:
    return parse_axes(text)
  except ConfigError as e:
    raise argparse.ArgumentTypeError(str(e)) from None


MAX_SEED = 10_000  # experiments derive seeds up to ~1e5 * seed, and rollout seeds are 32-bit integers


def parse_seed(text: str) -> int:
  """``--seed``: an integer in [0, MAX_SEED] (numpy's generators reject negative seeds; larger ones
  would overflow the 32-bit seeds the experiments derive from it)."""
  try:
    seed = int(text)
  except ValueError:
    seed = -1
  if not 0 <= seed <= MAX_SEED:
    raise argparse.ArgumentTypeError(f"--seed {text!r}: expected an integer in [0, {MAX_SEED}]")
  return seed


def format_mesh(axes: dict[str, int]) -> str:
  """The inverse of :func:`parse_mesh`."""
  return ",".join(f"{k}={v}" for k, v in axes.items())


def _fmt(x, digits=3):
  if x is None:
    return "-"
  if isinstance(x, bool):
    return "yes" if x else "no"
  if isinstance(x, (int, float)):
    if x == 0:
      return "0"
    ax = abs(x)
    if ax >= 1e5 or ax < 1e-3:
      return f"{x:.3g}"
    return f"{x:.{digits}g}" if ax < 100 else f"{x:.0f}"
  return str(x)


def _cell(x) -> str:
  """A markdown table cell: ``|`` escaped, newlines folded (row names may hold either)."""
  return str(x).replace("|", "\\|").replace("\n", " ")


def format_table(results: list[dict]) -> str:
  """Markdown table: system, experiment, metric, baseline, ours, ratio, ideal, goal, met."""
  head = "| system | experiment | metric | unit | baseline | ours | ratio | ideal | goal | met? |"
  lines = [head, "|" + "---|" * 10]
  for res in results:
    system = REGISTRY.get(res["name"], ("", res["name"], ""))[1]
    if res.get("error"):
      lines.append(f"| {system} | {res['name']} | FAILED: {_cell(res['error'])} | | | | | | | no |")
      continue
    for r in res.get("rows", []):
      base = _fmt(r.get("baseline"))
      if r.get("baseline_name"):
        base = f"{base} ({r['baseline_name']})"
      met = r.get("met")
      cells = [system, res["name"], r["metric"], r.get("unit", ""), base, _fmt(r.get("ours")),
               _fmt(r.get("ratio")), _fmt(r.get("ideal")), r.get("goal") or "-",
               "-" if met is None else ("yes" if met else "no")]
      lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
  return "\n".join(lines)


def _minutes(s: float) -> str:
  return f"{s / 60:.1f} min" if s >= 90 else f"{s:.0f} s"


def format_footer(results: list[dict], command: str) -> str:
  """Each experiment's wall time and row count, the goals met, the total, the date and hardware."""
  lines = ["| experiment | wall time | rows | goals met | status |", "|---|---|---|---|---|"]
  for res in results:
    rows = res.get("rows", [])
    goals = [r.get("met") for r in rows if r.get("met") is not None]
    status = f"FAILED: {_cell(res['error'])}" if res.get("error") else "ok"
    lines.append(f"| {res['name']} | {_minutes(res.get('wall_seconds', 0))} | {len(rows)} | "
                 f"{sum(map(bool, goals))}/{len(goals)} | {status} |")
  total = sum(r.get("wall_seconds", 0) for r in results)
  hardware = next((r["hardware"] for r in results if r.get("hardware")), "unknown")
  date = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
  lines += ["", f"`{command}`: {len(results)} experiments in {_minutes(total)}, {date}, {hardware}."]
  return "\n".join(lines)


def _last_line(path: Path, limit: int = 4096) -> str:
  """The last non-empty line of a log (tqdm bars end their lines with carriage returns)."""
  with open(path, "rb") as fh:
    fh.seek(0, os.SEEK_END)
    fh.seek(max(0, fh.tell() - limit))
    text = fh.read().decode("utf-8", "replace")
  lines = [x.strip() for x in text.replace("\r", "\n").splitlines() if x.strip()]
  return lines[-1] if lines else ""


def _wait_with_heartbeat(proc, log_path: Path, t0: float, timeout, every: float, left=lambda now: ""):
  """Waits for ``proc``; every ``every`` seconds prints the elapsed time, ``left(now)`` (the
  estimate of the time left) and the log's last line. Returns the exit code, or None after killing
  it at ``timeout`` seconds."""
  next_beat = t0 + every
  while True:
    try:
      return proc.wait(timeout=1.0)
    except subprocess.TimeoutExpired:
      pass
    now = time.perf_counter()
    if timeout is not None and now - t0 > timeout:
      proc.kill()
      proc.wait()
      return None
    if every > 0 and now >= next_beat:
      print(f"      ... {now - t0:.0f}s{left(now)}  {_last_line(log_path)[:100]}", flush=True)
      next_beat = now + every


def _eta(names: list[str], i: int, t_start: float, done_s: float, quick: bool):
  """``left(now)`` for experiment ``i`` (0-based): the expected seconds of the experiments not yet
  finished, scaled by how this machine compares with ``QUICK_SECONDS`` so far."""
  if not quick:
    return lambda now: ""
  expected_done = sum(QUICK_SECONDS.get(n, 60) for n in names[:i])
  speed = done_s / expected_done if expected_done and done_s > 0 else 1.0

  def left(now):
    current = max(QUICK_SECONDS.get(names[i], 60) * speed - (now - t_start), 0)
    rest = sum(QUICK_SECONDS.get(n, 60) for n in names[i + 1:]) * speed
    return f", ~{_minutes(current + rest)} left"
  return left


def _command(name: str, out: Path, args) -> tuple[list[str], list[str]]:
  """The experiment's command line, and the forwarded flags its ``run`` does not take."""
  safe = ["-P"] if sys.version_info >= (3, 11) else []  # Python >= 3.11; older ones run from where they are
  cmd = [sys.executable, *safe, "-m", REGISTRY[name][0], "--out", str(out)] + (["--quick"] if args.quick else [])
  if getattr(args, "devices", None) is not None:
    cmd += ["--devices", str(args.devices)]
  params, skipped = run_params(name), []
  for param, flag in FORWARDED.items():
    value = getattr(args, param, None)
    if value is None:
      continue
    if param in params:
      cmd += [flag, format_mesh(value) if param == "mesh" else str(value)]
    else:
      skipped.append(flag)
  return cmd, skipped


def compile_cache_dir(args) -> Path | None:
  """The persistent compilation cache the experiments share: ``--compile-cache`` ('off': none), else
  ``$JAX_COMPILATION_CACHE_DIR``, else ``$JAXSYS_HOME/xla-cache``."""
  chosen = getattr(args, "compile_cache", None) or os.environ.get("JAX_COMPILATION_CACHE_DIR")
  if chosen == "off":
    return None
  if chosen:
    return Path(chosen).expanduser()
  from jaxsys.models.llm.interop.pretrained import cache_dir  # noqa: PLC0415  (keeps this registry's import light)
  return cache_dir() / "xla-cache"


def child_env(args) -> dict[str, str]:
  """An experiment's environment: unbuffered output (the heartbeat shows the latest line, not what a
  block buffer holds back) and the shared compilation cache. Every executable is stored (XLA:CPU
  compiles in ~0.1-10 s, under JAX's default 1 s threshold for many): the run is compile-bound, and
  the experiments share programs (the SmolLM2 decode step, the same attention shapes) and rebuild
  equal ones under new ``jit`` wrappers."""
  env = dict(os.environ, PYTHONUNBUFFERED="1")
  cache = compile_cache_dir(args)
  if cache is None:
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    return env
  cache.mkdir(parents=True, exist_ok=True)
  env["JAX_COMPILATION_CACHE_DIR"] = str(cache)
  env.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
  env.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
  env.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(1 << 30))  # LRU-evicted past 1 GiB (a quick run: ~40 MiB)
  return env


def _run_one(name: str, out: Path, args, left) -> dict:
  cmd, skipped = _command(name, out, args)
  if skipped:
    print(f"      {name} takes no {', '.join(skipped)}: it runs with its own setting", flush=True)
  log_path = out / name / "log.txt"
  log_path.parent.mkdir(parents=True, exist_ok=True)
  result_path = out / name / "result.json"
  if result_path.exists():
    result_path.unlink()
  t0 = time.perf_counter()
  with open(log_path, "w") as log:
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=child_env(args))
    returncode = _wait_with_heartbeat(proc, log_path, t0, args.timeout, args.heartbeat, left)
  dt = time.perf_counter() - t0
  if returncode is None:
    res = {"name": name, "error": f"timed out after {args.timeout:.0f}s"}
    print(f"      TIMED OUT after {dt:.0f}s: see {log_path}", flush=True)
  elif returncode == 0 and result_path.exists():
    res = json.loads(result_path.read_text())
    print(f"      done in {dt:.0f}s ({len(res.get('rows', []))} rows)", flush=True)
  else:
    tail = log_path.read_text().strip().splitlines()[-1:] or ["no output"]
    res = {"name": name, "error": f"exit {returncode}: {tail[0][:120]}"}
    print(f"      FAILED in {dt:.0f}s: see {log_path}", flush=True)
  res["wall_seconds"] = round(dt, 1)
  return res


def reproduce(args) -> int:
  """``jaxsys reproduce``: runs the selected experiments one after the other, each in its own
  process; prints and writes the table. Exit 0 when every experiment finished, 1 otherwise."""
  names = args.only or list(REGISTRY)
  unknown = [n for n in names if n not in REGISTRY]
  if unknown:
    print(f"unknown experiment(s) {unknown}; known: {', '.join(REGISTRY)}", file=sys.stderr)
    return 2
  out = Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  results, t_all = [], time.perf_counter()
  for i, name in enumerate(names):
    done_s = time.perf_counter() - t_all
    left = _eta(names, i, time.perf_counter(), done_s, args.quick)
    print(f"[{i + 1}/{len(names)}] {name}: {REGISTRY[name][2]} ... ({_minutes(done_s)} so far"
          f"{left(time.perf_counter())})", flush=True)
    results.append(_run_one(name, out, args, left))
  command = " ".join(["jaxsys", "reproduce", *sys.argv[2:]]) if sys.argv[1:2] == ["reproduce"] \
      else "jaxsys reproduce" + (" --quick" if args.quick else "")
  table = format_table(results) + "\n\n" + format_footer(results, command)
  print("\n" + table)
  (out / "summary.md").write_text(table + "\n")
  (out / "summary.json").write_text(json.dumps(results, indent=2))
  print(f"\nresults in {out}/")
  return 0 if all(not r.get("error") for r in results) else 1
