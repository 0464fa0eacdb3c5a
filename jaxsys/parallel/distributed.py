"""Multi-host start-up: one call that makes the same script run on one CPU or on a pod.

``initialize_distributed()`` calls ``jax.distributed.initialize`` when the job spans several
processes and does nothing otherwise:

* explicit arguments (``coordinator_address``, ``num_processes``, ``process_id``), or the
  environment variables ``JAXSYS_COORDINATOR_ADDRESS`` / ``JAXSYS_NUM_PROCESSES`` /
  ``JAXSYS_PROCESS_ID``;
* SLURM (``SLURM_NTASKS > 1``) and Cloud TPU pods (several ``TPU_WORKER_HOSTNAMES``, or
  ``MEGASCALE_COORDINATOR_ADDRESS``): JAX auto-detects coordinator and ranks.

On the CPU backend it selects gloo collectives first so cross-process collectives run (two local
processes on 127.0.0.1 behave like two hosts). Call it before any other JAX work.

Usage::

  from jaxsys.parallel.distributed import initialize_distributed
  initialize_distributed()                       # no-op on a single host
  mesh = make_mesh({"ring": 2, "ulysses": -1})   # spans every process's devices
"""

from __future__ import annotations

import os

import jax

from jaxsys.core.errors import ConfigError

__all__ = ["detect_cluster", "initialize_distributed"]

_STATE = {"initialized": False}


def detect_cluster() -> str | None:
  """"explicit" | "slurm" | "tpu" when this process belongs to a multi-process job, else None."""
  if os.environ.get("JAXSYS_COORDINATOR_ADDRESS"):
    return "explicit"
  if int(os.environ.get("SLURM_NTASKS", "1") or 1) > 1 and "SLURM_PROCID" in os.environ:
    return "slurm"
  hosts = [h for h in os.environ.get("TPU_WORKER_HOSTNAMES", "").split(",") if h]
  if len(hosts) > 1 or os.environ.get("MEGASCALE_COORDINATOR_ADDRESS"):
    return "tpu"
  return None


def initialize_distributed(coordinator_address: str | None = None, num_processes: int | None = None,
                           process_id: int | None = None, *, local_device_ids=None,
                           cpu_collectives: str = "gloo") -> bool:
  """Initializes ``jax.distributed`` for a multi-process job; returns whether it did.

  Raises ``ConfigError`` for incomplete explicit arguments (all three are needed).
  """
  if _STATE["initialized"]:
    return True
  env = os.environ
  coordinator_address = coordinator_address or env.get("JAXSYS_COORDINATOR_ADDRESS")
  if num_processes is None and env.get("JAXSYS_NUM_PROCESSES"):
    num_processes = int(env["JAXSYS_NUM_PROCESSES"])
  if process_id is None and env.get("JAXSYS_PROCESS_ID"):
    process_id = int(env["JAXSYS_PROCESS_ID"])
  explicit = (coordinator_address, num_processes, process_id)
  if any(x is not None for x in explicit):
    if any(x is None for x in explicit):
      raise ConfigError(f"{coordinator_address=}, {num_processes=} and {process_id=} must all be "
                        "given for an explicit multi-process start")
    if not 0 <= process_id < num_processes:
      raise ConfigError(f"{process_id=} must be in [0, {num_processes=})")
    _cpu_collectives(cpu_collectives)
    jax.distributed.initialize(coordinator_address=coordinator_address,
                               num_processes=num_processes, process_id=process_id,
                               local_device_ids=local_device_ids)
  elif detect_cluster() in ("slurm", "tpu"):
    _cpu_collectives(cpu_collectives)
    jax.distributed.initialize()
  else:
    return False
  _STATE["initialized"] = True
  return True


def _cpu_collectives(impl: str):
  platforms = os.environ.get("JAX_PLATFORMS", "")
  if impl and (platforms in ("", "cpu") or platforms.startswith("cpu")):
    jax.config.update("jax_cpu_collectives_implementation", impl)
