"""jaxsys.core.optim.OptimizerConfig: the schedules against their formulas, the optimizers against
optax's own, the trainers' configs mapped onto it, and clear errors."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxsys.core.errors import ConfigError
from jaxsys.core.optim import OptimizerConfig, warmup_cosine
from jaxsys.rl.grpo import GRPOConfig
from jaxsys.train import TrainConfig, make_optimizer


def _run(tx, steps=5):
  """Parameters after ``steps`` updates on a fixed quadratic (gradients = 3 * step * params)."""
  p = {"w": jnp.arange(1.0, 7.0).reshape(2, 3)}
  s = tx.init(p)
  for i in range(steps):
    u, s = tx.update(jax.tree.map(lambda x: 3.0 * (i + 1) * x, p), s, p)
    p = optax.apply_updates(p, u)
  return np.asarray(p["w"]), jax.tree.structure(s)


def test_schedules_follow_their_formulas():
  lr = 0.1
  cos = OptimizerConfig(lr=lr, schedule="cosine", decay_steps=10, min_lr_ratio=0.2).learning_rate()
  for t in (0, 3, 10):
    assert float(cos(t)) == pytest.approx(lr * (0.2 + 0.8 * 0.5 * (1 + math.cos(math.pi * t / 10))))
  exp = OptimizerConfig(lr=lr, schedule="exponential", decay_steps=10, min_lr_ratio=0.1).learning_rate()
  assert float(exp(5)) == pytest.approx(lr * 0.1 ** 0.5) and float(exp(10)) == pytest.approx(lr * 0.1)
  warm = OptimizerConfig(lr=lr, schedule="warmup_cosine", warmup_steps=4, decay_steps=12).learning_rate()
  assert float(warm(0)) == 0.0 and float(warm(2)) == pytest.approx(lr / 2) and float(warm(4)) == pytest.approx(lr)
  assert float(warm(12)) == pytest.approx(0.0, abs=1e-9)
  assert OptimizerConfig(lr=lr).learning_rate() == lr


@pytest.mark.parametrize("name", ["adam", "adamw", "sgd"])
def test_optimizers_equal_optax(name):
  cfg = OptimizerConfig(name, lr=0.05, weight_decay=0.0 if name == "adam" else 0.01, grad_clip=1.0)
  ref = {"adam": lambda: optax.adam(0.05),
         "adamw": lambda: optax.adamw(0.05, weight_decay=0.01),
         "sgd": lambda: optax.chain(optax.add_decayed_weights(0.01), optax.sgd(0.05, momentum=0.9))}[name]()
  got, _ = _run(cfg.build())
  want, _ = _run(optax.chain(optax.clip_by_global_norm(1.0), ref))
  np.testing.assert_allclose(got, want, rtol=1e-6)
  l2, _ = _run(OptimizerConfig("adam", lr=0.05, l2=0.1).build())
  want, _ = _run(optax.chain(optax.add_decayed_weights(0.1), optax.adam(0.05)))
  np.testing.assert_allclose(l2, want, rtol=1e-6)


def test_train_config_is_an_optimizer_config():
  """TrainConfig's fields build the same optimizer (values and state layout) as the formula
  written out: warmup to the peak, cosine to min_lr_ratio at total_steps, clipped AdamW / SGD."""
  for cfg in (TrainConfig(total_steps=20, warmup_steps=5), TrainConfig(optimizer="sgd", grad_clip=None,
                                                                        warmup_steps=0, total_steps=3)):
    warm = min(cfg.warmup_steps, cfg.total_steps - 1)
    sched = optax.warmup_cosine_decay_schedule(0.0, cfg.learning_rate, max(warm, 1), max(cfg.total_steps, warm + 2),
                                               end_value=cfg.learning_rate * cfg.min_lr_ratio)
    parts = [optax.clip_by_global_norm(cfg.grad_clip)] if cfg.grad_clip else []
    parts += ([optax.add_decayed_weights(cfg.weight_decay), optax.sgd(sched, momentum=cfg.b1)]
              if cfg.optimizer == "sgd" else [optax.adamw(sched, b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay)])
    (got, got_tree), (want, want_tree) = _run(make_optimizer(cfg)), _run(optax.chain(*parts))
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert got_tree == want_tree  # checkpoints of jaxsys.train keep restoring
  w = warmup_cosine(1e-2, 30)
  assert (w.name, w.warmup_steps, w.decay_steps, w.min_lr_ratio, w.weight_decay) == ("adamw", 3, 30, 0.1, 1e-4)


def test_grpo_config_nests_one():
  assert GRPOConfig().optimizer_config() == OptimizerConfig("adam", lr=GRPOConfig.lr)
  opt = OptimizerConfig("adamw", lr=1e-5, weight_decay=0.1, grad_clip=1.0)
  assert GRPOConfig(optimizer=opt).optimizer_config() is opt
  with pytest.raises(ConfigError, match="both set the learning rate"):
    GRPOConfig(lr=1e-5, optimizer=opt)


@pytest.mark.parametrize("kw, match", [
    (dict(name="lion"), "name"), (dict(schedule="linear"), "schedule"), (dict(lr=0.0), "lr=0.0 must be > 0"),
    (dict(schedule="cosine"), "needs decay_steps"), (dict(schedule="warmup_cosine", warmup_steps=10, decay_steps=10),
                                                     "warmup_steps=10"),
    (dict(grad_clip=0.0), "grad_clip"), (dict(name="adam", weight_decay=0.1), "name='adamw'"),
    (dict(l2=-1.0), "l2=-1.0")])
def test_bad_settings(kw, match):
  with pytest.raises(ConfigError, match=match):
    OptimizerConfig(**kw)
