"""One seed of the DATE comparison (both variants, the paper's SGD), for spreading the seeds of
``experiments.date`` over processes or machines and for longer schedules.

Command: ``python -m experiments._date_seed SEED STEPS OUT_DIR``; writes
``OUT_DIR/partial_s{SEED}_n{STEPS}.json`` (``{"curves": ..., "finals": ...}`` as
``experiments.date`` keeps them, one run per variant). Every other setting is full mode's
(``experiments.date._settings(False)``). Summarise several seeds with ``experiments.date.steps_to``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import jax

from experiments import date


def main(argv: list[str]) -> None:
  if len(argv) != 3:
    raise SystemExit("usage: python -m experiments._date_seed SEED STEPS OUT_DIR")
  seed, steps, out = int(argv[0]), int(argv[1]), Path(argv[2])
  if steps < 1:
    raise SystemExit(f"{steps=} must be >= 1")
  out.mkdir(parents=True, exist_ok=True)
  jax.config.update("jax_compilation_cache_dir", str(out / ".jax_cache"))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  st = {**date._settings(False), "steps": steps, "seeds": [seed]}
  _, train, ev, gts, cfgs = date.setup(st)
  date._train_all(st, st["optimizers"]["sgd"], cfgs, train, ev, gts, out, f"s{seed}_n{steps}")
  print(f"done: seed {seed}, {steps} steps -> {out}", file=sys.stderr)


if __name__ == "__main__":
  os.environ.setdefault("PYTHONUNBUFFERED", "1")
  main(sys.argv[1:])
