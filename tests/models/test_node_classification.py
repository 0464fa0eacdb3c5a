"""The one node-classification loop (``jaxsys.models.graph.node_classification.run_node_training``)
against the same steps run one by one from Python."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxsys.core.errors import ConfigError, ShapeError
from jaxsys.models.graph.node_classification import run_node_training

# a toy "training": state w float32[3] moves by the step's input; the "val accuracy" is a bump
# that rises, falls and rises again to the same height (a tie: the first best must win)
SCORES = np.array([0.1, 0.5, 0.95, 0.9, 0.2, 0.9, 0.3], np.float32)


def update(state, x):  # state: (w float32[3], step int32)
  w, i = state
  return (w + x, i + 1), jnp.sum(w * w)


def evaluate(state):
  w, i = state
  return jnp.stack([jnp.asarray(SCORES)[i - 1], jnp.sum(w)])


def test_equals_the_python_loop_and_keeps_the_first_best():
  steps, every = 7, 2
  xs = np.arange(steps * 3, dtype=np.float32).reshape(steps, 3) / 10
  state0 = (jnp.zeros(3, jnp.float32), jnp.int32(0))
  run = run_node_training(update, evaluate, state0, xs, steps=steps, num_metrics=2,
                          eval_every=every, select=0, keep=lambda s: s[0])
  state, losses, metrics, kept, best_score = state0, [], [], None, -np.inf
  for i in range(steps):
    state, loss = update(state, xs[i])
    losses.append(float(loss))
    if (i + 1) % every == 0 or i == steps - 1:
      m = np.asarray(evaluate(state))
      if m[0] > best_score:
        best_score, kept = m[0], np.asarray(state[0])
    else:
      m = np.full(2, -1.0, np.float32)
    metrics.append(m)
  np.testing.assert_array_equal(run.evals, [False, True, False, True, False, True, True])
  np.testing.assert_array_equal(run.losses, losses)
  np.testing.assert_array_equal(run.metrics, np.stack(metrics))
  np.testing.assert_array_equal(np.asarray(run.state[0]), np.asarray(state[0]))
  assert run.best == 3  # steps 3 and 5 tie at 0.9; step 2 (0.95) is not evaluated
  np.testing.assert_array_equal(np.asarray(run.kept), kept)
  np.testing.assert_array_equal(np.asarray(run.kept), xs[:4].sum(0))


def test_without_keep_returns_no_kept_state():
  run = run_node_training(update, evaluate, (jnp.zeros(3), jnp.int32(0)), np.ones((3, 3), np.float32),
                          steps=3, num_metrics=2)
  assert run.kept is None and run.evals.all() and run.best == 2


@pytest.mark.parametrize("kw, err, word", [
    (dict(steps=0), ConfigError, "steps"), (dict(eval_every=0), ConfigError, "eval_every"),
    (dict(select=2), ConfigError, "select"), (dict(num_metrics=3), ShapeError, "float32\\[3\\]"),
    (dict(steps=4), ShapeError, "leading axis")])
def test_bad_arguments_are_named(kw, err, word):
  args = dict(steps=3, num_metrics=2) | kw
  with pytest.raises(err, match=word):
    run_node_training(update, evaluate, (jnp.zeros(3), jnp.int32(0)), np.ones((3, 3), np.float32), **args)
