"""Whole decode phases as one on-device ``lax.while_loop`` (no Python between decode steps).

On a small target the per-step work is sub-millisecond, so a Python loop that dispatches one
executable per step (and reads ``done`` back every step) spends a large share of a rollout in
dispatch and host syncs. Here a rollout is ``init``, ``prefill``, a vanilla loop over the full
batch until fewer than ``min_running`` rows run, and then the long tail: one loop per batch
bucket, the engine shrinking the batch between them (``RolloutConfig.shrink_tail``), each loop
running while its rows still need that bucket (``min_running``: one more than the next smaller
bucket). A decode step at batch 1 costs about half of one at batch 8 on a memory-bound CPU, so the
last long response should not run at the bucket its phase started in.

* ``vanilla_loop``: vanilla steps while ``running >= min_running`` (``min_running=1``: to the end).
* ``spec_loop``: drafter sync (traced flag: skipped when the phase continues from a speculative
  one, whose rounds kept the drafter's cache current), then ``draft`` + ``verify`` rounds of one
  strategy while ``running >= min_running``, counting verify rounds and accepted tokens on device.
* ``lookup_loop``: the same rounds drafted by ``lookup.lookup_draft`` (no drafter model); a round
  where no running row found a match is one vanilla step instead of a verify.

Every loop is the decoding core's ``while_running`` over the step functions of ``decode``
(``vanilla_step``, ``draft``, ``verify``); these loops are the rollout engine's only decode path.
The vanilla baseline is compiled the same way, so a TLT-vs-vanilla comparison measures
speculation, not dispatch overhead.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxsys.decoding import core
from jaxsys.speculative import decode as dec
from jaxsys.speculative import lookup as lookup_lib
from jaxsys.speculative.bandit import Strategy

__all__ = ["jit_lookup_loop", "jit_spec_loop", "jit_vanilla_loop", "lookup_loop", "spec_loop",
           "vanilla_loop"]


def _running(state: dec.DecodeState):
  return (~state.done).sum()


def vanilla_loop(model, state: dec.DecodeState, min_running, cfg: dec.DecodeConfig):
  """Vanilla steps while at least ``min_running`` (int32 scalar, >= 1) rows run.

  Returns ``(state, steps)``. Every step emits a token per running row, so ``max_new`` steps
  bound the loop (the counter guards against a state that never finishes).
  """
  return core.while_running(lambda s: dec.vanilla_step(model, s, cfg), state, running=_running,
                            max_steps=cfg.max_new, min_running=min_running)


def spec_loop(model, drafter, state: dec.DecodeState, strategy: Strategy, cfg: dec.DecodeConfig,
              min_running=1, sync=True):
  """Drafter sync (when ``sync``, a bool scalar), then speculative rounds while at least
  ``min_running`` rows run.

  Returns ``(state, rounds, accepted, row_rounds)``: verify rounds, accepted draft tokens summed
  over rows and rounds, and running rows summed over rounds (mean accepted = accepted/row_rounds).
  """
  state = jax.lax.cond(sync, lambda s: dec.drafter_sync(model, drafter, s), lambda s: s, state)

  def body(carry):
    s, acc, rows = carry
    trees, s = dec.draft(model, drafter, s, strategy)
    s, n_acc = dec.verify(model, s, trees, cfg)
    live = n_acc >= 0
    return s, acc + jnp.where(live, n_acc, 0).sum(), rows + live.sum()

  zero = jnp.int32(0)
  (state, acc, rows), rounds = core.while_running(  # each round emits >= 1 token per running row
      body, (state, zero, zero), running=lambda c: _running(c[0]), max_steps=cfg.max_new,
      min_running=min_running)
  return state, rounds, acc, rows


def lookup_loop(model, state: dec.DecodeState, strategy: Strategy, cfg: dec.DecodeConfig,
                min_running=1):
  """Lookup-drafted rounds while at least ``min_running`` rows run (``strategy.lookup > 0``).

  Returns ``(state, rounds, accepted, row_rounds, plain_rounds)``: as ``spec_loop``, plus the
  rounds run as a vanilla step because no running row had a draft (they count in ``rounds`` and
  ``row_rounds`` with 0 accepted tokens).
  """
  vocab = model.config.vocab_size

  def body(carry):
    s, acc, rows, plain = carry
    trees, has = lookup_lib.lookup_draft(s, strategy, vocab)
    use = (has & ~s.done).any()

    def vanilla(s):  # n_acc from the rows running before the step, as ``verify`` reports it
      return dec.vanilla_step(model, s, cfg), jnp.where(s.done, -1, 0).astype(jnp.int32)

    s, n_acc = jax.lax.cond(use, lambda s: dec.verify(model, s, trees, cfg), vanilla, s)
    live = n_acc >= 0
    return (s, acc + jnp.where(live, n_acc, 0).sum(), rows + live.sum(),
            plain + (~use).astype(jnp.int32))

  zero = jnp.int32(0)
  (state, acc, rows, plain), rounds = core.while_running(
      body, (state, zero, zero, zero), running=lambda c: _running(c[0]), max_steps=cfg.max_new,
      min_running=min_running)
  return state, rounds, acc, rows, plain


# ---- jitted entry points (modules split into graphdef + state; the state is donated) ----------

def jit_vanilla_loop(cfg: dec.DecodeConfig):
  def f(gdef, tstate, state, min_running):
    return vanilla_loop(nnx.merge(gdef, tstate), state, min_running, cfg)
  return jax.jit(f, static_argnums=0, donate_argnums=2)


def jit_spec_loop(cfg: dec.DecodeConfig, strategy: Strategy):
  def f(gdef, tstate, dgdef, dstate, state, min_running, sync):
    return spec_loop(nnx.merge(gdef, tstate), nnx.merge(dgdef, dstate), state, strategy, cfg,
                     min_running, sync)
  return jax.jit(f, static_argnums=(0, 2), donate_argnums=4)


def jit_lookup_loop(cfg: dec.DecodeConfig, strategy: Strategy):
  def f(gdef, tstate, state, min_running):
    return lookup_loop(nnx.merge(gdef, tstate), state, strategy, cfg, min_running)
  return jax.jit(f, static_argnums=0, donate_argnums=2)
