"""The train-step primitives every training loop builds on: :func:`make_train_step` (one optax
step on a loss, for pure parameters or an NNX model) and :func:`apply_optax` (its optax part),
and :func:`run_steps`, the Python loop that drives such a step over a batch source.

The training loop family: ``jaxsys.train.train`` (language models: checkpoints, resume,
non-finite handling, metrics log), ``models.graph.node_classification.run_node_training``
(full-batch graphs: the whole run is one compiled ``lax.scan``) and :func:`run_steps` (every
other recipe: SpikingNeRF, DATE, PalQuant, the policy and video-policy warm-ups, the
DuoAttention gate trainer).

They sit in ``core`` so that every layer may use them: ``parallel``'s graph-partitioned step and
``quant``'s PalQuant training sit below ``train`` (the generic loop over them, ``jaxsys.train``,
which re-exports both) and ``models`` (whose recipes use them through ``train``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import optax
from flax import nnx

from jaxsys.core.errors import ConfigError

__all__ = ["apply_optax", "make_train_step", "run_steps", "StepsRun"]


def apply_optax(tx: optax.GradientTransformation, grads, opt_state, params):
  """The optax part of every step: ``(params, opt_state)`` after one update of ``tx``."""
  updates, opt_state = tx.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state


def make_train_step(loss_fn: Callable, tx: optax.GradientTransformation, *, graphdef=None,
                    has_aux: bool = False, jit: bool = True, static_argnums: tuple[int, ...] = (),
                    donate: bool = False) -> Callable:
  """One optax step on ``loss_fn``: the shared building block of the library's training loops.

  Pure parameters (``graphdef=None``): ``loss_fn(params, *args) -> loss`` (or ``(loss, aux)``
  with ``has_aux``) and ``step(params, opt_state, *args) -> (params, opt_state, loss, aux)``.

  NNX model (``graphdef`` from ``nnx.split(model, nnx.Param, ...)``): ``loss_fn(model, *args)``
  on ``model = nnx.merge(graphdef, params, rest)`` and
  ``step(params, opt_state, rest, *args) -> (params, opt_state, loss, aux, rest)``: gradients
  are taken w.r.t. the ``nnx.Param`` state only, and the returned ``rest`` is the model's
  non-parameter state after the forward pass (advanced RNG counters, ...); pass it back in to
  carry it, or pass the old one to reuse it.

  ``aux`` is None without ``has_aux``. ``static_argnums`` index ``args``; ``jit=False`` returns
  the plain function (to call inside another traced program, e.g. a ``lax.scan`` body);
  ``donate`` donates ``params`` and ``opt_state`` to the jitted step.
  """
  if graphdef is None:
    grad_fn = jax.value_and_grad(loss_fn, has_aux=has_aux)

    def step(params, opt_state, *args):
      out, grads = grad_fn(params, *args)
      loss, aux = out if has_aux else (out, None)
      params, opt_state = apply_optax(tx, grads, opt_state, params)
      return params, opt_state, loss, aux
    offset = 2
  else:
    def model_loss(params, rest, *args):
      # Fresh Variables at this trace level: the forward may update them (RNG counters).
      model = nnx.merge(graphdef, params, jax.tree.map(lambda x: x, rest))
      out = loss_fn(model, *args)
      loss, aux = out if has_aux else (out, None)
      return loss, (aux, nnx.split(model, nnx.Param, ...)[2])

    grad_fn = jax.value_and_grad(model_loss, has_aux=True)

    def step(params, opt_state, rest, *args):
      (loss, (aux, rest)), grads = grad_fn(params, rest, *args)
      params, opt_state = apply_optax(tx, grads, opt_state, params)
      return params, opt_state, loss, aux, rest
    offset = 3
  if not jit:
    return step
  return jax.jit(step, static_argnums=tuple(offset + i for i in static_argnums),
                 donate_argnums=(0, 1) if donate else ())


@dataclasses.dataclass
class StepsRun:
  params: Any
  opt_state: Any
  rest: Any
  steps: int                   # steps run: fewer than asked when ``on_every`` stopped the run
  history: list[dict]          # {"step", "loss", **aux} at the recorded steps, as Python floats

  @property
  def loss(self) -> float:
    """The last recorded loss (nan when nothing was recorded)."""
    return self.history[-1]["loss"] if self.history else math.nan


def run_steps(step: Callable, params, opt_state, rest, batches: Callable[..., tuple], *, steps: int,
              record: Callable[[int], bool] | None = None, every: int = 0,
              on_every: Callable[[int, Any, Any], bool | None] | None = None, at_end: bool = True,
              carry_rest: bool = True, sync: bool = False, progress: bool = False,
              desc: str = "train") -> StepsRun:
  """The Python loop over a :func:`make_train_step` step (NNX form) and a batch source.

  For ``s = 1 .. steps``: ``params, opt_state, loss, aux, new_rest = step(params, opt_state, rest,
  *batches(s, params, rest))``; ``rest`` becomes ``new_rest`` when ``carry_rest`` (RNG counters advance) and
  stays the one passed in otherwise.

  * ``batches(s, params, rest) -> tuple``: step ``s``'s arguments after ``rest``; it may draw from
    its own rng, return static arguments the step was jitted with, or read the state the step is
    about to update (SpikingNeRF packs its rays by the current occupancy).
  * ``record(s) -> bool``: keep step ``s``'s loss (and ``aux`` when it is a dict of scalars) in
    ``history``; default every step. Recorded values stay on device until the loop ends, so
    recording adds no synchronisation.
  * ``on_every(s, params, rest)`` after every ``every``-th step (and after the last with
    ``at_end``); returning True stops the run after step ``s``.
  * ``sync``: wait for each step before dispatching the next (a step with host callbacks, such
    as DATE's Hungarian matching, can otherwise stall the CPU runtime's thread pool).
  * ``progress``: a tqdm bar on stderr (``desc``), with the loss when ``sync``.
  """
  if steps < 1 or every < 0:
    raise ConfigError(f"steps={steps} must be >= 1 and every={every} >= 0")
  if on_every is not None and not every:
    raise ConfigError("on_every needs every >= 1")
  from tqdm.auto import tqdm
  kept, s = [], 0
  with tqdm(total=steps, desc=desc, disable=not progress, leave=False, dynamic_ncols=True) as bar:
    for s in range(1, steps + 1):
      params, opt_state, loss, aux, new_rest = step(params, opt_state, rest, *batches(s, params, rest))
      if carry_rest:
        rest = new_rest
      if sync:
        jax.block_until_ready(loss)
        if progress:  # the loss is on the host's side of the wait already
          bar.set_postfix(loss=f"{float(loss):.4g}", refresh=False)
      if record is None or record(s):
        kept.append((s, loss, aux if isinstance(aux, dict) else {}))
      bar.update(1)
      if on_every is not None and (s % every == 0 or (at_end and s == steps)) and on_every(s, params, rest):
        break
  history = [{"step": k, "loss": float(v), **{a: float(b) for a, b in parts.items()}}
             for k, v, parts in jax.device_get(kept)]
  return StepsRun(params, opt_state, rest, s, history)
