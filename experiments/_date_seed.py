"""One seed of the DATE comparison (both variants, the paper's SGD), for spreading the seeds of
``experiments.date`` over processes or machines and for longer schedules.

Command: ``python -m experiments._date_seed SEED STEPS OUT_DIR [--base-seed B]``; writes
``OUT_DIR/partial_s{S}_n{STEPS}.json`` (``{"curves": ..., "finals": ...}`` as
``experiments.date`` keeps them, one run per variant), S = ``reseed(SEED, B)``. Every other setting
is full mode's (``experiments.date._settings(False)``). Summarise several seeds with
``experiments.date.steps_to``. ``--base-seed B`` is ``experiments.date``'s ``--seed``: the data are
drawn from it and the run is that of seed ``reseed(SEED, B)`` there (default 0: the default table).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import jax

from experiments import date
from experiments._cli import reseed


def _count(minimum: int):
  def parse(text: str) -> int:
    if not text.isdigit() or int(text) < minimum:
      raise argparse.ArgumentTypeError(f"{text!r} must be an integer >= {minimum}")
    return int(text)
  return parse


def main(argv: list[str]) -> None:
  parser = argparse.ArgumentParser(prog="python -m experiments._date_seed",
                                   description=(__doc__ or "").strip().splitlines()[0])
  parser.add_argument("seed", type=_count(0), help="model / data-order seed (integer >= 0)")
  parser.add_argument("steps", type=_count(1), help="training steps (integer >= 1)")
  parser.add_argument("out", type=Path, help="output folder")
  parser.add_argument("--base-seed", type=_count(0), default=0, metavar="B",
                      help="experiments.date's --seed B: its data, and its run of seed reseed(SEED, B) "
                           "(default 0)")
  args = parser.parse_args(argv)
  base, steps, out = args.base_seed, args.steps, args.out
  seed = reseed(args.seed, base)  # the seed experiments.date --seed B gives its run SEED
  out.mkdir(parents=True, exist_ok=True)
  jax.config.update("jax_compilation_cache_dir", str(out / ".jax_cache"))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  st = {**date._settings(False, base), "steps": steps, "seeds": [seed]}
  _, train, ev, gts, cfgs = date.setup(st, base)
  date._train_all(st, st["optimizers"]["sgd"], cfgs, train, ev, gts, out, f"s{seed}_n{steps}")
  print(f"done: seed {seed}, {steps} steps -> {out}", file=sys.stderr)


if __name__ == "__main__":
  os.environ.setdefault("PYTHONUNBUFFERED", "1")
  main(sys.argv[1:])
