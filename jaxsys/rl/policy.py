"""A tiny policy for the synthetic RL tasks: config, supervised warm-up, and a cached copy.

GRPO needs a policy that already solves the task some of the time. ``pretrain_policy`` trains a
small decoder LM with teacher forcing on ``jaxsys.rl.tasks`` examples (a few hundred Adam
steps on CPU); ``cached_policy`` stores the result with orbax so experiments and notebooks
reuse it.

Usage::

  policy = cached_policy("runs/tlt/policy", steps=300)
"""

from __future__ import annotations

import os

import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxsys.models import DecoderConfig
from jaxsys.models.llm.decoder import Decoder
from jaxsys.rl import tasks as tasks_lib
from jaxsys.core.optim import warmup_cosine
from jaxsys.train import make_train_step, run_steps

__all__ = ["cached_policy", "policy_config", "pretrain_policy"]


def policy_config(hidden: int = 64, layers: int = 4) -> DecoderConfig:
  return DecoderConfig(vocab_size=tasks_lib.VOCAB, hidden_size=hidden, intermediate_size=2 * hidden,
                       num_layers=layers, num_heads=4, num_kv_heads=2, max_position_embeddings=256,
                       eos_token_id=tasks_lib.EOS, bos_token_id=tasks_lib.BOS)


def pretrain_policy(config: DecoderConfig | None = None, *, steps: int = 300, batch: int = 16,
                    lr: float = 3e-3, seed: int = 0, sampler: tasks_lib.TaskSampler | None = None):
  """Teacher-forced warm-up on task examples; returns ``(model, final_loss)``."""
  config = config or policy_config()
  model = Decoder(config, rngs=nnx.Rngs(seed))
  sampler = sampler or tasks_lib.TaskSampler(long_fraction=0.3, seed=seed + 1)
  seq_len = sampler.max_prompt + sampler.max_response
  seq_len = 1 << (seq_len - 1).bit_length()
  gdef, params, rest = nnx.split(model, nnx.Param, ...)
  tx = warmup_cosine(lr, steps).build()
  opt = tx.init(params)

  def loss_fn(model, tokens, mask):  # tokens, mask [batch, seq_len]; mask 1 on answer tokens
    logits = model(tokens)[:, :-1]
    nll = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])
    return (nll * mask[:, :-1]).sum() / mask[:, :-1].sum()

  step = make_train_step(loss_fn, tx, graphdef=gdef)
  rng = np.random.default_rng(seed)

  def draw(s, params, rest):
    tokens, mask = tasks_lib.sft_batch(sampler.sample(batch, rng), seq_len)
    return jnp.asarray(tokens), jnp.asarray(mask)

  run = run_steps(step, params, opt, rest, draw, steps=steps, carry_rest=False, record=lambda s: s == steps)
  return nnx.merge(gdef, run.params, rest), run.loss


def cached_policy(path: str, *, steps: int = 300, config: DecoderConfig | None = None, seed: int = 0):
  """Restores the verified checkpoint under ``path`` (``core.checkpoint.Checkpointer``: atomic,
  hashed) or trains (``pretrain_policy``) and saves it there."""
  from jaxsys.core.checkpoint import Checkpointer
  config = config or policy_config()
  path = os.path.abspath(os.path.join(path, f"{config.hidden_size}x{config.num_layers}_s{steps}_seed{seed}"))
  abstract = nnx.eval_shape(lambda: Decoder(config, rngs=nnx.Rngs(0)))
  gdef, abs_state = nnx.split(abstract)
  with Checkpointer(path, max_to_keep=1) as ckpt:
    if ckpt.latest_intact_step() is not None:
      from jaxsys.nn.layers import FLAX_RENAMES
      return nnx.merge(gdef, ckpt.restore(like=abs_state, renames=FLAX_RENAMES))
    model, _ = pretrain_policy(config, steps=steps, seed=seed)
    ckpt.save(0, nnx.state(model), overwrite=True)
  return model
