"""``jaxsys.core.step.run_steps``: the Python loop of the training-loop family, against the loop it
replaces written out by hand."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxsys.core.errors import ConfigError
from jaxsys.core.optim import OptimizerConfig
from jaxsys.core.step import make_train_step, run_steps


class _Net(nnx.Module):
  def __init__(self):
    self.lin = nnx.Linear(3, 1, rngs=nnx.Rngs(0))
    self.drop = nnx.Dropout(0.5, rngs=nnx.Rngs(1))   # RNG state in ``rest``: carry_rest matters

  def __call__(self, x):
    return self.drop(self.lin(x))


def _loss(model, x, y):
  out = model(x)[:, 0]
  return jnp.mean((out - y) ** 2), {"mean": jnp.mean(out)}


def _setup():
  gdef, params, rest = nnx.split(_Net(), nnx.Param, ...)
  tx = OptimizerConfig("adam", 0.1).build()
  return gdef, params, tx.init(params), rest, make_train_step(_loss, tx, graphdef=gdef, has_aux=True)


def _batch(s, params=None, rest=None):
  rng = np.random.default_rng(s)
  return jnp.asarray(rng.normal(size=(8, 3)), jnp.float32), jnp.asarray(rng.normal(size=8), jnp.float32)


@pytest.mark.parametrize("carry_rest", [True, False])
def test_equals_the_hand_written_loop(carry_rest):
  _, params, opt, rest, step = _setup()
  p, o, r, want = params, opt, rest, []
  for s in range(1, 6):
    p, o, loss, aux, new_rest = step(p, o, r, *_batch(s))
    r = new_rest if carry_rest else r
    want.append((s, float(loss), float(aux["mean"])))
  run = run_steps(step, params, opt, rest, _batch, steps=5, carry_rest=carry_rest)
  assert [(h["step"], h["loss"], h["mean"]) for h in run.history] == want
  np.testing.assert_array_equal(np.asarray(run.params["lin"]["kernel"][...]), np.asarray(p["lin"]["kernel"][...]))
  assert run.steps == 5 and run.loss == want[-1][1]


def test_record_every_and_early_stop():
  _, params, opt, rest, step = _setup()
  seen = []

  def on_every(s, p, r):
    seen.append(s)
    return s == 4   # stop after step 4

  run = run_steps(step, params, opt, rest, _batch, steps=9, every=2, on_every=on_every,
                  record=lambda s: s % 3 == 0, sync=True)
  assert seen == [2, 4] and run.steps == 4 and [h["step"] for h in run.history] == [3]
  ends = []
  run_steps(step, params, opt, rest, _batch, steps=5, every=2, on_every=lambda s, p, r: ends.append(s))
  assert ends == [2, 4, 5]   # and after the last step (at_end)
  ends.clear()
  run_steps(step, params, opt, rest, _batch, steps=5, every=2, on_every=lambda s, p, r: ends.append(s),
            at_end=False)
  assert ends == [2, 4]


def test_the_batch_source_sees_the_state_the_step_updates():
  _, params, opt, rest, step = _setup()
  kernels = []

  def batch(s, p, r):
    kernels.append(np.asarray(p["lin"]["kernel"][...]).copy())
    return _batch(s)

  run = run_steps(step, params, opt, rest, batch, steps=3)
  np.testing.assert_array_equal(kernels[0], np.asarray(params["lin"]["kernel"][...]))
  assert not np.array_equal(kernels[1], kernels[0]) and len(kernels) == 3
  assert not np.array_equal(np.asarray(run.params["lin"]["kernel"][...]), kernels[2])


def test_errors():
  _, params, opt, rest, step = _setup()
  with pytest.raises(ConfigError, match="steps=0"):
    run_steps(step, params, opt, rest, _batch, steps=0)
  with pytest.raises(ConfigError, match="on_every needs every"):
    run_steps(step, params, opt, rest, _batch, steps=2, on_every=lambda *a: None)
  assert np.isnan(run_steps(step, params, opt, rest, _batch, steps=1, record=lambda s: False).loss)
