"""train.make_train_step: the shared optax step equals the hand-written one (pure and NNX)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxsys import train as T


def _hand_step(loss_fn, tx, params, opt_state, *args):
  loss, g = jax.value_and_grad(loss_fn)(params, *args)
  upd, opt_state = tx.update(g, opt_state, params)
  return optax.apply_updates(params, upd), opt_state, loss


def test_pure_step_matches_hand_written_loop():
  tx = optax.adamw(1e-2)
  x = jax.random.normal(jax.random.key(0), (16, 3))
  y = x @ jnp.array([1.0, -2.0, 0.5])

  def loss_fn(p, x, y):
    return jnp.mean((x @ p["w"] + p["b"] - y) ** 2)

  p0 = {"w": jnp.zeros(3), "b": jnp.zeros(())}
  step = T.make_train_step(loss_fn, tx)
  ref = jax.jit(lambda p, o, x, y: _hand_step(loss_fn, tx, p, o, x, y))
  p, o, pr, orr = p0, tx.init(p0), p0, tx.init(p0)
  losses = []
  for _ in range(5):
    p, o, loss, aux = step(p, o, x, y)
    pr, orr, lr = ref(pr, orr, x, y)
    assert aux is None and float(loss) == float(lr)
    losses.append(float(loss))
  np.testing.assert_array_equal(np.asarray(p["w"]), np.asarray(pr["w"]))
  assert losses[-1] < losses[0]


def test_aux_and_static_args():
  tx = optax.sgd(0.1)

  def loss_fn(p, scale, x):
    return scale * jnp.sum(p * x) ** 2, {"scale": scale}

  step = T.make_train_step(loss_fn, tx, has_aux=True, static_argnums=(0,))
  p, o, loss, aux = step(jnp.ones(2), tx.init(jnp.ones(2)), 3, jnp.ones(2))
  assert aux == {"scale": 3} and float(loss) == 12.0
  np.testing.assert_allclose(np.asarray(p), 1 - 0.1 * 3 * 2 * 2, rtol=1e-6)  # float32 update


class _Net(nnx.Module):
  def __init__(self, rngs):
    self.lin = nnx.Linear(4, 2, rngs=rngs)
    self.drop = nnx.Dropout(0.5, rngs=rngs)

  def __call__(self, x):
    return self.lin(self.drop(x))


def test_nnx_step_matches_nnx_optimizer_and_carries_rng_state():
  x = jnp.ones((8, 4))

  def loss_fn(model, x):
    return jnp.mean(model(x) ** 2)

  tx = optax.adam(1e-2)
  ref_model = _Net(nnx.Rngs(0))
  opt = nnx.Optimizer(ref_model, tx, wrt=nnx.Param)

  @nnx.jit
  def ref_step(model, opt, x):
    loss, g = nnx.value_and_grad(lambda m: loss_fn(m, x))(model)
    opt.update(model, g)
    return loss

  model = _Net(nnx.Rngs(0))
  gdef, params, rest = nnx.split(model, nnx.Param, ...)
  step = T.make_train_step(loss_fn, tx, graphdef=gdef)
  o = tx.init(params)
  losses = set()
  for _ in range(3):
    params, o, loss, aux, rest = step(params, o, rest, x)
    assert aux is None and float(loss) == float(ref_step(ref_model, opt, x))
    losses.add(float(loss))
  assert len(losses) == 3  # the dropout RNG advanced: each step drew a new mask
  nnx.update(model, params, rest)
  np.testing.assert_array_equal(np.asarray(model.lin.kernel[...]),
                                np.asarray(ref_model.lin.kernel[...]))
