"""LServe gates at 8K: DuoAttention's distillation at the served length, as many steps as fit.

  python -m experiments.accel_gates --seconds 200 --out "$OUT"                  # GPU: distil at 8K
  python -m experiments.accel_gates --seconds 400 --passkey-lengths 8192        # + passkey if time allows
  python -m experiments.accel_gates --passkey-only --gates smollm2-135m-instruct-8k \\
      --passkey-lengths 2048,4096,8192 --passkey-seeds 48 --speed --seconds 86400   # later, on CPU

The distillation is ``jaxsys.serving.streaming.identify_streaming_heads`` (what ``jaxsys gates``
runs) on the text passkey documents of ``jaxsys.serving.gates_cli.distillation_data`` (seeds from
``--doc-seed`` on, disjoint from the passkey evaluation's 0-47), ``--batch-size`` documents per
step, sink / window / sparsity as the lserve experiment serves them (``experiments._lserve_smollm2``).
Steps are sized to the budget: one step is timed first (``identify_streaming_heads`` with
``steps=1`` compiles, then ``steps=2`` times two compiled steps), then the run gets every step that
fits in what is left minus ``--reserve``. If that first step fails (out of memory, a kernel the
backend refuses), the next of ``attempts()`` is tried: the same batch with ``impl="xla"``, then
half the batch; the gates record which one ran.

The gates go to ``<out>/gates/<name>.json`` (``jaxsys.assets.write_json``: ``StreamingGates``'
JSON plus the settings that made them: model, tokens, documents, steps, lr, L1, impl, seconds per
step, device, loss curve); the rows to ``<out>/accel_gates/result.json``. ``--passkey-lengths``
then runs ``experiments._lserve_smollm2.passkey_rows`` (dense, streaming only, page selection,
LServe; ``--passkey-seeds`` prompts) one length at a time while time is left, and ``--speed`` its
8K prefill / decode rows (dense vs LServe). ``--passkey-only`` skips the distillation and reads
the gates by asset name or path.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import numpy as np

from experiments import _lserve_smollm2 as L
from experiments.accel import MODEL, Budget, add_common_args, device_note, stand_in
from jaxsys.core.results import Row, write_result

NAME = "accel_gates"
DEFAULT_NAME = f"{MODEL}-8k"


def attempts(batch: int, impl: str) -> list[tuple[int, str]]:
  """``(batch, impl)`` to try in order until one step runs: as asked, then the XLA attention, then
  halving the batch (down to 1)."""
  out = [(batch, impl)] + ([(batch, "xla")] if impl != "xla" else [])
  b = batch // 2
  while b >= 1:
    out.append((b, "xla"))
    b //= 2
  return out


def distil(model, data, args, budget: Budget) -> tuple[object, dict]:
  """``(StreamingGates, settings)``: the timing probe, then the budgeted run (the probe's compiled
  step serves the run: ``identify_streaming_heads`` keeps one optimizer per learning rate)."""
  return _distil(model, data, args, budget)


def _distil(model, data, args, budget: Budget) -> tuple[object, dict]:
  from jaxsys.serving.streaming import identify_streaming_heads
  kw = dict(sink=L.SINK, window=L.WINDOW, sparsity=L.SPARSITY, lr=args.lr, l1=args.l1, seed=args.seed,
            progress=False)
  failures = []
  for batch, impl in attempts(args.batch_size, args.impl):
    try:
      t0 = time.perf_counter()
      identify_streaming_heads(model, data, steps=1, batch_size=batch, impl=impl, **kw)
      first = time.perf_counter() - t0
      t0 = time.perf_counter()
      identify_streaming_heads(model, data, steps=2, batch_size=batch, impl=impl, **kw)
      per_step = (time.perf_counter() - t0) / 2
      break
    except Exception as e:  # noqa: BLE001 - out of memory or a refused kernel: try the next setting
      failures.append(f"batch {batch}, impl {impl}: {type(e).__name__}: {str(e)[:300]}")
      print(f"[gates] {failures[-1]}", flush=True)
  else:
    raise RuntimeError("every distillation setting failed:\n" + "\n".join(failures))
  steps = int((budget.left() - args.reserve) // per_step)
  if args.max_steps:
    steps = min(steps, args.max_steps)
  if steps < 1:
    raise RuntimeError(f"one step takes {per_step:.1f} s (first, compiling: {first:.0f} s) and "
                       f"{budget.left():.0f} s are left with --reserve {args.reserve}: no step fits")
  print(f"[gates] batch {batch}, impl {impl}: first step {first:.1f} s, then {per_step:.2f} s/step; "
        f"{steps} steps", flush=True)
  t0 = time.perf_counter()
  gates = identify_streaming_heads(model, data, steps=steps, batch_size=batch, impl=impl, **kw)
  took = time.perf_counter() - t0
  settings = dict(model=MODEL if not args.smoke else "smoke stand-in", tokens=int(data[0].shape[1]),
                  documents=int(data[0].shape[0]), doc_seed=args.doc_seed, batch_size=batch, steps=steps,
                  lr=args.lr, l1=args.l1, init_seed=args.seed, impl=impl, sink=L.SINK, window=L.WINDOW,
                  sparsity=L.SPARSITY, dtype=args.dtype, first_step_seconds=round(first, 2),
                  seconds_per_step=round(per_step, 4), seconds=round(took, 1), failed_settings=failures,
                  date=time.strftime("%Y-%m-%d"), **device_note())
  return gates, settings


def _gates_rows(gates, settings) -> list[Row]:
  h = gates.history
  n = int(np.sum(gates.streaming))
  return [Row(f"gates distillation @{settings['tokens']} tokens: steps in the budget", "steps",
              ours=float(settings["steps"]),
              note=f"{settings['batch_size']} documents/step, {settings['seconds_per_step']} s/step on "
                   f"{settings['device']}, impl {settings['impl']}; loss {h[0]:.4g} -> {h[-1]:.4g} (mean of "
                   f"last 10 {np.mean(h[-10:]):.4g}); {n} of {np.size(gates.streaming)} kv heads streaming")]


def load_gates(spec: str):
  """Gates by asset name (``jaxsys.assets``) or file path."""
  import jaxsys.assets as A
  from jaxsys.serving.streaming import StreamingGates
  p = Path(spec)
  return StreamingGates.load(p if p.suffix in (".json", ".tsv") else A.path("gates", spec))


def evaluate(model, tok, gates, args, budget: Budget, details: dict) -> list[Row]:
  """Passkey rows per length while time is left (each length needs ``--min-seconds-per-length``),
  then the 8K speed rows with ``--speed``."""
  rows = []
  for n in args.passkey_lengths:
    if budget.left() < args.min_seconds_per_length:
      details.setdefault("skipped", []).append(f"passkey @{n}: {budget.left():.0f} s left")
      continue
    rows += L.passkey_rows(model, tok, gates, details, lengths=(n,), seeds=args.passkey_seeds, seed=args.seed)
  if args.speed:
    ctx = min(args.passkey_lengths or [8192]) if args.smoke else 8192 - 64
    rows += L.speed_rows(model, gates, ctx=ctx, new=4 if args.smoke else 32, rounds=1 if args.smoke else 3,
                         seed=args.seed)
  return rows


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="python -m experiments.accel_gates", description=__doc__.splitlines()[0])
  add_common_args(p, seconds=240)
  p.add_argument("--length", type=int, default=8192 - 32, help="tokens per document (default 8160: 8K)")
  p.add_argument("--documents", type=int, default=96, help="distillation documents (default 96)")
  p.add_argument("--doc-seed", type=int, default=1000, help="first document seed (default 1000)")
  p.add_argument("--batch-size", type=int, default=4, help="documents per step (default 4)")
  p.add_argument("--lr", type=float, default=0.05)
  p.add_argument("--l1", type=float, default=0.05)
  p.add_argument("--impl", default="auto", help="attention implementation (default auto)")
  p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
  p.add_argument("--max-steps", type=int, default=0, help="cap on steps (default: as many as fit)")
  p.add_argument("--reserve", type=float, default=15, help="seconds kept after distillation (default 15)")
  p.add_argument("--name", default=DEFAULT_NAME, help=f"asset name (default {DEFAULT_NAME})")
  p.add_argument("--passkey-lengths", type=lambda s: [int(x) for x in s.split(",") if x], default=[],
                 help="comma-separated passkey lengths to evaluate after (default none)")
  p.add_argument("--passkey-seeds", type=int, default=48)
  p.add_argument("--min-seconds-per-length", type=float, default=60,
                 help="start a passkey length only with this much time left (default 60)")
  p.add_argument("--speed", action="store_true", help="also the 8K prefill / decode rows, dense vs LServe")
  p.add_argument("--passkey-only", action="store_true", help="no distillation: evaluate --gates")
  p.add_argument("--gates", default=DEFAULT_NAME, help="--passkey-only: gates asset name or file")
  return p


def main(argv=None) -> int:
  p = build_parser()
  args = p.parse_args(argv)
  for name in ("length", "documents", "batch_size", "passkey_seeds"):
    if getattr(args, name) < 1:
      p.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
  if args.passkey_only and not (args.passkey_lengths or args.speed):
    p.error("--passkey-only needs --passkey-lengths or --speed (it has nothing else to do)")
  if args.smoke:  # tiny sizes on the stand-in (CPU)
    args.length, args.documents, args.batch_size, args.max_steps = 192, 4, 2, 3
    args.passkey_lengths = args.passkey_lengths and [256]
    args.passkey_seeds = min(args.passkey_seeds, 2)
  budget = Budget(args.seconds)
  from experiments._cli import with_compute_dtype
  from jaxsys.models import load_pretrained
  model, tok = stand_in() if args.smoke else load_pretrained(MODEL)
  model = with_compute_dtype(model, args.dtype)
  out, details, rows = Path(args.out), {}, []
  if args.passkey_only:
    gates, settings = load_gates(args.gates), {"gates": args.gates}
  else:
    from jaxsys.serving.gates_cli import distillation_data
    _, data = distillation_data(args.documents, args.length, args.doc_seed, tok)
    gates, settings = distil(model, data, args, budget)
    import jaxsys.assets as A
    path = A.write_json("gates", args.name, dataclasses.asdict(gates), settings, root=out)
    print(f"[gates] wrote {path}", flush=True)
    rows += _gates_rows(gates, settings)
  rows += evaluate(model, tok, gates, args, budget, details)
  write_result(NAME, rows, config=dict(settings, seconds_total=round(budget.spent(), 1),
                                       passkey_lengths=args.passkey_lengths, passkey_seeds=args.passkey_seeds),
               out_dir=out, quick=args.smoke, extra={"details": details})
  print(f"[gates] done in {budget.spent():.0f} s", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
