"""Ring attention across two local processes (jax.distributed, gloo CPU collectives)."""

import os
import socket
import subprocess
import sys
import textwrap

import pytest

from jaxsys.core.errors import ConfigError
from jaxsys.parallel.distributed import detect_cluster, initialize_distributed

WORKER = textwrap.dedent("""
    import os, sys
    import numpy as np
    from jaxsys.parallel.distributed import initialize_distributed
    assert initialize_distributed()          # reads JAXSYS_* from the environment
    import jax, jax.numpy as jnp
    from jax.experimental import multihost_utils
    from jax.sharding import NamedSharding, PartitionSpec as P
    from jaxsys.core.mesh import make_mesh
    from jaxsys.ops import attention, masks
    from jaxsys.parallel import sequence_parallel_attention

    assert jax.process_count() == 2 and jax.device_count() == 4, (jax.process_count(), jax.device_count())
    mesh = make_mesh({"ring": 4})             # the ring spans both processes
    rng = np.random.default_rng(0)            # same data in both processes
    q = rng.standard_normal((1, 16, 4, 8)).astype(np.float32)
    k = rng.standard_normal((1, 16, 2, 8)).astype(np.float32)
    v = rng.standard_normal((1, 16, 2, 8)).astype(np.float32)
    sh = NamedSharding(mesh, P())
    glob = [jax.make_array_from_callback(x.shape, sh, lambda idx, x=x: x[idx]) for x in (q, k, v)]
    fn = jax.jit(lambda q, k, v: sequence_parallel_attention(
        q, k, v, mesh=mesh, strategy="zigzag", mask=masks.Causal(), impl="reference"))
    out = multihost_utils.process_allgather(fn(*glob), tiled=True)
    want = attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), mask=masks.Causal(),
                     impl="reference")
    err = float(np.max(np.abs(np.asarray(out) - np.asarray(want))))
    print(f"process {jax.process_index()} max_err {err:.2e}", flush=True)
    sys.exit(0 if err < 1e-5 else 1)
""")


def _free_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def test_ring_attention_across_two_processes(tmp_path):
  script = tmp_path / "worker.py"
  script.write_text(WORKER)
  port = _free_port()
  procs = []
  for pid in range(2):
    env = dict(os.environ)
    env.update({"XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu",
                "JAXSYS_COORDINATOR_ADDRESS": f"127.0.0.1:{port}", "JAXSYS_NUM_PROCESSES": "2",
                "JAXSYS_PROCESS_ID": str(pid)})
    procs.append(subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True))
  outs = []
  try:
    for p in procs:
      outs.append(p.communicate(timeout=150)[0])
  except subprocess.TimeoutExpired:
    for p in procs:
      p.kill()
    pytest.fail("two-process ring attention timed out")
  for p, out in zip(procs, outs):
    assert p.returncode == 0, out[-3000:]
  assert all("max_err" in o for o in outs)


def test_single_process_is_a_no_op(monkeypatch):
  for var in ("JAXSYS_COORDINATOR_ADDRESS", "JAXSYS_NUM_PROCESSES", "JAXSYS_PROCESS_ID",
              "SLURM_NTASKS", "TPU_WORKER_HOSTNAMES", "MEGASCALE_COORDINATOR_ADDRESS"):
    monkeypatch.delenv(var, raising=False)
  assert detect_cluster() is None
  assert initialize_distributed() is False


def test_incomplete_explicit_arguments():
  with pytest.raises(ConfigError, match="must all be given"):
    initialize_distributed(coordinator_address="127.0.0.1:1234")
