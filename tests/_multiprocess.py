"""Subprocess helpers shared by the tests: the suite's XLA flags with another simulated device
count, and a worker script run as two local ``jax.distributed`` processes (gloo CPU collectives,
2 devices each)."""

import os
import socket
import subprocess
import sys

import pytest


def xla_flags(device_count: int | None = None) -> str:
  """This process's ``XLA_FLAGS`` (tests/conftest.py: 8 devices, backend optimisation level) with
  the simulated device count replaced by ``device_count`` (None: XLA's default, one device)."""
  flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
           if "xla_force_host_platform_device_count" not in f]
  if device_count is not None:
    flags.append(f"--xla_force_host_platform_device_count={device_count}")
  return " ".join(flags)


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def run_two_processes(worker: str, tmp_path, *, timeout: float, what: str) -> list[str]:
  """Starts ``worker`` (Python source) as processes 0 and 1 of one job; fails the test with the
  output tail if either exits non-zero, and kills both on ``timeout``."""
  script = tmp_path / "worker.py"
  script.write_text(worker)
  port = free_port()
  procs = []
  for pid in range(2):
    env = dict(os.environ)
    env.update({"XLA_FLAGS": xla_flags(2), "JAX_PLATFORMS": "cpu",
                "JAXSYS_COORDINATOR_ADDRESS": f"127.0.0.1:{port}", "JAXSYS_NUM_PROCESSES": "2",
                "JAXSYS_PROCESS_ID": str(pid)})
    procs.append(subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True))
  outs = []
  try:
    for p in procs:
      outs.append(p.communicate(timeout=timeout)[0])
  except subprocess.TimeoutExpired:
    for p in procs:
      p.kill()
    pytest.fail(f"two-process {what} timed out")
  for p, out in zip(procs, outs):
    assert p.returncode == 0, out[-3000:]
  return outs
