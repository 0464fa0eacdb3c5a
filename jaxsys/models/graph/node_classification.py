"""The one node-classification training loop: full-batch steps and periodic evaluation in one
compiled ``lax.scan``, with the first best evaluation selected.

``gnn.train_gnn`` (GCN / GIN / GAT, float32 or A2Q) and ``graph_transformer.train_graph_transformer``
(graph transformer, GCN baseline) are recipes over :func:`run_node_training`: each brings its
optimizer, its ``update`` (a ``jaxsys.train.make_train_step(..., jit=False)`` step on the masked
node cross-entropy, ``jaxsys.graphs.node_loss``) and its ``evaluate``.

The whole run is one program because per-step dispatch from Python cost more than a Cora step;
``step_ms`` is its mean wall time per step (evaluations included, compilation excluded).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxsys.core.errors import ConfigError, ShapeError

__all__ = ["NodeTrainingRun", "run_node_training"]

log = logging.getLogger("jaxsys")


@dataclasses.dataclass
class NodeTrainingRun:
  state: Any           # the carry after the last step
  kept: Any            # keep(state) at the best evaluation (None without keep)
  losses: np.ndarray   # float32 [steps]: the training loss of each step
  metrics: np.ndarray  # float32 [steps, k]: evaluate() after the step, -1 where not evaluated
  evals: np.ndarray    # bool [steps]: the steps followed by an evaluation
  best: int            # the first step whose metrics[:, select] is the largest
  step_ms: float


def run_node_training(update: Callable, evaluate: Callable, state, step_inputs, *, steps: int,
                      num_metrics: int, eval_every: int = 1, select: int = 0,
                      keep: Callable | None = None, progress: bool = False,
                      desc: str = "node classification") -> NodeTrainingRun:
  """Runs ``steps`` training steps with an evaluation after every ``eval_every``-th and the last.

  ``update(state, inputs) -> (state, loss)`` is one traced step; ``inputs`` is step ``i``'s
  slice of ``step_inputs`` (a pytree of arrays with leading axis ``steps``: dropout seeds,
  dense-step flags, ...). ``evaluate(state) -> float32[num_metrics]`` (accuracies, ...);
  ``metrics[:, select]`` picks the best evaluation (validation accuracy). ``keep(state)``: the
  part of the state to return from that evaluation (the selected parameters). ``progress``: a
  tqdm bar on stderr that the compiled run advances at every evaluation.
  """
  if steps < 1 or eval_every < 1:
    raise ConfigError(f"steps={steps} and eval_every={eval_every} must be >= 1")
  if not 0 <= select < num_metrics:
    raise ConfigError(f"select={select} must index the {num_metrics} metrics")
  for leaf in jax.tree.leaves(step_inputs):
    if np.shape(leaf)[:1] != (steps,):
      raise ShapeError(f"step_inputs leaves must have leading axis steps={steps}, got {np.shape(leaf)}")
  evals = np.array([(i + 1) % eval_every == 0 or i == steps - 1 for i in range(steps)])
  from tqdm.auto import tqdm
  bar = tqdm(total=steps, desc=desc, disable=not progress, leave=False, dynamic_ncols=True)

  def report(step, loss, score):  # host side, at evaluation steps only (one callback per eval)
    bar.n = int(step) + 1
    bar.set_postfix(loss=f"{float(loss):.3f}", val=f"{float(score):.3f}", refresh=False)
    bar.refresh()

  def evaluate_and_report(state, step, loss):
    m = jnp.asarray(evaluate(state), jnp.float32)
    if m.shape != (num_metrics,):
      raise ShapeError(f"evaluate must return float32[{num_metrics}], got shape {m.shape}")
    if progress:
      jax.debug.callback(report, step, loss, m[select])
    return m

  def body(carry, xs):
    state, best_score, kept = carry
    inputs, do_eval, step = xs
    state, loss = update(state, inputs)
    m = jax.lax.cond(do_eval, lambda s: evaluate_and_report(s, step, loss),
                     lambda s: jnp.full((num_metrics,), -1.0, jnp.float32), state)
    if keep is not None:  # strictly better: the first best evaluation wins, as np.argmax
      better = do_eval & (m[select] > best_score)
      kept = jax.tree.map(lambda new, old: jnp.where(better, new, old), keep(state), kept)
      best_score = jnp.where(better, m[select], best_score)
    return (state, best_score, kept), (loss, m)

  kept0 = None if keep is None else keep(state)
  carry = (state, jnp.float32(-jnp.inf), kept0)
  idx = np.arange(steps, dtype=np.int32)
  t_c = time.perf_counter()
  run = _compile_hoisted(lambda c, x, e, i: jax.lax.scan(body, c, (x, e, i)), carry, step_inputs, evals, idx)
  log.info("%s: compiled %d steps in %.1fs", desc, steps, time.perf_counter() - t_c)
  t0 = time.perf_counter()
  try:
    (state, _, kept), (losses, metrics) = jax.block_until_ready(run(carry, step_inputs, evals, idx))
  finally:
    bar.close()
  step_ms = 1e3 * (time.perf_counter() - t0) / steps
  log.info("%s: %d steps, %.2f ms/step", desc, steps, step_ms)
  metrics = np.asarray(metrics)
  return NodeTrainingRun(state=state, kept=kept, losses=np.asarray(losses), metrics=metrics,
                         evals=evals, best=int(np.argmax(metrics[:, select])), step_ms=step_ms)


def _compile_hoisted(fn, *args):
  """``jax.jit(fn).lower(*args).compile()`` with the arrays ``fn`` closes over (features, graph,
  labels, masks) passed as arguments, not embedded in the program: a 15 MB constant (Cora's
  features) costs ~0.2 s of XLA:CPU compile per program and is written into each cached
  executable. Returns ``f(*args)`` with ``fn``'s output structure."""
  closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
  flat = jax.jit(lambda consts, *xs: jax.core.eval_jaxpr(closed.jaxpr, consts, *jax.tree.leaves(xs)))
  compiled = flat.lower(closed.consts, *args).compile()
  out_tree = jax.tree.structure(out_shape)
  return lambda *xs: jax.tree.unflatten(out_tree, compiled(closed.consts, *xs))
