"""A small video-language model: ViT-style frame encoder + MLP projector + the decoder LM.

Each frame ``[patches, patch_dim]`` is embedded per patch (with a learned patch position),
passes through pre-norm transformer blocks (full attention within the frame), and is pooled
into ``tokens_per_frame`` tokens; a 2-layer GELU MLP projects them to the LM width (LLaVA-style
projector). Frame tokens replace the FRAME placeholders of the interleaved text sequence and the
decoder LM (``jaxsys.models.llm.decoder.Decoder``) runs on the mixed embeddings.

With a mesh and a sequence-parallel strategy the whole forward runs sharded: frames are split
over the SP ranks for the encoder (stage 1), frame tokens move into balanced zigzag LLM shards
with one all-to-all (stage 2, ``jaxsys.parallel.multimodal``), and every attention layer of the
LM is ``sequence_parallel_attention`` on the zigzag-ordered shards.

Usage::

  cfg = VLMConfig()
  model = VLM(cfg, rngs=nnx.Rngs(0), mesh=make_mesh({"ring": 2, "ulysses": 4}), strategy="hybrid")
  batch = prepare_mm_batch(video_qa_batch(...), model.plan, cfg.num_frame_tokens(max_frames))
  total, count, metrics = vlm_loss(model, batch)
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxsys.core.errors import ShapeError, check_divisible, check_min
from jaxsys.models.llm.decoder import Decoder, DecoderConfig
from jaxsys.ops import attention
from jaxsys.core import init

__all__ = [
    "FrameEncoder", "Projector", "rebuild", "VisionBlock", "VLM", "vlm_loss", "VLMConfig",
    "with_rope_theta",
]


@dataclasses.dataclass(frozen=True)
class VLMConfig:
  patches: int = 4
  patch_dim: int = 8
  tokens_per_frame: int = 2
  vision_hidden: int = 32
  vision_layers: int = 1
  vision_heads: int = 2
  lm: DecoderConfig = DecoderConfig(vocab_size=16, hidden_size=64, intermediate_size=128,
                                    num_layers=2, num_heads=4, num_kv_heads=4)

  def __post_init__(self):
    check_divisible("patches", self.patches, "tokens_per_frame", self.tokens_per_frame)
    check_divisible("vision_hidden", self.vision_hidden, "vision_heads", self.vision_heads)
    check_min(self, 1, "patch_dim", "vision_layers")

  def num_frame_tokens(self, frames: int) -> int:
    return frames * self.tokens_per_frame


class VisionBlock(nnx.Module):
  def __init__(self, dim: int, heads: int, *, rngs: nnx.Rngs):
    self.heads = heads
    self.norm1 = nnx.LayerNorm(dim, rngs=rngs, **init.norm_defaults())
    self.qkv = nnx.Linear(dim, 3 * dim, rngs=rngs, **init.dense_defaults())
    self.out = nnx.Linear(dim, dim, rngs=rngs, **init.dense_defaults())
    self.norm2 = nnx.LayerNorm(dim, rngs=rngs, **init.norm_defaults())
    self.fc1 = nnx.Linear(dim, 2 * dim, rngs=rngs, **init.dense_defaults())
    self.fc2 = nnx.Linear(2 * dim, dim, rngs=rngs, **init.dense_defaults())

  def __call__(self, x):  # [n, patches, dim]
    n, p, d = x.shape
    q, k, v = jnp.split(self.qkv(self.norm1(x)).reshape(n, p, 3 * self.heads, d // self.heads), 3, axis=2)
    a = attention(q, k, v)  # full attention within a frame: [n, patches, heads, dim/heads]
    x = x + self.out(a.reshape(n, p, d))
    return x + self.fc2(jax.nn.gelu(self.fc1(self.norm2(x))))


class FrameEncoder(nnx.Module):
  """``frames [b, F, patches, patch_dim] -> [b, F * tokens_per_frame, vision_hidden]``."""

  def __init__(self, cfg: VLMConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    self.patch = nnx.Linear(cfg.patch_dim, cfg.vision_hidden, rngs=rngs, **init.dense_defaults())
    self.pos = nnx.Param(init.normal(0.02)(rngs.params(), (cfg.patches, cfg.vision_hidden)))
    self.blocks = nnx.List([VisionBlock(cfg.vision_hidden, cfg.vision_heads, rngs=rngs)
                            for _ in range(cfg.vision_layers)])
    self.norm = nnx.LayerNorm(cfg.vision_hidden, rngs=rngs, **init.norm_defaults())

  def __call__(self, frames):
    c = self.cfg
    if frames.ndim != 4 or frames.shape[2:] != (c.patches, c.patch_dim):
      raise ShapeError(f"frames must be [batch, frames, {c.patches}, {c.patch_dim}], got {frames.shape}")
    b, f = frames.shape[:2]
    x = self.patch(frames) + self.pos[...]                   # [b, F, patches, hidden]

    def encode(v):  # one video's frames [F, patches, hidden]
      for blk in self.blocks:
        v = blk(v)
      return self.norm(v)

    # vmap over videos rather than a [b*F] reshape: stage 1 shards F, and on Explicit mesh
    # axes a reshape cannot merge (or split back) a sharded dim behind an unsharded one.
    x = jax.vmap(encode)(x).reshape(b, f, c.tokens_per_frame, c.patches // c.tokens_per_frame, -1)
    return x.mean(3).reshape(b, f * c.tokens_per_frame, c.vision_hidden)  # [b, F*tpf, hidden]


class Projector(nnx.Module):
  def __init__(self, din: int, dout: int, *, rngs: nnx.Rngs):
    self.fc1 = nnx.Linear(din, dout, rngs=rngs, **init.dense_defaults())
    self.fc2 = nnx.Linear(dout, dout, rngs=rngs, **init.dense_defaults())

  def __call__(self, x):
    return self.fc2(jax.nn.gelu(self.fc1(x)))


class VLM(nnx.Module):
  """Frame encoder + projector + decoder LM, optionally sequence-parallel on ``mesh``."""

  def __init__(self, cfg: VLMConfig, *, rngs: nnx.Rngs, mesh=None, strategy: str | None = None,
               impl: str = "auto"):
    from jaxsys.parallel.api import make_plan, sequence_parallel_attention
    self.cfg = cfg
    self.mesh = mesh
    self.plan = None if mesh is None else make_plan(mesh, strategy or "hybrid")
    self.impl = impl
    attn = None
    if mesh is not None:
      attn = functools.partial(sequence_parallel_attention, mesh=mesh, strategy=self.plan.strategy,
                               tokens_reordered=True, impl=impl)
    self.encoder = FrameEncoder(cfg, rngs=rngs)
    self.projector = Projector(cfg.vision_hidden, cfg.lm.hidden_size, rngs=rngs)
    self.lm = Decoder(cfg.lm, rngs=rngs, attention_fn=attn)

  def frame_tokens(self, frames):
    """Stage 1: encode frames (split over the SP ranks when sharded) -> LM-width tokens."""
    if self.plan is not None:
      from jaxsys.parallel.multimodal import shard_frames
      frames = shard_frames(frames, self.mesh, self.plan)
    return self.projector(self.encoder(frames))  # [b, F*tpf, lm_hidden]

  def embed_inputs(self, inputs, frames, *, frame_slot=None, send_idx=None, recv_pos=None):
    return self.embed_with_frame_tokens(inputs, self.frame_tokens(frames), frame_slot=frame_slot,
                                        send_idx=send_idx, recv_pos=recv_pos)

  def embed_with_frame_tokens(self, inputs, ft, *, frame_slot=None, send_idx=None, recv_pos=None):
    """Interleaved LM input ``[b, L, lm_hidden]`` from token ids and frame tokens ``ft
    [b, T, lm_hidden]`` already encoded (e.g. cached once per prompt for RL passes): the text
    embeddings with FRAME slots replaced (single device), or stage 2 of the MM-SP sharding."""
    te = self.lm.embed(inputs)  # [b, L, lm_hidden]
    if self.plan is None:
      if frame_slot is None:
        raise ShapeError("frame_slot is required without a mesh")
      got = jax.vmap(lambda f, i: f[jnp.maximum(i, 0)])(ft, frame_slot)
      return jnp.where((frame_slot >= 0)[..., None], got.astype(te.dtype), te)
    from jaxsys.parallel.multimodal import reshard_to_llm
    if send_idx is None or recv_pos is None:
      raise ShapeError("send_idx and recv_pos (from prepare_mm_batch) are required with a mesh")
    return reshard_to_llm(ft, te, send_idx, recv_pos, mesh=self.mesh, plan=self.plan)  # stage 2

  def __call__(self, inputs, frames, *, positions, segment_ids=None, frame_slot=None,
               send_idx=None, recv_pos=None):
    """Logits ``[b, L, vocab]`` (float32) in the order of ``inputs``."""
    embeds = self.embed_inputs(inputs, frames, frame_slot=frame_slot, send_idx=send_idx,
                               recv_pos=recv_pos)
    return self.lm(embeds=embeds, positions=positions, segment_ids=segment_ids)


def rebuild(model: VLM, *, cfg: VLMConfig | None = None, mesh=None, strategy=None,
            impl: str | None = None) -> VLM:
  """A VLM sharing ``model``'s parameters with another config (e.g. RoPE theta) or mesh."""
  cfg = cfg or model.cfg
  mesh = model.mesh if mesh is None else mesh
  strategy = strategy or (model.plan.strategy if model.plan is not None else None)
  impl = impl or model.impl
  new = nnx.eval_shape(lambda: VLM(cfg, rngs=nnx.Rngs(0), mesh=mesh, strategy=strategy, impl=impl))
  nnx.update(new, nnx.state(model))
  return new


def with_rope_theta(model: VLM, theta: float) -> VLM:
  """Long-context extension: the same weights with RoPE base ``theta`` (theta rescale)."""
  lm = model.cfg.lm
  return rebuild(model, cfg=dataclasses.replace(model.cfg, lm=lm.replace(
      rope=dataclasses.replace(lm.rope, theta=float(theta)))))


def vlm_loss(model: VLM, batch: dict):
  """``(sum of answer-token cross-entropy, count, metrics)`` for ``jaxsys.train.train``."""
  logits = model(batch["inputs"], batch["frames"], positions=batch["positions"],
                 segment_ids=batch.get("segment_ids"), frame_slot=batch.get("frame_slot"),
                 send_idx=batch.get("send_idx"), recv_pos=batch.get("recv_pos"))
  mask = batch["loss_mask"].astype(jnp.float32)
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
  correct = (jnp.argmax(logits, -1) == batch["targets"]).astype(jnp.float32)
  return jnp.sum(ce * mask), jnp.sum(mask), {"correct": jnp.sum(correct * mask)}
