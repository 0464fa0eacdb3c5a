"""Two-stage multimodal sharding: frames split for the encoder, one all-to-all into zigzag shards."""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsys.core.errors import ShapeError
from jaxsys.core.mesh import make_mesh
from jaxsys.data import video
from jaxsys.parallel import api, multimodal, zigzag

sys.path.insert(0, os.path.dirname(__file__))
from _sp_helpers import build_mesh, mesh_context  # noqa: E402


def _setup(devices):
  mesh = make_mesh({"ring": 2, "ulysses": 4})
  plan = api.make_plan(mesh, "hybrid")
  spec = video.VideoSpec()
  raw = video.video_qa_batch(spec, seed=0, step=0, batch_size=2, n_frames=(3, 8), seq_len=33,
                             max_frames=8)
  nft = 8 * spec.tokens_per_frame
  return mesh, plan, raw, nft


def test_reshard_places_every_frame_token_in_its_zigzag_slot(devices):
  mesh, plan, raw, nft = _setup(devices)
  batch = multimodal.prepare_mm_batch(raw, plan, nft)
  b, L = batch["inputs"].shape
  ft = jnp.arange(b * nft * 4, dtype=jnp.float32).reshape(b, nft, 4) + 1.0  # distinct rows
  te = jnp.zeros((b, L, 4))
  fn = jax.jit(lambda ft, te, s, r: multimodal.reshard_to_llm(ft, te, s, r, mesh=mesh, plan=plan))
  got = np.asarray(fn(ft, te, batch["send_idx"], batch["recv_pos"]))
  slot = batch["frame_slot"]
  want = np.where((slot >= 0)[..., None], np.asarray(ft)[np.arange(b)[:, None], np.maximum(slot, 0)], 0.0)
  np.testing.assert_array_equal(got, want)
  # the LLM order is the zigzag order of the natural sequence
  np.testing.assert_array_equal(zigzag.zigzag_restore(slot, plan.ring_size),
                                np.asarray(raw["frame_slot"])[:, :-1])


def test_both_stages_on_every_mesh_kind(devices, mesh_kind):
  """Stage 1 placement + stage 2 all-to-all on each mesh kind, with and without a mesh context,
  and the one-device path (no all-to-all)."""
  spec = video.VideoSpec()
  raw = video.video_qa_batch(spec, seed=0, step=0, batch_size=2, n_frames=(3, 8), seq_len=33,
                             max_frames=8)
  nft = 8 * spec.tokens_per_frame
  for axes, inside in (({"ring": 2, "ulysses": 2}, False), ({"ring": 2, "ulysses": 2}, True),
                       ({"ring": 1}, True)):
    mesh = build_mesh(mesh_kind, axes)
    plan = api.make_plan(mesh, "hybrid" if len(axes) == 2 else "ring")
    batch = multimodal.prepare_mm_batch(raw, plan, nft)
    b, L = batch["inputs"].shape
    ft = jnp.arange(b * nft * 4, dtype=jnp.float32).reshape(b, nft, 4) + 1.0
    fn = jax.jit(lambda ft, te, s, r: multimodal.reshard_to_llm(  # noqa: B023
        multimodal.shard_frames(ft, mesh, plan), te, s, r, mesh=mesh, plan=plan))  # noqa: B023
    with mesh_context(mesh, inside):
      got = np.asarray(fn(ft, jnp.zeros((b, L, 4)), batch["send_idx"], batch["recv_pos"]))
    slot = batch["frame_slot"]
    want = np.where((slot >= 0)[..., None], np.asarray(ft)[np.arange(b)[:, None], np.maximum(slot, 0)], 0.0)
    np.testing.assert_array_equal(got, want)


def test_frame_encoder_on_frames_split_over_explicit_axes(devices):
  """Stage 1 on Explicit axes: the encoder takes frames typed as split over the SP ranks
  (per-video vmap, no reshape that merges the sharded frame dim behind the batch)."""
  from flax import nnx

  from jaxsys.models.vlm import FrameEncoder, VLMConfig
  mesh = build_mesh("explicit", {"ring": 2, "ulysses": 2})
  plan = api.make_plan(mesh, "hybrid")
  cfg = VLMConfig()
  encoder = FrameEncoder(cfg, rngs=nnx.Rngs(0))
  frames = jax.random.normal(jax.random.PRNGKey(0), (2, 4, cfg.patches, cfg.patch_dim))
  want = jax.jit(encoder)(frames)
  with mesh_context(mesh, True):
    got = jax.jit(lambda f: encoder(multimodal.shard_frames(f, mesh, plan)))(frames)
  assert got.sharding.spec[1] == ("ring", "ulysses")
  np.testing.assert_allclose(got, want, atol=1e-5)


def test_stage_two_moves_only_frame_tokens_by_all_to_all(devices):
  from jaxsys.parallel import costs
  mesh, plan, raw, nft = _setup(devices)
  batch = multimodal.prepare_mm_batch(raw, plan, nft)
  b, L = batch["inputs"].shape
  fn = jax.jit(lambda ft, te, s, r: multimodal.reshard_to_llm(ft, te, s, r, mesh=mesh, plan=plan))
  args = (jnp.ones((b, nft, 4)), jnp.ones((b, L, 4)), batch["send_idx"], batch["recv_pos"])
  comm = costs.hlo_collective_bytes(fn.lower(*args).compile().as_text())
  assert set(comm) == {"all-to-all"}, comm  # no all-reduce / all-gather of the sequence
  cap = batch["send_idx"].shape[-1]
  assert comm["all-to-all"] == pytest.approx(b * 8 * cap * 4 * 4 * 7 / 8)


def test_uneven_routes_are_padded_to_a_bucket():
  slot = np.full((1, 16), -1)
  slot[0, [0, 1, 2, 9]] = [0, 1, 2, 3]  # 3 tokens from rank 0 land on rank 0: cap 4
  send, recv = multimodal.reshard_maps(slot, num_frame_tokens=8, degree=2)
  assert send.shape == (1, 2, 2, 4)
  assert (recv[0, 0, 0, :3] == [0, 1, 2]).all() and recv[0, 0, 0, 3] == 8  # 8 = dropped
  with pytest.raises(ShapeError, match="cap=2 is smaller"):
    multimodal.reshard_maps(slot, num_frame_tokens=8, degree=2, cap=2)


def test_frames_must_split_evenly(devices):
  mesh = make_mesh({"ring": 2, "ulysses": 4})
  plan = api.make_plan(mesh, "hybrid")
  with pytest.raises(ShapeError, match="frames=6 must be divisible by the sequence-parallel degree 8"):
    multimodal.shard_frames(jnp.zeros((1, 6, 4, 8)), mesh, plan)
