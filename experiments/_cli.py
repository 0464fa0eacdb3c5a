"""Shared ``__main__`` handling for experiment modules."""

from __future__ import annotations

import argparse
import importlib
import sys


def main(name: str, argv=None):
  """Parses ``--quick`` / ``--out`` and calls ``experiments.<module>.run``; prints the rows."""
  from experiments import REGISTRY
  parser = argparse.ArgumentParser(prog=f"python -m experiments.{name}")
  parser.add_argument("--quick", action="store_true", help="small sizes (a few minutes on 2 CPU cores)")
  parser.add_argument("--out", default="runs", help="output folder (default: runs)")
  module = importlib.import_module(REGISTRY[name][0])
  parts = getattr(module, "PARTS", None)
  if parts:
    parser.add_argument("--parts", nargs="+", choices=parts, default=None,
                        help="run only these parts (default: all); the result is written to <name>_<parts>")
  args = parser.parse_args(argv)
  kw = {"parts": args.parts} if parts and args.parts else {}
  rows = module.run(quick=args.quick, out_dir=args.out, **kw)
  for r in rows:
    print(f"{r.metric}: baseline={r.baseline} ours={r.ours} {r.unit} ratio={r.ratio} ideal={r.ideal} goal={r.goal} met={r.met}")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1]))
