"""The train-step primitives every training loop builds on: :func:`make_train_step` (one optax
step on a loss, for pure parameters or an NNX model) and :func:`apply_optax` (its optax part).

They sit in ``core`` so that every layer may use them: ``parallel``'s graph-partitioned step and
``quant``'s PalQuant training sit below ``train`` (the generic loop over them, ``jaxsys.train``,
which re-exports both) and ``models`` (whose recipes use them through ``train``).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import optax
from flax import nnx

__all__ = ["apply_optax", "make_train_step"]


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
