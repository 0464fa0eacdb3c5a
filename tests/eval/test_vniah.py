"""Video needle-in-a-haystack: data layout, grid scoring with hybrid SP, heatmap."""

import numpy as np
import pytest
from flax import nnx

from jaxsys.core.errors import ConfigError
from jaxsys.core.mesh import make_mesh
from jaxsys.data import video
from jaxsys.eval import vniah
from jaxsys.models.vlm import VLM, VLMConfig

SMALL = VLMConfig(lm=VLMConfig().lm.replace(num_layers=1))


def test_needle_frame_is_marked_at_depth():
  spec = video.VideoSpec()
  marker, glyphs = spec.world()
  rng = np.random.default_rng(0)
  frames, idx = video.make_frames(spec, rng, 9, 0.5, (3, 5))
  assert idx == 4
  score = frames.mean(1) @ marker  # the marker is added to every patch of the needle
  assert int(np.argmax(score)) == 4
  assert int(np.argmax(glyphs @ (frames[idx, 0] - marker))) == 3


def test_layout_row_and_errors():
  spec = video.VideoSpec()
  row = video.layout_row(3, spec, 16, code=(7, 2))
  assert row["tokens"][0] == video.BOS and (row["tokens"][1:7] == video.FRAME).all()
  assert list(row["tokens"][9:12]) == [7, 2, video.EOS] and row["answer_start"] == 9
  assert row["loss_mask"].sum() == 3 and (row["segment_ids"][12:] == -1).all()
  with pytest.raises(ConfigError, match="seq_len=8 is too short for n_frames=3"):
    video.layout_row(3, spec, 8)


def test_grid_scores_exact_match_with_hybrid_sp(devices, tmp_path):
  """Scoring runs end to end on the 8-device hybrid mesh and equals the unsharded model's grid."""
  from jaxsys.models.vlm import rebuild
  mesh = make_mesh({"ring": 2, "ulysses": 4})
  model = VLM(SMALL, rngs=nnx.Rngs(0), mesh=mesh, strategy="hybrid", impl="reference")
  spec = video.VideoSpec()
  grid = vniah.vniah_grid(model, spec, frames=[4], depths=[0.0, 1.0], samples=2)
  assert grid.accuracy.shape == (1, 2) and 0.0 <= grid.mean <= 1.0
  single = rebuild(model, mesh=make_mesh({"ring": 1}, devices[:1]), strategy="ring")
  raw = video.video_qa_batch(spec, seed=7, step=0, batch_size=4, n_frames=4,
                             seq_len=vniah.seq_bucket(4, spec, 16), max_frames=8)
  p_sp = vniah.answer_greedy(model, raw, model.plan, 16)
  p_1 = vniah.answer_greedy(single, raw, single.plan, 16)
  np.testing.assert_array_equal(p_sp, p_1)  # the greedy answers are the model's, not the sharding's
  vniah.plot_heatmap(grid, tmp_path / "h.png", title="t")
  assert (tmp_path / "h.png").stat().st_size > 1000
