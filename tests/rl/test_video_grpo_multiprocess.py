"""A cached_sp video GRPO step across two local processes (jax.distributed, gloo CPU collectives)."""

import sys
import textwrap
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _multiprocess import run_two_processes  # noqa: E402

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


@pytest.mark.slow
def test_cached_sp_step_across_two_processes(tmp_path):
  outs = run_two_processes(WORKER, tmp_path, timeout=240, what="cached_sp step")
  losses = [o.split("loss ")[1].split()[0] for o in outs]
  assert losses[0] == losses[1]  # one program: both processes see the same loss
