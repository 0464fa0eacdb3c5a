"""The ``jaxsys`` command.

  jaxsys --version                             the installed version
  jaxsys info                                  version, JAX version, devices, available implementations
  jaxsys reproduce [--quick] [--only NAME ...] [--out DIR]
                                               run registered experiments, print a table, write runs/
  jaxsys serve ...                             OpenAI-compatible HTTP server (or the engine on a prompt file)
  jaxsys gates --model M --out gates.json      learn DuoAttention streaming-head gates (serve --gates)
  jaxsys cluster ...                           scheduler simulator sweeps and trace summaries

Subcommands come from the functions in :data:`REGISTRARS`; each takes the ``jaxsys`` subparsers
and adds its commands, either a parser with ``set_defaults(fn=...)`` (``fn(args) -> exit code``)
or, through :func:`add_forwarded`, a command whose own module parses the rest of the command line.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

__all__ = [
    "add_forwarded", "build_api_docs", "build_parser", "format_table", "main", "REGISTRARS", "version",
]


def version() -> str:
  """The installed distribution's version, or the source tree's ``jaxsys.__version__``."""
  from importlib import metadata
  try:
    return metadata.version("jaxsys")
  except metadata.PackageNotFoundError:
    import jaxsys
    return jaxsys.__version__


def _info(_args) -> int:
  import jax
  from jaxsys.ops.attn import api
  print(f"jaxsys {version()}")
  print(f"jax {jax.__version__} ({jax.default_backend()})")
  for d in jax.devices():
    print(f"  device: {d}")
  for name in api.IMPLS[1:]:
    try:
      api._load(name)
      ok = "available"
      if name == "pallas" and jax.default_backend() == "cpu":
        ok = "compiles for gpu/tpu only (use pallas_interpret on cpu)"
    except NotImplementedError as e:
      ok = f"unavailable ({e})"
    print(f"  attention impl {name}: {ok}")
  print(f"  auto order: {', '.join(api.auto_order())}")
  return 0


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
  from jaxsys.experiments import REGISTRY
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


def _last_line(path: Path, limit: int = 4096) -> str:
  """The last non-empty line of a log (tqdm bars end their lines with carriage returns)."""
  with open(path, "rb") as fh:
    fh.seek(0, os.SEEK_END)
    fh.seek(max(0, fh.tell() - limit))
    text = fh.read().decode("utf-8", "replace")
  lines = [x.strip() for x in text.replace("\r", "\n").splitlines() if x.strip()]
  return lines[-1] if lines else ""


def _wait_with_heartbeat(proc, log_path: Path, t0: float, timeout, every: float):
  """Waits for ``proc``; every ``every`` seconds prints the elapsed time and the log's last line.
  Returns the exit code, or None after killing it at ``timeout`` seconds."""
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
      print(f"      ... {now - t0:.0f}s  {_last_line(log_path)[:100]}", flush=True)
      next_beat = now + every


def _reproduce(args) -> int:
  from jaxsys.experiments import REGISTRY
  names = args.only or list(REGISTRY)
  unknown = [n for n in names if n not in REGISTRY]
  if unknown:
    print(f"unknown experiment(s) {unknown}; known: {', '.join(REGISTRY)}", file=sys.stderr)
    return 2
  out = Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  results = []
  t_all = time.perf_counter()
  for i, name in enumerate(names, 1):
    module = REGISTRY[name][0]
    print(f"[{i}/{len(names)}] {name}: {REGISTRY[name][2]} ...", flush=True)
    t0 = time.perf_counter()
    # -P: the working directory is not put on sys.path, so a local ``experiments`` package cannot
    # shadow the installed scripts (Python >= 3.11; older ones run from where they are).
    safe = ["-P"] if sys.version_info >= (3, 11) else []
    cmd = [sys.executable, *safe, "-m", module, "--out", str(out)] + (["--quick"] if args.quick else [])
    log_path = out / name / "log.txt"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    result_path = out / name / "result.json"
    if result_path.exists():
      result_path.unlink()
    with open(log_path, "w") as log:
      proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ))
      returncode = _wait_with_heartbeat(proc, log_path, t0, args.timeout, args.heartbeat)
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
    results.append(res)
  table = format_table(results)
  print()
  print(table)
  (out / "summary.md").write_text(table + "\n")
  (out / "summary.json").write_text(json.dumps(results, indent=2))
  print(f"\n{len(names)} experiments in {time.perf_counter() - t_all:.0f}s; results in {out}/")
  return 0 if all(not r.get("error") for r in results) else 1


def _public_modules() -> list[str]:
  """Every importable module of jaxsys and pallas_kernels whose dotted name has no private part."""
  import pkgutil

  import jaxsys
  import pallas_kernels
  names = ["jaxsys", "pallas_kernels"]
  for pkg in (jaxsys, pallas_kernels):
    for info in pkgutil.walk_packages(pkg.__path__, prefix=pkg.__name__ + "."):
      if not any(part.startswith("_") for part in info.name.split(".")):
        names.append(info.name)
  return names


def build_api_docs(out: str | os.PathLike) -> Path:
  """Writes the HTML API reference of ``jaxsys`` and ``pallas_kernels`` (pdoc) into ``out``.

  Every package's lazy exports are resolved first, so each package page lists its API; a name
  in an ``__all__`` that does not resolve is an error (pdoc only warns).
  """
  import importlib
  import warnings
  try:
    import pdoc
  except ImportError as e:
    raise SystemExit("jaxsys docs needs pdoc: pip install pdoc (it is in the dev extra)") from e
  import jaxsys
  for name in jaxsys._SUBMODULES:
    pkg = importlib.import_module(f"jaxsys.{name}")
    for attr in getattr(pkg, "__all__", ()):
      getattr(pkg, attr)
  out = Path(out)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    pdoc.pdoc(*_public_modules(), output_directory=out)
  unresolved = [str(w.message) for w in caught if "does not resolve" in str(w.message)]
  if unresolved:
    raise RuntimeError("names in __all__ that do not resolve:\n" + "\n".join(unresolved))
  return out


def _docs(args) -> int:
  out = build_api_docs(args.out)
  print(f"API reference written to {out}/index.html")
  return 0


def add_forwarded(sub, name: str, module: str, help_: str) -> None:
  """Registers ``jaxsys NAME ...``: everything after NAME goes untouched to ``module.main(argv)``
  (its own parser, help and exit codes). The parser added here only lists NAME in ``jaxsys --help``:
  :func:`main` dispatches on NAME before the top-level parser sees the rest, so leading options,
  ``--help`` and ``--`` reach the module as typed."""
  sub.add_parser(name, help=help_, add_help=False).set_defaults(forward=module)


def _register_core(sub) -> None:
  sub.add_parser("info", help="version, JAX version, devices and available implementations"
                 ).set_defaults(fn=_info)
  d = sub.add_parser("docs", help="write the HTML API reference (pdoc) into a folder")
  d.add_argument("--out", default="docs/api", help="output folder (default: docs/api)")
  d.set_defaults(fn=_docs)
  r = sub.add_parser("reproduce", help="run the registered experiments and print a table")
  r.add_argument("--quick", action="store_true", help="small sizes: minutes on 2 CPU cores")
  r.add_argument("--only", nargs="+", metavar="NAME", help="run only these experiments")
  r.add_argument("--out", default="runs", help="output folder (default: runs)")
  r.add_argument("--timeout", type=float, default=None, help="seconds per experiment")
  r.add_argument("--heartbeat", type=float, default=30.0,
                 help="seconds between progress lines while an experiment runs (0: none)")
  r.set_defaults(fn=_reproduce)


def _register_forwarded(sub) -> None:
  add_forwarded(sub, "serve", "jaxsys.serving.cli", "OpenAI-compatible server (or a prompt file)")
  add_forwarded(sub, "gates", "jaxsys.serving.gates_cli",
                "learn DuoAttention streaming-head gates for a model (the --gates file of serve)")
  add_forwarded(sub, "cluster", "jaxsys.cluster.cli", "cluster scheduling tools")


def _register_pretrained(sub) -> None:
  from jaxsys.models.pretrained import register_cli  # stdlib-only at import time
  register_cli(sub)


#: Functions ``register(subparsers)`` that add the ``jaxsys`` subcommands, in ``--help`` order.
#: Registering must stay cheap (no JAX import): import heavy modules inside the command itself.
REGISTRARS = [_register_core, _register_pretrained, _register_forwarded]


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="jaxsys", description="jaxsys: efficient ML systems in JAX")
  p.add_argument("--version", action="version", version=f"jaxsys {version()}")
  sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
  for register in REGISTRARS:
    register(sub)
  return p


def _subcommand(parser: argparse.ArgumentParser, name: str):
  for action in parser._actions:
    if isinstance(action, argparse._SubParsersAction):
      return action.choices.get(name)
  return None


def main(argv=None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  parser = build_parser()
  sub = _subcommand(parser, argv[0]) if argv else None
  module = None if sub is None else sub.get_default("forward")
  if module is not None:
    # The module's exit code (or its SystemExit) passes through unchanged.
    rc = importlib.import_module(module).main(argv[1:])
    return 0 if rc is None else rc
  args = parser.parse_args(argv)
  return args.fn(args)


if __name__ == "__main__":
  sys.exit(main())
