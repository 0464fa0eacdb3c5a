"""The VLM: shapes, interleaving, and a sequence-parallel training step equal to the unsharded one."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxsys.core.errors import ConfigError, ShapeError
from jaxsys.core.mesh import make_mesh
from jaxsys.data import video
from jaxsys.models.vlm import VLM, VLMConfig, vlm_loss, with_rope_theta
from jaxsys.parallel import api, multimodal


SMALL = VLMConfig(lm=VLMConfig().lm.replace(num_layers=1))  # one LM layer: quicker compiles


def _batch(plan, seed=0):
  raw = video.video_qa_batch(video.VideoSpec(), seed=seed, step=0, batch_size=2, n_frames=(3, 8),
                             seq_len=33, max_frames=8)
  return multimodal.prepare_mm_batch(raw, plan, VLMConfig().num_frame_tokens(8))


def _loss_and_grads(model, batch, mesh):
  graphdef, params = nnx.split(model)

  def f(p):
    total, count, _ = vlm_loss(nnx.merge(graphdef, p), batch)
    return total / count

  with jax.set_mesh(mesh):
    return jax.jit(jax.value_and_grad(f))(params)


def test_sp_training_step_equals_unsharded(devices):
  mesh = make_mesh({"ring": 2, "ulysses": 4})
  one = make_mesh({"ring": 1}, devices[:1])
  sp_model = VLM(SMALL, rngs=nnx.Rngs(0), mesh=mesh, strategy="hybrid", impl="reference")
  ref_model = VLM(SMALL, rngs=nnx.Rngs(0))
  b_sp = {k: jnp.asarray(v) for k, v in _batch(sp_model.plan).items()}
  b_ref = {k: jnp.asarray(v) for k, v in _batch(api.make_plan(one, "ring")).items()
           if k not in ("send_idx", "recv_pos")}
  l_sp, g_sp = _loss_and_grads(sp_model, b_sp, mesh)
  l_ref, g_ref = _loss_and_grads(ref_model, b_ref, one)
  assert abs(float(l_sp) - float(l_ref)) < 1e-5
  errs = jax.tree.leaves(jax.tree.map(lambda a, b: float(np.max(np.abs(np.asarray(a) - np.asarray(b)))),
                                      g_sp, g_ref))
  assert max(errs) < 1e-5
  assert float(jnp.abs(g_sp["encoder"]["patch"]["kernel"]).sum()) > 0  # gradients reach the encoder


def test_frames_become_tokens_interleaved_with_text():
  cfg = VLMConfig()
  model = VLM(cfg, rngs=nnx.Rngs(0))
  frames = jnp.asarray(np.random.default_rng(0).standard_normal((1, 3, 4, 8)), jnp.float32)
  assert model.encoder(frames).shape == (1, 3 * cfg.tokens_per_frame, cfg.vision_hidden)
  row = video.layout_row(3, video.VideoSpec(), 16)
  inputs = jnp.asarray(row["tokens"])[None]
  emb = model.embed_inputs(inputs, frames, frame_slot=jnp.asarray(row["frame_slot"])[None])
  ft = model.frame_tokens(frames)
  np.testing.assert_allclose(emb[0, 1:7], ft[0], atol=1e-6)
  np.testing.assert_allclose(emb[0, 0], model.lm.embed(inputs)[0, 0], atol=1e-6)


def test_rope_theta_rescale_keeps_weights():
  model = VLM(VLMConfig(), rngs=nnx.Rngs(0))
  longer = with_rope_theta(model, 4e4)
  assert longer.cfg.lm.rope.theta == 4e4
  np.testing.assert_array_equal(longer.lm.layers[0].attn.wq[...], model.lm.layers[0].attn.wq[...])


def test_bad_config_and_inputs():
  with pytest.raises(ConfigError, match="patches=5 must be divisible by tokens_per_frame=2"):
    VLMConfig(patches=5)
  model = VLM(VLMConfig(), rngs=nnx.Rngs(0))
  with pytest.raises(ShapeError, match="frames must be"):
    model.encoder(jnp.zeros((1, 2, 3, 8)))
