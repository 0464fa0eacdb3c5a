"""A cached_sp video GRPO step across two local processes (jax.distributed, gloo CPU collectives)."""

import os
import socket
import subprocess
import sys
import textwrap

import pytest

WORKER = textwrap.dedent("""
    import sys
    import numpy as np
    from jaxsys.parallel.distributed import initialize_distributed
    assert initialize_distributed()          # reads JAXSYS_* from the environment
    import jax
    from flax import nnx
    from jaxsys.core.mesh import make_mesh
    from jaxsys.data import video
    from jaxsys.models import DecoderConfig
    from jaxsys.models.vlm import VLM, VLMConfig
    from jaxsys.rl import video_grpo as vg, video_tasks as vt

    assert jax.process_count() == 2 and jax.device_count() == 4
    cfg = VLMConfig(lm=DecoderConfig(vocab_size=vt.VOCAB, hidden_size=32, intermediate_size=64,
                                     num_layers=1, num_heads=8, num_kv_heads=8))
    model = VLM(cfg, rngs=nnx.Rngs(0))       # same weights and data in both processes
    mesh = make_mesh({"ulysses": 4})          # the SP axis spans both processes
    tasks = vt.VideoTaskSampler(video.VideoSpec(), n_frames=8, seed=0)
    t = vg.VideoGRPOTrainer(model, tasks, vg.VideoGRPOConfig(mode="cached_sp"), mesh=mesh)
    m = t.step()
    assert m["encoded_videos"] == 2 and np.isfinite(m["loss"]), m
    print(f"process {jax.process_index()} loss {m['loss']:.4f} reward {m['reward_mean']:.3f}", flush=True)
""")


def _free_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@pytest.mark.slow
def test_cached_sp_step_across_two_processes(tmp_path):
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
      outs.append(p.communicate(timeout=240)[0])
  except subprocess.TimeoutExpired:
    for p in procs:
      p.kill()
    pytest.fail("two-process cached_sp step timed out")
  for p, out in zip(procs, outs):
    assert p.returncode == 0, out[-3000:]
  losses = [o.split("loss ")[1].split()[0] for o in outs]
  assert losses[0] == losses[1]  # one program: both processes see the same loss
