"""jaxsys.core.optim.OptimizerConfig: the schedules against their formulas, the optimizers against
optax's own, the trainers' configs mapped onto it (and nesting one: check_nested), and clear errors."""

import math
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from flax import nnx

from jaxsys import graphs
from jaxsys.cluster.demo_job import DemoConfig, _model
from jaxsys.core.errors import ConfigError
from jaxsys.core.optim import OptimizerConfig, check_nested, warmup_cosine
from jaxsys.models.graph.gnn import GNNTrainConfig
from jaxsys.models.graph.graph_transformer import train_graph_transformer
from jaxsys.models.nerf import spiking_nerf
from jaxsys.parallel.graph_comm import SylvieConfig
from jaxsys.quant.palquant import train_digits
from jaxsys.rl.grpo import GRPOConfig
from jaxsys.rl.tlt import TLTConfig
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


# ----------------------------------------------------------------------------- configs nesting one

SGD = OptimizerConfig("sgd", 0.1)


class _Built(Exception):
  """Stops a trainer once it has built the optimizers a test looks at."""


def _built(monkeypatch, fn, n: int = 1) -> list[OptimizerConfig]:
  """The OptimizerConfigs ``fn()`` builds, in order, stopping it at the ``n``-th (nothing trains)."""
  seen, real = [], OptimizerConfig.build

  def build(self):
    seen.append(self)
    if len(seen) == n:
      raise _Built
    return real(self)

  with monkeypatch.context() as m:
    m.setattr(OptimizerConfig, "build", build)
    with pytest.raises(_Built):
      fn()
  return seen


def _graph_transformer(monkeypatch, **kw):
  ds = types.SimpleNamespace(labels=np.zeros(4, np.int32), train_mask=np.ones(4, bool),
                             val_mask=np.ones(4, bool), test_mask=np.ones(4, bool))
  return _built(monkeypatch, lambda: train_graph_transformer(None, None, None, ds, **kw))


def _palquant(monkeypatch, **kw):
  data = (np.zeros((10, 8, 8, 1), np.float32), None, None, None)
  return _built(monkeypatch, lambda: train_digits(None, epochs=2, batch=4, data=data, **kw))


def _nerf(monkeypatch, **kw):  # fit passes the groups' optimizers on to make_optimizer
  views = types.SimpleNamespace(rays_o=np.zeros((1, 3)), rays_d=np.ones((1, 3)), images=np.zeros((1, 3)))
  model = nnx.Linear(1, 1, rngs=nnx.Rngs(0))
  return _built(monkeypatch, lambda: spiking_nerf.fit(model, views, steps=10, **kw), n=2)


def _dvgo_adam(lr, eps):  # SpikingNeRF's groups before they could be replaced
  return OptimizerConfig("adam", lr, "exponential", decay_steps=10, min_lr_ratio=0.1, b2=0.99, eps=eps)


# (run(monkeypatch, **kw) -> the optimizers built, the ones the code built before optimizer= existed,
#  the nested field, {shorthand field: a non-default value})
NESTING = {
    "grpo": (lambda mp, **kw: [GRPOConfig(**kw).optimizer_config()], [OptimizerConfig("adam", 3e-4)],
             "optimizer", {"lr": 1e-5}),
    "gnn": (lambda mp, **kw: [GNNTrainConfig(**kw).optimizer_config()],
            [OptimizerConfig("adamw", 0.01, weight_decay=5e-4)], "optimizer", {"lr": 0.02, "weight_decay": 0.0}),
    "graph_comm": (lambda mp, **kw: [SylvieConfig(**kw).optimizer_config()],
                   [OptimizerConfig("adamw", 0.01, weight_decay=5e-4)], "optimizer",
                   {"lr": 0.02, "weight_decay": 0.0}),
    "graph_transformer": (_graph_transformer, [OptimizerConfig("adamw", 5e-3, weight_decay=5e-4, l2=0.0)],
                          "optimizer", {"lr": 1e-2, "weight_decay": 0.0, "l2": 5e-4}),
    "spiking_nerf_grid": (_nerf, [_dvgo_adam(0.1, 1e-15), _dvgo_adam(1e-3, 1e-8)], "grid_optimizer",
                          {"lr_grid": 0.2}),
    "spiking_nerf_mlp": (_nerf, [_dvgo_adam(0.1, 1e-15), _dvgo_adam(1e-3, 1e-8)], "mlp_optimizer",
                         {"lr_mlp": 1e-2}),
    "palquant": (_palquant, [OptimizerConfig("adam", 3e-3, "cosine", decay_steps=2 * (10 // 4))], "optimizer",
                 {"lr": 1e-2}),
    "tlt": (lambda mp, **kw: [TLTConfig(**kw).drafter_optimizer_config()],
            [OptimizerConfig("adamw", 5e-4, weight_decay=0.0)], "drafter_optimizer",
            {"drafter_lr": 1e-3, "drafter_weight_decay": 0.1}),
    "demo_job": (lambda mp, **kw: [DemoConfig("unused", **kw).optimizer_config()], [OptimizerConfig("adam", 1e-2)],
                 "optimizer", {"lr": 0.5}),
}


@pytest.mark.parametrize("name", list(NESTING))
def test_configs_nest_one(monkeypatch, name):
  """Each trainer's config (or keyword arguments) nests an OptimizerConfig: by default the one
  its shorthand fields built before (same fields, so the same results); given, it is the one
  built; given beside a changed shorthand field, or not an OptimizerConfig, a ConfigError names
  the argument."""
  run, old, field, shorthand = NESTING[name]
  assert run(monkeypatch) == old
  assert SGD in run(monkeypatch, **{field: SGD})
  for short, value in shorthand.items():
    assert run(monkeypatch, **{short: value}) != old  # the shorthand still sets the default optimizer
    with pytest.raises(ConfigError, match=rf"^{short}={value!r} and {field}= both "):
      run(monkeypatch, **{short: value, field: SGD})
  with pytest.raises(ConfigError, match=rf"^{field}='adam' must be a jaxsys.core.optim.OptimizerConfig or None"):
    run(monkeypatch, **{field: "adam"})


def test_check_nested_messages():
  """The one check, on a dataclass (its field defaults) or a function's arguments (its
  signature's defaults): GRPO's message kept, a named OptimizerConfig field where the shorthand
  name says which, a plain one where it does not."""
  with pytest.raises(ConfigError, match=r"^lr=1e-05 and optimizer= both set the learning rate; set optimizer.lr only$"):
    GRPOConfig(lr=1e-5, optimizer=SGD)
  with pytest.raises(ConfigError, match="set drafter_optimizer.weight_decay only"):
    TLTConfig(drafter_weight_decay=0.1, drafter_optimizer=SGD)

  def f(lr=0.1, decay=0.5, optimizer=None):
    check_nested(dict(lr=lr, decay=decay, optimizer=optimizer), "lr", "decay", defaults=f)

  f(optimizer=SGD)
  f(lr=0.3, decay=0.2)
  with pytest.raises(ConfigError, match=r"^decay=0.2 and optimizer= both describe the optimizer; set optimizer only"):
    f(decay=0.2, optimizer=SGD)
  both = dict(grid_optimizer=SGD, mlp_optimizer=SGD)  # decay is both groups' shorthand
  spiking_nerf.make_optimizer(10, decay=0.2, grid_optimizer=SGD)
  with pytest.raises(ConfigError, match="^decay=0.2 and grid_optimizer="):
    spiking_nerf.make_optimizer(10, decay=0.2, **both)


def _takes_sgd_step(tx, params):
  """``tx``'s first update on unit gradients is SGD's at lr 0.1 (Adam's would be ~lr * sign)."""
  grads = jax.tree.map(jnp.ones_like, params)
  updates, _ = jax.jit(tx.update)(grads, tx.init(params), params)
  jax.tree.map(lambda u: np.testing.assert_allclose(u, -0.1 * np.ones_like(u), rtol=1e-6), updates)


def test_gnn_trains_with_the_nested_optimizer(monkeypatch):
  """train_gnn hands its train step a transform whose weights take the given optimizer's step."""
  from jaxsys.models.graph import gnn

  def train_step(loss_fn, tx, **kw):  # the transform train_gnn trains with; the run stops here
    seen.append(tx)
    raise _Built

  seen = []
  monkeypatch.setattr(gnn, "make_train_step", train_step)
  ds = graphs.sbm_graph(16, num_classes=2, num_features=4, avg_degree=3, seed=0)
  model = gnn.GNN(gnn.GNNConfig(4, 2, hidden=4), ds.num_nodes, rngs=nnx.Rngs(0))
  with pytest.raises(_Built):
    gnn.train_gnn(model, gnn.NodeData.from_dataset(ds, "gcn"), gnn.GNNTrainConfig(epochs=1, optimizer=SGD))
  _takes_sgd_step(seen[0], nnx.state(model, nnx.Param))


def test_tlt_and_demo_job_train_with_the_nested_optimizer():
  """TLTConfig.drafter_optimizer is the online drafter trainer's optimizer and DemoConfig.optimizer
  the demo job's: their transforms take SGD's first step."""
  from jaxsys.decoding.sampling import SamplingParams
  from jaxsys.models.llm.decoder import random_model
  from jaxsys.models.llm.drafter import DrafterConfig, EagleDrafter
  from jaxsys.rl import policy as pol, tasks
  from jaxsys.rl.tlt import make_tlt_trainer
  from jaxsys.speculative.bandit import Strategy
  from jaxsys.speculative.engine import RolloutConfig
  from jaxsys.speculative.online import DrafterTrainer

  pcfg = pol.policy_config(hidden=16, layers=1)
  drafter = EagleDrafter(DrafterConfig.for_target(pcfg), rngs=nnx.Rngs(1))
  rollout = RolloutConfig(strategies=(Strategy.chain(2),), max_new=6, max_prompt=8, batch_buckets=(8,),
                          stop_tokens=(tasks.EOS,), sampling=SamplingParams(1.0))
  dtr = make_tlt_trainer(random_model(pcfg, 0), drafter, tasks.TaskSampler(seed=1), rollout,
                         TLTConfig(drafter_optimizer=SGD)).drafter_trainer
  _takes_sgd_step(dtr.tx, dtr.params)
  _takes_sgd_step(_model(DemoConfig("unused", optimizer=SGD))[1], {"w": jnp.arange(3.0)})
  with pytest.raises(ConfigError, match="^lr=0.1 and optimizer= both set the learning rate"):
    DrafterTrainer(drafter, lr=0.1, optimizer=SGD)
