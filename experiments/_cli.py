"""Shared ``__main__`` handling for experiment modules: the same flags for every experiment.

``python -m experiments.<name> [--quick] [--out DIR] [--devices N] [--mesh AXES] [--dtype D] [--seed S]
[--parts ...]``

* ``--devices N``: N simulated devices on the CPU (XLA's host platform). It never changes what a
  GPU or TPU backend sees: there every local chip is used. Default: the experiment's own
  ``DEVICES`` (8 for the parallel ones, else 1), unless ``XLA_FLAGS`` already sets a count.
* ``--mesh AXES``: mesh axis sizes, e.g. ``ring=2,ulysses=4`` or ``graph=8``; only for the
  experiments whose ``run`` takes ``mesh`` (``--help`` lists it when it does).
* ``--dtype``: compute dtype of the experiment's models (``float32`` or ``bfloat16``; parameters
  stay as stored), where ``run`` takes ``dtype``: the decoder-family and VLM experiments
  (``with_compute_dtype``) and mmsp's attention inputs.
* ``--seed S``: base seed of the data and initialisation, where ``run`` takes ``seed`` (``jaxsys
  reproduce --seed S`` reruns the quick table on other draws: experiments/README.md has the spread).
* XLA:CPU: ``jaxsys.core.xla_cpu.apply()`` adds the CPU compiler flags measured on these workloads
  (convolutions outside YNNPACK) to ``XLA_FLAGS`` before any JAX work.
* Multi-host: every experiment calls ``jaxsys.parallel.distributed.initialize_distributed()``
  before any JAX work, so the same command runs under SLURM ``srun``, on every worker of a TPU VM
  pod, or with ``JAXSYS_COORDINATOR_ADDRESS`` / ``JAXSYS_NUM_PROCESSES`` / ``JAXSYS_PROCESS_ID``
  (see docs/pods.md). Only process 0 writes results.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import os
import re
import sys

from jaxsys.core import xla_cpu
from jaxsys.experiments import parse_mesh, parse_seed  # the runner's parsers too

_COUNT = "--xla_force_host_platform_device_count"
SEED_STRIDE = 100_003  # a prime far above any literal seed an experiment uses, so streams never collide


def reseed(base: int, seed: int) -> int:
  """An experiment's literal seed ``base`` under the run's ``--seed``: ``base`` itself at seed 0 (the
  default table is unchanged), and for other seeds a value no other (base, seed) pair gives."""
  return int(base) + SEED_STRIDE * int(seed)


def with_compute_dtype(model, dtype: str = "float32"):
  """A decoder-family ``model`` computing in ``dtype`` (the ``--dtype`` flag): activations, matmuls
  and the KV cache in ``dtype``, parameters as stored (mixed precision, as on an accelerator);
  ``"float32"`` returns ``model`` itself, so the default table is unchanged."""
  if dtype == "float32":
    return model
  from jaxsys.models.llm.decoder import replace_config
  return replace_config(model, dtype=dtype)


def set_cpu_devices(n: int) -> None:
  """Asks XLA's CPU platform for ``n`` devices (no effect on GPU/TPU backends). Must run before JAX
  creates its backends; raises if they exist with another count."""
  if n < 1:
    raise ValueError(f"--devices {n}: must be >= 1")
  flags = re.sub(rf"{_COUNT}=\d+", "", os.environ.get("XLA_FLAGS", "")).strip()
  os.environ["XLA_FLAGS"] = f"{flags} {_COUNT}={n}".strip()
  from jax._src import xla_bridge
  if xla_bridge.backends_are_initialized():
    import jax
    have = len(jax.devices("cpu"))
    if have != n:
      raise RuntimeError(f"--devices {n}: JAX's CPU backend already started with {have} devices; "
                         "set the count before any JAX work")


def main(name: str, argv=None):
  """Parses the shared flags and calls ``experiments.<module>.run``; prints the rows."""
  from experiments import REGISTRY
  module = importlib.import_module(REGISTRY[name][0])
  params = inspect.signature(module.run).parameters
  default_devices = getattr(module, "DEVICES", 1)
  parser = argparse.ArgumentParser(prog=f"python -m experiments.{name}",
                                   description=(module.__doc__ or "").strip().splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="small sizes (a few minutes on 2 CPU cores)")
  parser.add_argument("--out", default="runs", help="output folder (default: runs)")
  parser.add_argument("--devices", type=int, default=None,
                      help=f"simulated CPU devices (default {default_devices}, or XLA_FLAGS' own count); "
                           "GPU/TPU backends always use their real chips")
  if "mesh" in params:
    parser.add_argument("--mesh", type=parse_mesh, default=None,
                        help=f"mesh axis sizes, e.g. {getattr(module, 'MESH_EXAMPLE', 'data=8')} "
                             "(default: the experiment's own)")
  if "dtype" in params:
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                        help="compute dtype (default float32)")
  if "seed" in params:
    parser.add_argument("--seed", type=parse_seed, default=0,
                        help="base seed of the data and initialisation (default 0); jaxsys reproduce --seed")
  parts = getattr(module, "PARTS", None)
  if parts:
    parser.add_argument("--parts", nargs="+", choices=parts, default=None,
                        help="run only these parts (default: all); the result is written to <name>_<parts>")
  args = parser.parse_args(argv)
  if args.devices is not None or _COUNT not in os.environ.get("XLA_FLAGS", ""):
    set_cpu_devices(args.devices or default_devices)
  xla_cpu.apply()  # XLA:CPU settings measured on these workloads (jaxsys.core.xla_cpu)
  from jaxsys.parallel.distributed import initialize_distributed
  initialize_distributed()  # no-op on one host
  kw = {}
  if parts and args.parts:
    kw["parts"] = args.parts
  if getattr(args, "mesh", None):
    kw["mesh"] = args.mesh
  for param in ("dtype", "seed"):
    if param in params:
      kw[param] = getattr(args, param)
  from jaxsys.core.errors import ConfigError
  try:
    rows = module.run(quick=args.quick, out_dir=args.out, **kw)
  except ConfigError as e:  # a setting that cannot work here: the message says what to change
    print(f"python -m experiments.{name}: error: {e}", file=sys.stderr)
    return 2
  for r in rows:
    print(f"{r.metric}: baseline={r.baseline} ours={r.ours} {r.unit} ratio={r.ratio} ideal={r.ideal} goal={r.goal} met={r.met}")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1]))
