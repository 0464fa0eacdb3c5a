"""Video GRPO with cached vision embeddings and sequence-parallel passes (LongVILA-R1 MR-SP).

One RL step on ``n`` videos, ``G`` rollouts each, runs a rollout, an old-policy log-prob pass, a
reference log-prob pass and the update micro-batches. Every pass needs the video's frame
tokens. Three modes:

* ``recompute`` (the baseline): the rollout encodes each video once; every later pass
  re-encodes the frames of each of its ``n * G`` rows.
* ``cached`` (MR-SP stage 1): the frozen vision tower + projector run once per video per step,
  in chunks of ``encode_chunk`` frames, under ``stop_gradient``; the rollout prefills from those
  embeddings once per prompt and its ``G`` rollouts share the prefill
  (``jaxsys.decoding.core.jit_prefill_embeds``); every later pass rebuilds its input from the
  cached frame tokens plus the embedded response and keeps logits only for the response.
* ``cached_sp`` (stage 1 + 2): as ``cached``, with the frames encoded split over the SP ranks
  and the LM passes sequence-parallel on ``mesh`` (Ulysses all-to-all attention): the frame
  tokens go into even contiguous LM shards with the two-stage multimodal sharding
  (``jaxsys.parallel.multimodal``), so rank 0 holds the system text and the first frames and the
  last rank the last frames, the question and the response. The rollout runs on the replicated
  single-device model.

``rollout_frames`` lets the rollout see uniformly subsampled frames while the passes see all of
them (taken from the cached frame tokens: the encoder is per frame, so this equals encoding the
subsampled video). The objective is ``jaxsys.rl.grpo.policy_objective`` with the recipe's
defaults: advantages ``(r - mean) / (std + eps)`` per group, clip ``0.2 / 0.3``, dual-clip 3,
token-mean, k3 KL at ``1e-2``; only the LM is trained (the vision tower is frozen).

Usage::

  model = VLM(cfg, rngs=nnx.Rngs(0))
  trainer = VideoGRPOTrainer(model, VideoTaskSampler(n_frames=32), VideoGRPOConfig(mode="cached_sp"),
                             mesh=make_mesh({"ulysses": 8}))
  metrics = trainer.step()          # reward_mean, accuracy, step_seconds, encoded_videos, ...
  trainer.evaluate(held_out, sampled=True)   # G samples per video at the rollout temperature

``pretrain_video_policy(model, tasks, until=...)`` is the supervised warm-up RL starts from; it
can stop at a validation accuracy rather than a step count (``experiments/mrsp.py`` stops at
0.55, leaving GRPO headroom on every task).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxsys.core.errors import ConfigError, InputError, ShapeError, check_min, check_one_of, check_positive, check_range
from jaxsys.core.optim import warmup_cosine
from jaxsys.data import video
from jaxsys.decoding import core
from jaxsys.decoding.cache import KVCache
from jaxsys.decoding.sampling import SamplingParams, loop_params
from jaxsys.parallel import zigzag as zz
from jaxsys.rl import grpo
from jaxsys.rl import video_tasks as vt
from jaxsys.train import apply_optax, init_optimizer, place_batch, place_states

__all__ = [
    "build_rows", "encode_videos", "LM_PARAMS", "MODES", "pretrain_video_policy", "RECIPE",
    "response_logprobs", "RowLayout", "VideoGRPOConfig", "VideoGRPOTrainer",
]

MODES = ("recompute", "cached", "cached_sp")
#: The trained parameters: the LM's (vision tower and projector are frozen during RL).
LM_PARAMS = nnx.All(nnx.Param, nnx.PathContains("lm"))
RECIPE = grpo.GRPOConfig(group_size=4, prompts_per_step=2, minibatches=1, clip_eps=0.2, clip_low=0.2,
                         clip_high=0.3, dual_clip=3.0, loss_agg="token-mean", kl_coef=1e-2, lr=1e-3)


@dataclasses.dataclass(frozen=True)
class VideoGRPOConfig:
  mode: str = "cached"
  grpo: grpo.GRPOConfig = RECIPE
  max_new: int = 3                 # response budget in tokens (EOS included)
  rollout_frames: int | None = None  # rollout sees this many uniformly spaced frames (None: all)
  temperature: float = 1.0
  encode_chunk: int = 64           # frames per encoder chunk (single-device encoding)
  sp_strategy: str = "ulysses"

  def __post_init__(self):
    check_one_of("mode", self.mode, MODES)
    check_min(self, 1, "max_new", "encode_chunk")
    check_positive(self, "temperature")
    if self.rollout_frames is not None:
      check_min(self, 1, "rollout_frames")
    check_one_of("sp_strategy", self.sp_strategy, ("ulysses",))
    if not isinstance(self.grpo, grpo.GRPOConfig):
      raise ConfigError(f"grpo={self.grpo!r} must be a GRPOConfig")


@dataclasses.dataclass(frozen=True)
class RowLayout:
  """One row: prompt ``BOS, FRAME*T, TASK, ASK`` (``P`` tokens), then ``R`` response slots, with
  ``P + R`` the smallest multiple of the SP degree holding ``P + max_new``."""
  n_frames: int
  tokens_per_frame: int
  max_new: int
  multiple: int = 1

  @property
  def prompt(self) -> int:
    return vt.prompt_len(self.n_frames, self.tokens_per_frame)

  @property
  def length(self) -> int:
    return zz.pad_len(self.prompt + self.max_new, self.multiple)

  @property
  def response(self) -> int:
    return self.length - self.prompt

  @property
  def frame_tokens(self) -> int:
    return self.n_frames * self.tokens_per_frame


def build_rows(layout: RowLayout, examples, responses):
  """``inputs int32[b, L]``, ``frame_slot int32[b, L]`` and the response mask ``f32[b, R]``
  (``mask[:, j]``: the logit at ``P - 1 + j`` predicts response token ``j``)."""
  b, P, L = len(examples), layout.prompt, layout.length
  if len(responses) != b:
    raise InputError(f"{len(responses)} responses for {b} examples")
  inputs = np.full((b, L), video.PAD, np.int32)
  slots = np.full((b, L), -1, np.int32)
  mask = np.zeros((b, layout.response), np.float32)
  for i, (ex, r) in enumerate(zip(examples, responses)):
    if ex.frames.shape[0] != layout.n_frames:
      raise InputError(f"examples[{i}] has {ex.frames.shape[0]} frames, the layout {layout.n_frames}")
    r = np.asarray(r, np.int32).reshape(-1)
    if r.size > layout.max_new:
      raise InputError(f"responses[{i}] has {r.size} tokens > the response budget max_new={layout.max_new}")
    tok, slot = vt.prompt_tokens(ex.kind, layout.n_frames, layout.tokens_per_frame)
    inputs[i, :P], slots[i, :P] = tok, slot
    inputs[i, P:P + r.size] = r
    mask[i, :r.size] = 1.0
  return inputs, slots, mask


def encode_videos(model, frames, chunk: int):
  """Frozen vision tower + projector: ``frames [n, F, patches, dim] -> [n, F*tpf, lm_hidden]``,
  in chunks of ``chunk`` frames on one device (bounds the encoder's activation memory), split
  over the SP ranks (stage 1) when the model is sharded."""
  n, f = frames.shape[:2]
  if model.plan is None and f > chunk and f % chunk == 0:
    parts = frames.reshape(n, f // chunk, chunk, *frames.shape[2:]).swapaxes(0, 1)
    ft = jax.lax.map(model.frame_tokens, parts)            # [F/chunk, n, chunk*tpf, hidden]
    ft = ft.swapaxes(0, 1).reshape(n, f * model.cfg.tokens_per_frame, -1)
  else:
    ft = model.frame_tokens(frames)
  return jax.lax.stop_gradient(ft)


def response_logprobs(model, ft, inputs, prompt: int, *, frame_slot=None, send_idx=None, recv_pos=None):
  """``log pi(response | video, prompt)``: ``float32[b, L - P]`` from frame tokens ``ft [b, T, H]``
  and rows ``inputs [b, L]``; the LM head runs on the response positions only."""
  emb = model.embed_with_frame_tokens(inputs, ft, frame_slot=frame_slot, send_idx=send_idx,
                                      recv_pos=recv_pos)                 # [b, L, H]
  h, _ = model.lm.forward_hidden(embeds=emb)
  return model.lm.target_logprobs(h[:, prompt - 1:-1], inputs[:, prompt:])   # [b, R]


@dataclasses.dataclass(frozen=True)
class _Program:
  gdef: Any          # the single-device VLM (rollout prompt embedding)
  pass_gdef: Any     # the VLM of the log-prob / update passes (the sharded twin in cached_sp)
  config: VideoGRPOConfig

  @property
  def sharded(self) -> bool:
    return self.config.mode == "cached_sp"


def _optimizer(config: VideoGRPOConfig):
  return config.grpo.optimizer_config().build()


def _pass_model(prog: _Program, params, rest, sharded: bool):
  return nnx.merge(prog.pass_gdef if sharded else prog.gdef, params, rest)


@functools.partial(jax.jit, static_argnums=(0,))
def _encode_jit(prog, params, rest, frames):
  return encode_videos(_pass_model(prog, params, rest, prog.sharded), frames, prog.config.encode_chunk)


@functools.partial(jax.jit, static_argnums=(0,))
def _embed_prompt_jit(prog, params, rest, ft, prompts, slots):
  return _pass_model(prog, params, rest, False).embed_with_frame_tokens(prompts, ft, frame_slot=slots)


def _logp_fn(prog, params, rest, src, prompt, rows, batch):
  """``src``: cached frame tokens ``[n, T, H]`` or, in ``recompute``, frames ``[n, F, ...]``
  re-encoded for every row."""
  model = _pass_model(prog, params, rest, prog.sharded)
  if prog.config.mode == "recompute":
    ft = encode_videos(model, src[rows], prog.config.encode_chunk)
  else:
    ft = src[rows]
  return response_logprobs(model, ft, batch["inputs"], prompt, frame_slot=batch.get("frame_slot"),
                           send_idx=batch.get("send_idx"), recv_pos=batch.get("recv_pos"))


def _loss_grad_fn(prog, params, rest, src, prompt, rows, batch, adv, old, ref):
  def loss(p):
    logp = _logp_fn(prog, p, rest, src, prompt, rows, batch)
    loss, aux = grpo.policy_objective(logp, old, ref, batch["mask"], adv,
                                      **prog.config.grpo.objective_kwargs())
    return loss, dict(aux, logp=logp)
  return jax.value_and_grad(loss, has_aux=True)(params)


def _update_fn(prog, params, rest, opt_state, src, prompt, rows, batch, adv, old, ref):
  (loss, aux), grads = _loss_grad_fn(prog, params, rest, src, prompt, rows, batch, adv, old, ref)
  params, opt_state = apply_optax(_optimizer(prog.config), grads, opt_state, params)
  aux = {k: v for k, v in aux.items() if k != "logp"}
  return params, opt_state, dict(aux, loss=loss)


_SP_TWINS: dict = {}  # (graphdef, mesh, strategy) -> (sharded graphdef, SPPlan)
_logp_jit = jax.jit(_logp_fn, static_argnums=(0, 4))
_loss_grad_jit = jax.jit(_loss_grad_fn, static_argnums=(0, 4))
_update_jit = jax.jit(_update_fn, static_argnums=(0, 5))


class VideoGRPOTrainer:
  """``step()`` = encode (once per video in cached modes) -> rollout with a shared prefill ->
  rewards -> group advantages -> old / reference log-probs -> clipped updates."""

  def __init__(self, model, tasks: vt.VideoTaskSampler, config: VideoGRPOConfig = VideoGRPOConfig(),
               *, mesh=None, rules: str = "fsdp", reward_fn=None):
    """``mesh``: the passes run on it, the update's rows split over its "data" axis and the
    LM's parameters, reference and optimizer state placed by ``rules`` ("fsdp": sharded over
    "data", gathered per layer; "tp": heads and mlp over "model"; ``jaxsys.core.mesh``). The
    frozen vision tower stays replicated. ``cached_sp`` needs a mesh with a "ulysses" axis (its
    sequence-parallel degree): ``{"data": 2, "ulysses": 4}`` is MR-SP's Ulysses SP inside FSDP."""
    from jaxsys.models.vlm import rebuild
    self.config, self.tasks = config, tasks
    self.reward_fn = reward_fn or vt.reward
    if model.plan is not None:
      raise ConfigError("pass the single-device VLM; cached_sp builds its sharded twin on mesh=")
    if model.cfg.lm.vocab_size < vt.VOCAB:
      raise ConfigError(f"the LM's vocab_size={model.cfg.lm.vocab_size} must be >= {vt.VOCAB} (video task tokens)")
    if config.mode == "cached_sp" and mesh is None:
      raise ConfigError("mode='cached_sp' needs mesh= (a mesh with a 'ulysses' axis)")
    # Explicit axes (jax.make_mesh's default) run on the Auto twin, as jaxsys.train does: the
    # layers' sharding annotations are hints, and the response slice of a sequence-sharded
    # activation has no explicit output sharding.
    self.mesh, self.multiple, self.vlm_cfg = grpo.train_mesh(mesh, config.grpo, rules), 1, model.cfg
    self.gdef, self.params, self.rest = nnx.split(model, LM_PARAMS, ...)
    self.pass_gdef = self.gdef
    if config.mode == "cached_sp":
      key = (self.gdef, self.mesh, config.sp_strategy)
      if key not in _SP_TWINS:  # one sharded graphdef per structure and mesh (shared executables)
        sp = rebuild(model, mesh=self.mesh, strategy=config.sp_strategy)
        _SP_TWINS[key] = (nnx.split(sp, LM_PARAMS, ...)[0], sp.plan)
      self.pass_gdef, self.plan = _SP_TWINS[key]
      self.multiple = self.plan.degree
    if self.mesh is not None:
      # On the mesh from the start: the sharded update returns them so, and inputs that kept
      # the single-device placement would recompile every pass after the first step.
      from jax.sharding import NamedSharding, PartitionSpec
      self.rest = jax.device_put(self.rest, NamedSharding(self.mesh, PartitionSpec()))
      place_states(model, self.mesh, rules, self.params)
    self.ref_params = jax.tree.map(jnp.copy, self.params)
    self.opt_state = init_optimizer(_optimizer(config), self.params, self.mesh)
    self.rng = np.random.default_rng(config.grpo.seed)
    self.step_count = 0
    self.encoded_videos = 0   # videos run through the vision tower (counted per pass)
    self.prefill_rows: list[int] = []  # rows of each rollout prefill (n, not n * G)
    self._maps: dict = {}
    # The compiled passes are module-level, keyed by this static program: trainers of the same
    # model structure and config share their executables.
    prog = _Program(self.gdef, self.pass_gdef, config)
    self._encode = functools.partial(_encode_jit, prog)
    self._embed_prompt = functools.partial(_embed_prompt_jit, prog)
    self._logp = functools.partial(_logp_jit, prog)
    self._loss_grad = functools.partial(_loss_grad_jit, prog)
    self._update = functools.partial(_update_jit, prog)

  # ---- host side ---------------------------------------------------------------------------

  def layout(self, n_frames: int | None = None) -> RowLayout:
    n = self.tasks.n_frames if n_frames is None else n_frames
    lay = RowLayout(n, self.vlm_cfg.tokens_per_frame, self.config.max_new, self.multiple)
    if self.multiple > 1 and lay.frame_tokens % self.multiple:
      raise ShapeError(f"n_frames={n} x tokens_per_frame={lay.tokens_per_frame} = {lay.frame_tokens} frame "
                       f"tokens must be divisible by the sequence-parallel degree {self.multiple} "
                       f"(use a multiple of {self.multiple // np.gcd(self.multiple, lay.tokens_per_frame)} frames)")
    return lay

  @property
  def model(self):
    return nnx.merge(self.gdef, self.params, self.rest)

  def _ctx(self):
    import contextlib
    return jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext()

  def device_batch(self, layout: RowLayout, examples, responses) -> dict:
    """The arrays of one pass: rows, response mask and (sharded) the stage-2 routing tables."""
    inputs, slots, mask = build_rows(layout, examples, responses)
    batch = {"inputs": inputs, "mask": mask}
    if self.config.mode != "cached_sp":
      batch["frame_slot"] = slots
    else:
      from jaxsys.parallel.multimodal import reshard_maps
      key = (layout, len(examples))
      if key not in self._maps:  # every row has the same frame slots: route one, tile
        send, recv = reshard_maps(slots[:1], layout.frame_tokens, self.multiple)
        self._maps[key] = (np.repeat(send, len(examples), 0), np.repeat(recv, len(examples), 0))
      batch["send_idx"], batch["recv_pos"] = self._maps[key]
    return self._put(batch)

  def _put(self, rows):
    """Per-row host arrays (a pytree, rows first) on the device(s), split over the mesh's "data"
    axis (``jaxsys.train.place_batch``, which refuses a row count the axis does not divide)."""
    return place_batch(jax.tree.map(np.asarray, rows), self.mesh)

  def encode(self, frames):
    """Frame tokens ``[n, T, H]`` of ``frames [n, F, patches, dim]`` (one encoder run per video)."""
    frames = jnp.asarray(frames, jnp.float32)
    self.layout(frames.shape[1])  # clear error for a frame count the sharding cannot split
    self.encoded_videos += frames.shape[0]
    with self._ctx():
      return self._encode(self.params, self.rest, frames)

  def _src(self, frames, ft):
    if self.config.mode == "recompute":
      return jnp.asarray(frames, jnp.float32)
    return ft

  def logprobs(self, examples, responses, *, params=None, frames=None, ft=None, rows=None):
    """Response log-probs ``[b, R]`` of ``examples[rows[i]]`` + ``responses[i]`` in this mode
    (``rows`` default ``arange``; frames encoded here unless ``ft`` is given)."""
    lay = self.layout(examples[0].frames.shape[0])
    rows = np.arange(len(examples)) if rows is None else np.asarray(rows)
    frames = np.stack([ex.frames for ex in examples]) if frames is None else frames
    if ft is None and self.config.mode != "recompute":
      ft = self.encode(frames)
    batch = self.device_batch(lay, [examples[i] for i in rows], responses)
    if self.config.mode == "recompute":
      self.encoded_videos += len(rows)
    with self._ctx():
      return self._logp(self.params if params is None else params, self.rest, self._src(frames, ft),
                        lay.prompt, self._put(rows.astype(np.int32)), batch)

  def loss_and_grads(self, examples, responses, adv, old, ref):
    """``((loss, aux), grads)`` of the objective for one micro-batch (rows = examples);
    ``aux["logp"]`` holds the response log-probs of the pass."""
    lay = self.layout(examples[0].frames.shape[0])
    frames = np.stack([ex.frames for ex in examples])
    ft = None if self.config.mode == "recompute" else self.encode(frames)
    if self.config.mode == "recompute":
      self.encoded_videos += len(examples)
    batch = self.device_batch(lay, examples, responses)
    rows, adv, old, ref = self._put((np.arange(len(examples), dtype=np.int32), adv, old, ref))
    with self._ctx():
      return self._loss_grad(self.params, self.rest, self._src(frames, ft), lay.prompt, rows, batch, adv,
                             old, ref)

  def rollout(self, examples, ft, seed: int, *, greedy: bool = False):
    """``G`` sampled responses per example (rows ``i * G + j``), from one prefill per prompt
    (``greedy``: one argmax response per example)."""
    c = self.config
    g = 1 if greedy else c.grpo.group_size
    n, n_frames = len(examples), examples[0].frames.shape[0]
    tpf = self.vlm_cfg.tokens_per_frame
    if c.rollout_frames is not None and c.rollout_frames < n_frames:
      keep = np.round(np.linspace(0, n_frames - 1, c.rollout_frames)).astype(np.int32)
      tok = (keep[:, None] * tpf + np.arange(tpf)).reshape(-1)
      ft, n_frames = ft[:, tok], c.rollout_frames
    prompts = np.stack([vt.prompt_tokens(ex.kind, n_frames, tpf)[0] for ex in examples])
    slots = np.stack([vt.prompt_tokens(ex.kind, n_frames, tpf)[1] for ex in examples])
    if self.mesh is not None:  # the single-device graph on the mesh (FSDP shards gathered by the compiler)
      from jax.sharding import NamedSharding, PartitionSpec
      ft = jax.device_put(ft, NamedSharding(self.mesh, PartitionSpec()))
    embeds = self._embed_prompt(self.params, self.rest, ft, jnp.asarray(prompts), jnp.asarray(slots))
    lm_gdef, lm_state = nnx.split(self.model.lm)
    p = prompts.shape[1]
    cache = KVCache.init(self.vlm_cfg.lm, n, p + c.max_new)
    lengths = jnp.full((n,), p, jnp.int32)
    self.prefill_rows.append(n)
    logits0, _, cache = core.jit_prefill_embeds(lm_gdef, lm_state, embeds, lengths, cache, g)
    mode, params = loop_params(SamplingParams(0.0 if greedy else c.temperature, seed=seed),
                               max_new=c.max_new, stops=[video.EOS])
    toks, logps, _, counts, _, _ = core.jit_decode_loop(lm_gdef, lm_state, cache, logits0, None, params,
                                                        mode, c.max_new, False)
    toks, counts = np.asarray(toks), np.asarray(counts)
    self.rollout_logprobs = [np.asarray(logps)[i, :counts[i]] for i in range(n * g)]  # the sampler's
    return [toks[i, :counts[i]].tolist() for i in range(n * g)]

  def evaluate(self, examples, *, sampled: bool = False, seed: int = 0) -> dict:
    """Answers of the current policy: mean ``accuracy`` (exact match), ``reward`` and the
    per-example ``hits`` (the rollout's view of the video, ``rollout_frames`` included).

    Greedy by default; ``sampled=True`` draws ``G`` responses per example at the rollout
    temperature (the quantity GRPO maximises), and ``hits`` is each example's mean over them."""
    ft = self.encode(np.stack([ex.frames for ex in examples]))
    responses = self.rollout(examples, ft, seed=seed, greedy=not sampled)
    g = len(responses) // len(examples)
    hits = np.array([vt.accuracy(examples[i // g], r) for i, r in enumerate(responses)])
    rewards = np.array([self.reward_fn(examples[i // g], r) for i, r in enumerate(responses)])
    return {"accuracy": float(hits.mean()), "reward": float(rewards.mean()),
            "hits": hits.reshape(len(examples), g).mean(1)}

  def step(self, examples=None) -> dict:
    c, gc = self.config, self.config.grpo
    t0 = time.perf_counter()
    examples = examples or self.tasks.sample(gc.prompts_per_step, self.rng)
    n, g = len(examples), gc.group_size
    frames = np.stack([ex.frames for ex in examples])
    lay = self.layout(frames.shape[1])
    ft = self.encode(frames)                    # once per video (the rollout's, reused when cached)
    # a distinct int32 seed per (seed, step); wraps instead of overflowing for large seeds
    responses = self.rollout(examples, ft, seed=(gc.seed * 100003 + self.step_count) % 2**31)
    t1 = time.perf_counter()
    rows = np.repeat(np.arange(n), g)
    rewards = np.array([self.reward_fn(examples[i], r) for i, r in zip(rows, responses)], np.float32)
    acc = np.array([vt.accuracy(examples[i], r) for i, r in zip(rows, responses)], np.float32)
    adv = np.asarray(grpo.group_advantages(rewards.reshape(n, g))).reshape(-1)
    src = self._src(frames, ft)
    mb = n * g // gc.minibatches
    perm = self.rng.permutation(n * g)
    batches = []
    with self._ctx():
      for k in range(gc.minibatches):  # pi_old and pi_ref: all before any update
        idx = perm[k * mb:(k + 1) * mb]
        batch = self.device_batch(lay, [examples[i] for i in rows[idx]], [responses[i] for i in idx])
        r = self._put(rows[idx].astype(np.int32))
        if c.mode == "recompute":
          self.encoded_videos += 2 * len(idx)
        old = self._logp(self.params, self.rest, src, lay.prompt, r, batch)
        ref = self._logp(self.ref_params, self.rest, src, lay.prompt, r, batch)
        batches.append((r, batch, self._put(adv[idx]), old, ref))
      aux = {}
      for r, batch, a, old, ref in batches:
        if c.mode == "recompute":
          self.encoded_videos += int(r.shape[0])
        self.params, self.opt_state, aux = self._update(self.params, self.rest, self.opt_state, src,
                                                        lay.prompt, r, batch, a, old, ref)
      jax.block_until_ready(self.params)
    t2 = time.perf_counter()
    self.step_count += 1
    return {"step": self.step_count, "reward_mean": float(rewards.mean()), "accuracy": float(acc.mean()),
            "format": float(np.mean([vt.format_ok(r) for r in responses])),
            "rollout_seconds": t1 - t0, "train_seconds": t2 - t1, "step_seconds": t2 - t0,
            "loss": float(aux["loss"]), "kl": float(aux["kl"]), "clip_frac": float(aux["clip_frac"]),
            "encoded_videos": self.encoded_videos, "responses": responses}

  def update_memory(self, n_frames: int, rows: int) -> dict | None:
    """The compiler's per-device memory plan of one update micro-batch of ``rows`` rows at
    ``n_frames`` frames (``jaxsys.core.bench.compiled_memory``; nothing is allocated or run, so the
    compile is ``compile_for_analysis``'s)."""
    from jaxsys.core.bench import compiled_memory
    lay = self.layout(n_frames)
    cfg = self.vlm_cfg
    ex = [vt.VideoExample("needle", np.zeros((n_frames, 1, 1), np.float32), (0, 0))] * rows
    batch = self.device_batch(lay, ex, [[0]] * rows)
    sds = lambda shape, dt=jnp.float32: jax.ShapeDtypeStruct(shape, dt)  # noqa: E731
    n = max(1, rows // self.config.grpo.group_size)
    if self.config.mode == "recompute":
      src = sds((n, n_frames, cfg.patches, cfg.patch_dim))
    else:
      src = sds((n, lay.frame_tokens, cfg.lm.hidden_size))
    vec = sds((rows,))
    mat = sds((rows, lay.response))
    with self._ctx():
      return compiled_memory(_update_jit, self._update.args[0], self.params, self.rest, self.opt_state, src, lay.prompt,
                             sds((rows,), jnp.int32), batch, vec, mat, mat, unrun=True)


def pretrain_video_policy(model, tasks: vt.VideoTaskSampler, *, steps: int = 200, batch: int = 16,
                          lr: float = 3e-3, seed: int = 0, until=None, check_every: int = 50):
  """Supervised warm-up of the whole VLM (vision tower included) on teacher-forced answers, the
  stand-in for a pretrained VLM that RL starts from. Returns ``(model, final_loss)``.

  ``until(model) -> bool``, checked every ``check_every`` steps, ends the warm-up early: the tiny
  VLM learns to read glyphs in a sudden transition (accuracy 0.03 -> 0.99 within a few hundred
  steps, at a step that moves with the seed), so a warm-up meant to leave RL some headroom stops
  at an accuracy rather than at a step count."""
  from jaxsys.train import make_train_step, run_steps
  for name, value in (("steps", steps), ("batch", batch), ("check_every", check_every)):
    check_range(name, value, lo=1)
  lay = RowLayout(tasks.n_frames, model.cfg.tokens_per_frame, tasks.max_response)
  gdef, params, rest = nnx.split(model, nnx.Param, ...)
  tx = warmup_cosine(lr, steps).build()
  opt = tx.init(params)

  def loss_fn(m, frames, inputs, slots, mask):  # teacher forcing on the answer + EOS
    logp = response_logprobs(m, m.frame_tokens(frames), inputs, lay.prompt, frame_slot=slots)
    return -(logp * mask).sum() / mask.sum()

  step = make_train_step(loss_fn, tx, graphdef=gdef)
  rng = np.random.default_rng(seed)

  def draw(s, params, rest):
    exs = tasks.sample(batch, rng)
    inputs, slots, mask = build_rows(lay, exs, [ex.target for ex in exs])
    frames = np.stack([ex.frames for ex in exs])
    return jnp.asarray(frames), jnp.asarray(inputs), jnp.asarray(slots), jnp.asarray(mask)

  run = run_steps(step, params, opt, rest, draw, steps=steps, carry_rest=False,
                  every=check_every if until is not None else 0, at_end=False,
                  on_every=None if until is None else lambda s, p, r: until(nnx.merge(gdef, p, r)))
  params, loss = run.params, run.loss
  return nnx.merge(gdef, params, rest), float(loss)
