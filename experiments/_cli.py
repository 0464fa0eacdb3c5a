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
  args = parser.parse_args(argv)
  module = importlib.import_module(REGISTRY[name][0])
  rows = module.run(quick=args.quick, out_dir=args.out)
  for r in rows:
    print(f"{r.metric}: baseline={r.baseline} ours={r.ours} {r.unit} ratio={r.ratio} ideal={r.ideal} goal={r.goal} met={r.met}")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1]))
