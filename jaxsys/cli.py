"""The ``jaxsys`` command.

  jaxsys --version                             the installed version
  jaxsys info                                  version, JAX version, devices, available implementations
  jaxsys reproduce [--quick] [--only NAME ...] [--list] [--out DIR] [--devices N] [--mesh AXES]
                   [--dtype D] [--seed S] [--compile-cache DIR]
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
import os
import sys
from pathlib import Path

__all__ = [
    "add_forwarded", "build_api_docs", "build_parser", "main", "REGISTRARS", "version",
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
  from jaxsys import experiments
  names = "\n".join(f"  {n:13s} {s}: {d}" for n, (_, s, d) in experiments.REGISTRY.items())
  r = sub.add_parser("reproduce", help="run the registered experiments and print a table",
                     formatter_class=argparse.RawDescriptionHelpFormatter,
                     epilog=f"experiments (in table order):\n{names}\n\n--mesh, --dtype and --seed go to the "
                            "experiments whose run takes them (--list says which); the others run with their own "
                            "setting and the progress line says so.")
  r.add_argument("--quick", action="store_true", help="small sizes: minutes on 2 CPU cores")
  r.add_argument("--only", nargs="+", metavar="NAME", help="run only these experiments")
  r.add_argument("--list", action="store_true", help="list the experiments and the flags each takes, then exit")
  r.add_argument("--out", default="runs", help="output folder (default: runs)")
  r.add_argument("--timeout", type=float, default=None, help="seconds per experiment")
  r.add_argument("--heartbeat", type=float, default=30.0,
                 help="seconds between progress lines while an experiment runs (0: none)")
  r.add_argument("--devices", type=int, default=None,
                 help="simulated CPU devices for every experiment (default: each experiment's own)")
  r.add_argument("--mesh", type=experiments.parse_mesh, default=None, metavar="AXES",
                 help="mesh axis sizes for the experiments that build a mesh, e.g. ring=2,ulysses=4")
  r.add_argument("--dtype", default=None, choices=("float32", "bfloat16"),
                 help="compute dtype for the experiments with a model (default: float32)")
  r.add_argument("--seed", type=experiments.parse_seed, default=None,
                 help="base seed for the experiments' data and initialisation (default: 0)")
  r.add_argument("--compile-cache", default=None, metavar="DIR",
                 help="JAX's persistent compilation cache for the experiments, shared by all of them (default: "
                      "$JAX_COMPILATION_CACHE_DIR, else $JAXSYS_HOME/xla-cache; 'off': none). Programs that two "
                      "experiments or two runs share compile once; timings never include compilation")
  r.set_defaults(fn=_reproduce)


def _reproduce(args) -> int:
  from jaxsys import experiments
  if args.list:
    for name, (_, system, desc) in experiments.REGISTRY.items():
      flags = ["--devices"] + [f for p, f in experiments.FORWARDED.items() if p in experiments.run_params(name)]
      print(f"{name:13s} {system:32s} ~{experiments.QUICK_SECONDS.get(name, 60):4.0f}s quick  "
            f"[{' '.join(flags)}]  {desc}")
    return 0
  return experiments.reproduce(args)


def _register_forwarded(sub) -> None:
  add_forwarded(sub, "serve", "jaxsys.serving.cli", "OpenAI-compatible server (or a prompt file)")
  add_forwarded(sub, "gates", "jaxsys.serving.gates_cli",
                "learn DuoAttention streaming-head gates for a model (the --gates file of serve)")
  add_forwarded(sub, "finetune", "jaxsys.serving.finetune_cli",
                "supervised fine-tuning on a chat file (full or LoRA, on a mesh), exported as HF + GGUF")
  add_forwarded(sub, "cluster", "jaxsys.cluster.cli", "cluster scheduling tools")


def _register_pretrained(sub) -> None:
  from jaxsys.models.llm.interop.pretrained import register_cli  # stdlib-only at import time
  from jaxsys.serving import chat_cli  # the same
  register_cli(sub)
  chat_cli.register_cli(sub)


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
