"""Ring attention across two local processes (jax.distributed, gloo CPU collectives)."""

import sys
import textwrap
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _multiprocess import run_two_processes  # noqa: E402

from jaxsys.core.errors import ConfigError  # noqa: E402
from jaxsys.parallel.distributed import detect_cluster, initialize_distributed  # noqa: E402

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


def test_ring_attention_across_two_processes(tmp_path):
  outs = run_two_processes(WORKER, tmp_path, timeout=150, what="ring attention")
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
