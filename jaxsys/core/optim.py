"""One optimizer description for every trainer: :class:`OptimizerConfig` -> an optax transform.

Every training loop in jaxsys (``jaxsys.train``, GRPO and video GRPO, the online drafter, the
graph models, SpikingNeRF, PalQuant, the streaming-gate trainer, the cluster demo job) builds its
optimizer here, so a setting means the same thing everywhere and a new one is added once::

  from jaxsys.core.optim import OptimizerConfig
  tx = OptimizerConfig("adamw", lr=3e-4, schedule="warmup_cosine", warmup_steps=100,
                       decay_steps=1000, min_lr_ratio=0.1, weight_decay=0.01, grad_clip=1.0).build()

Schedules (``lr`` is the peak):

* ``"constant"``: ``lr`` at every step;
* ``"cosine"``: ``lr`` decayed along a half cosine to ``min_lr_ratio * lr`` over ``decay_steps``;
* ``"warmup_cosine"``: linear from 0 over ``warmup_steps``, then that cosine until ``decay_steps``
  (counted from step 0, as optax's ``warmup_cosine_decay_schedule``);
* ``"exponential"``: ``lr * min_lr_ratio ** (step / decay_steps)`` (DVGO's decay).

``"adamw"`` decouples ``weight_decay`` from the gradient (Loshchilov & Hutter); ``"adam"`` has no
decay; ``"sgd"`` is momentum ``b1`` SGD with decoupled ``weight_decay`` added before the step.
``grad_clip`` clips the global gradient norm first; ``l2`` adds ``l2 * params`` to the gradient
before the optimizer (coupled L2, as torch's Adam ``weight_decay``).

Configs that train something nest one (``optimizer: OptimizerConfig | None = None``; None: the
one their shorthand fields such as ``lr`` describe; given, those fields must stay at their
defaults, checked by :func:`check_nested`): ``jaxsys.train.TrainConfig`` maps its own fields,
``GRPOConfig``, ``TLTConfig`` (``drafter_optimizer``), ``GNNTrainConfig`` (its weights),
``SylvieConfig``, ``DemoConfig``; as keyword arguments ``train_graph_transformer``, PalQuant's
``train_digits``, SpikingNeRF's ``make_optimizer``/``fit`` (``grid_optimizer``, ``mlp_optimizer``)
and the online ``DrafterTrainer``.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect

import optax

from jaxsys.core.errors import ConfigError, check_one_of

__all__ = ["check_nested", "OPTIMIZER_NAMES", "OptimizerConfig", "SCHEDULES", "warmup_cosine"]

OPTIMIZER_NAMES = ("adamw", "adam", "sgd")
SCHEDULES = ("constant", "cosine", "warmup_cosine", "exponential")


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
  name: str = "adamw"
  lr: float = 1e-3
  schedule: str = "constant"
  warmup_steps: int = 0
  decay_steps: int | None = None   # the decaying schedules' length in steps
  min_lr_ratio: float = 0.0        # lr at decay_steps, as a fraction of lr
  weight_decay: float = 0.0
  b1: float = 0.9
  b2: float = 0.999
  eps: float = 1e-8
  grad_clip: float | None = None
  l2: float = 0.0                  # coupled L2: l2 * params added to the gradient (torch Adam's weight_decay)

  def __post_init__(self):
    check_one_of("name", self.name, OPTIMIZER_NAMES)
    check_one_of("schedule", self.schedule, SCHEDULES)
    if not self.lr > 0:
      raise ConfigError(f"lr={self.lr} must be > 0")
    if self.schedule != "constant" and (self.decay_steps is None or self.decay_steps < 1):
      raise ConfigError(f"schedule={self.schedule!r} needs decay_steps >= 1, got {self.decay_steps}")
    if self.warmup_steps < 0 or (self.schedule == "warmup_cosine" and self.warmup_steps >= self.decay_steps):
      raise ConfigError(f"warmup_steps={self.warmup_steps} must be >= 0 and below decay_steps={self.decay_steps}")
    if min(self.weight_decay, self.min_lr_ratio, self.l2) < 0 or (self.grad_clip is not None and self.grad_clip <= 0):
      raise ConfigError(f"weight_decay={self.weight_decay}, min_lr_ratio={self.min_lr_ratio} and l2={self.l2} "
                        f"must be >= 0 and grad_clip={self.grad_clip} > 0 (or None)")
    if self.name == "adam" and self.weight_decay:
      raise ConfigError("name='adam' has no weight decay; use name='adamw' for weight_decay > 0")

  def learning_rate(self):
    """The schedule: a float (``"constant"``) or an optax schedule ``step -> lr``."""
    end = self.lr * self.min_lr_ratio
    if self.schedule == "constant":
      return self.lr
    if self.schedule == "cosine":
      return optax.cosine_decay_schedule(self.lr, self.decay_steps, alpha=self.min_lr_ratio)
    if self.schedule == "exponential":
      return optax.exponential_decay(self.lr, self.decay_steps, self.min_lr_ratio)
    return optax.warmup_cosine_decay_schedule(0.0, self.lr, self.warmup_steps, self.decay_steps, end_value=end)

  def build(self) -> optax.GradientTransformation:
    """One ``optax.chain`` (its state a tuple, as checkpoints of ``jaxsys.train`` hold it):
    ``clip_by_global_norm`` when ``grad_clip``, the coupled ``l2`` term when set, then the
    optimizer."""
    lr = self.learning_rate()
    parts = [optax.clip_by_global_norm(self.grad_clip)] if self.grad_clip is not None else []
    parts += [optax.add_decayed_weights(self.l2)] if self.l2 else []
    if self.name == "adam":
      parts.append(optax.adam(lr, b1=self.b1, b2=self.b2, eps=self.eps))
    elif self.name == "adamw":
      parts.append(optax.adamw(lr, b1=self.b1, b2=self.b2, eps=self.eps, weight_decay=self.weight_decay))
    else:
      parts += [optax.add_decayed_weights(self.weight_decay), optax.sgd(lr, momentum=self.b1)]
    return optax.chain(*parts)


def warmup_cosine(lr: float, steps: int, *, min_lr_ratio: float = 0.1, weight_decay: float = 1e-4) -> OptimizerConfig:
  """AdamW warmed up over a tenth of ``steps`` (at least 1), then a cosine to ``min_lr_ratio *
  lr`` at ``steps``: the supervised warm-ups' recipe (``weight_decay`` 1e-4 is optax's AdamW
  default)."""
  return OptimizerConfig("adamw", lr, "warmup_cosine", warmup_steps=max(steps // 10, 1), decay_steps=steps,
                         min_lr_ratio=min_lr_ratio, weight_decay=weight_decay)


# How a conflict message names the OptimizerConfig field a shorthand argument stands for.
_SETS = {"lr": "the learning rate", "weight_decay": "the weight decay", "l2": "the coupled L2 term"}


def _target(shorthand: str) -> str | None:
  """The OptimizerConfig field a shorthand name stands for: ``lr``, ``drafter_lr``, ``lr_grid``
  -> ``lr``; ``drafter_weight_decay`` -> ``weight_decay``; None when no field matches."""
  names = sorted((f.name for f in dataclasses.fields(OptimizerConfig)), key=len, reverse=True)
  return next((f for f in names if shorthand == f or shorthand.endswith("_" + f) or shorthand.startswith(f + "_")),
              None)


def check_nested(config, *shorthand: str, field: str = "optimizer", defaults=None) -> None:
  """The nested-optimizer check of a config that also keeps shorthand fields (``lr``, ...).

  ``config.<field>`` must be an :class:`OptimizerConfig` or None; when it is set, each
  ``shorthand`` field must equal its default, since the nested config owns every setting and a
  changed shorthand value would be silently ignored. ``config``: a dataclass instance (defaults:
  its field defaults), or a function's arguments as a mapping ``{name: value}`` with
  ``defaults`` that function (defaults: its signature's)::

    check_nested(self, "lr", "weight_decay")                                     # in __post_init__
    check_nested(dict(optimizer=optimizer, lr=lr), "lr", defaults=train_digits)  # in a function

  Raises ConfigError naming the argument: ``optimizer=... must be a
  jaxsys.core.optim.OptimizerConfig or None``, ``lr=0.1 and optimizer= both set the learning
  rate; set optimizer.lr only``.
  """
  if defaults is None:
    get = functools.partial(getattr, config)
    default = {f.name: f.default for f in dataclasses.fields(config)}
  else:
    get = config.__getitem__
    default = {n: p.default for n, p in inspect.signature(defaults).parameters.items()}
  nested = get(field)
  if nested is None:
    return
  if not isinstance(nested, OptimizerConfig):
    raise ConfigError(f"{field}={nested!r} must be a jaxsys.core.optim.OptimizerConfig or None")
  for name in shorthand:
    value = get(name)
    if value != default[name]:
      target = _target(name)
      if target is None:
        raise ConfigError(f"{name}={value!r} and {field}= both describe the optimizer; set {field} only")
      what = _SETS.get(target, f"the optimizer's {target}")
      raise ConfigError(f"{name}={value!r} and {field}= both set {what}; set {field}.{target} only")
