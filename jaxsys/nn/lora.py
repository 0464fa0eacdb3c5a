"""LoRA adapters on any jaxsys layer's projections, merging, and parameter freezing by path.

LoRA (Hu et al., 2021, eq. 3) trains a low-rank update of a frozen weight:
``W' = W + (alpha / r) * A @ B`` with ``A [fan_in, r]`` (random) and ``B [r, fan_out]`` (zeros,
so training starts from the base model exactly). jaxsys layers keep their weights as raw
``nnx.Param`` s read with ``w[...]`` inside their einsums (``wq [embed, heads, head_dim]``,
``wo [heads, head_dim, embed]``, SwiGLU's ``[embed, mlp]`` maps, ...). :func:`apply_lora` swaps
each targeted parameter for a :class:`LoRAWeight`, a module that *reads* like the parameter
(``w[...]`` returns ``W'`` in ``W``'s shape), so every layer, including a user's own layer that
reads its weight the same way, gets adapters without a code change.

* The base weight stays an ``nnx.Param`` (so the rules table, FSDP/TP placement and the memory
  estimator see it as before); the adapters are :class:`LoRAParam` (an ``nnx.Param`` subclass).
* ``jaxsys.train.train`` optimises only ``LoRAParam`` s when a model has any (optimizer state
  for the adapters alone), and skips parameters matching ``TrainConfig.freeze`` path patterns
  (:func:`trainable_filter`).
* :func:`merge_lora` folds the adapters back into plain parameters (for HF / GGUF export and
  decode packing); :func:`lora_state` / :func:`load_lora_state` take the adapters alone.

Targets are chosen by path regex (``targets``) or, by default, every projection: a parameter of
rank >= 2 with an ``embed`` logical axis, except the ``vocab`` embedding table (the tied head).

Example::

  model = Decoder(cfg, rngs=nnx.Rngs(0))
  apply_lora(model, LoRAConfig(rank=16, alpha=32), rngs=nnx.Rngs(1))
  train(model, batches, TrainConfig(...))   # only A and B are trained
  merge_lora(model)                         # plain weights again, W' folded in
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from jaxsys.core.errors import ConfigError

__all__ = ["apply_lora", "LoRAConfig", "LoRAParam", "LoRAWeight", "load_lora_state", "lora_state",
           "merge_lora", "path_name", "trainable_filter"]


class LoRAParam(nnx.Param):
  """An adapter matrix (``A`` or ``B``): the only parameters a LoRA model trains."""


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
  """``rank`` r, ``alpha`` (the update is scaled by ``alpha / rank``), ``targets``: regexes over
  parameter paths such as ``layers/0/attn/wq`` (``re.search``, among parameters of rank >= 2;
  empty: every projection)."""
  rank: int = 8
  alpha: float = 16.0
  targets: tuple[str, ...] = ()

  def __post_init__(self):
    object.__setattr__(self, "targets", tuple(self.targets))
    if self.rank < 1:
      raise ConfigError(f"LoRAConfig.rank={self.rank} must be >= 1")
    if not self.alpha > 0:
      raise ConfigError(f"LoRAConfig.alpha={self.alpha} must be > 0")
    for t in self.targets:
      try:
        re.compile(t)
      except re.error as e:
        raise ConfigError(f"LoRAConfig.targets entry {t!r} is not a regular expression: {e}") from None

  @classmethod
  def parse(cls, text: str) -> "LoRAConfig":
    """``"r=16,alpha=32,targets=wq|wv"`` (the CLI's ``--lora``); every key is optional."""
    kw: dict = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
      key, sep, value = item.partition("=")
      if not sep or key not in ("r", "rank", "alpha", "targets"):
        raise ConfigError(f"--lora item {item!r} must be r=N, alpha=X or targets=REGEX")
      if key in ("r", "rank"):
        kw["rank"] = int(value)
      elif key == "alpha":
        kw["alpha"] = float(value)
      else:
        kw["targets"] = (value,)
    return cls(**kw)


def _in_axes(logical: tuple) -> int:
  """Leading axes a projection contracts: ``wo [heads, head_dim, embed]`` two, the rest one."""
  return 2 if logical[:2] == ("heads", "head_dim") else 1


class LoRAWeight(nnx.Module):
  """A parameter plus its adapters; ``w[...]`` is ``W + (alpha / r) * (A @ B)`` in ``W``'s shape.

  ``base`` keeps the original ``nnx.Param`` (and its ``logical_axes``); ``lora_a [fan_in, r]``,
  ``lora_b [r, fan_out]`` where ``fan_in`` is the product of the contracted leading axes."""

  def __init__(self, base: nnx.Param, cfg: LoRAConfig, *, rngs: nnx.Rngs):
    w = base.get_value()
    logical = tuple(base.get_metadata().get("logical_axes") or (None,) * w.ndim)
    k = _in_axes(logical) if w.ndim > 2 else 1
    fan_in, fan_out = math.prod(w.shape[:k]), math.prod(w.shape[k:])
    self.base = base
    self.rank, self.scale, self.in_axes = cfg.rank, cfg.alpha / cfg.rank, k
    # Kaiming-uniform A as in the reference implementation; B = 0, so W' = W at step 0.
    bound = 1.0 / math.sqrt(fan_in)
    a = jax.random.uniform(rngs.params(), (fan_in, cfg.rank), jnp.float32, -bound, bound)
    self.lora_a = LoRAParam(a.astype(w.dtype), logical_axes=(None, None))
    self.lora_b = LoRAParam(jnp.zeros((cfg.rank, fan_out), w.dtype), logical_axes=(None, None))

  @property
  def shape(self):
    return self.base.get_value().shape

  @property
  def dtype(self):
    return self.base.get_value().dtype

  @property
  def ndim(self):
    return len(self.shape)

  def delta(self):
    """``(alpha / r) * A @ B`` reshaped like the base weight (the learned update)."""
    upd = self.lora_a[...].astype(jnp.float32) @ self.lora_b[...].astype(jnp.float32)
    return (self.scale * upd).reshape(self.shape)

  def __getitem__(self, idx):
    w = self.base[...]
    return (w.astype(jnp.float32) + self.delta()).astype(w.dtype)[idx]


def path_name(path) -> str:
  """``layers/0/attn/wq`` for an nnx state path."""
  return "/".join(str(getattr(k, "key", k)) for k in path)


def _is_projection(var: nnx.Variable) -> bool:
  logical = tuple(var.get_metadata().get("logical_axes") or ())
  return var.get_value().ndim >= 2 and "embed" in logical and "vocab" not in logical


def _targets(model: nnx.Module, cfg: LoRAConfig) -> list[tuple[tuple, nnx.Param]]:
  found = []
  for path, var in nnx.iter_graph(model):
    if type(var) is not nnx.Param or any(getattr(k, "key", k) in ("lora_a", "lora_b", "base")
                                          for k in path):
      continue
    name = path_name(path)
    if var.get_value().ndim < 2:  # biases and norm scales are not projections
      continue
    if cfg.targets:
      if any(re.search(t, name) for t in cfg.targets):
        found.append((path, var))
    elif _is_projection(var):
      found.append((path, var))
  return found


def apply_lora(model: nnx.Module, cfg: LoRAConfig, *, rngs: nnx.Rngs) -> list[str]:
  """Wraps every targeted parameter of ``model`` in a :class:`LoRAWeight`, in place; returns
  the wrapped paths. A ``targets`` pattern that matches no parameter raises ``ConfigError``."""
  found = _targets(model, cfg)
  names = [path_name(p) for p, _ in found]
  for t in cfg.targets:
    if not any(re.search(t, n) for n in names):
      raise ConfigError(f"LoRAConfig.targets entry {t!r} matches no parameter of the model "
                        f"(parameters are named like {_example_names(model)})")
  if not found:
    raise ConfigError("apply_lora found no projection to adapt (a rank >= 2 parameter with an "
                      "'embed' logical axis); name the targets with LoRAConfig.targets")
  for path, var in found:
    parent = _parent(model, path)
    setattr(parent, str(getattr(path[-1], "key", path[-1])), LoRAWeight(var, cfg, rngs=rngs))
  return names


def merge_lora(model: nnx.Module) -> int:
  """Replaces every :class:`LoRAWeight` by a plain ``nnx.Param`` holding ``W'``, in place (same
  logical axes); returns how many were merged."""
  wrapped = [(path, m) for path, m in nnx.iter_graph(model) if isinstance(m, LoRAWeight)]
  for path, m in wrapped:
    merged = nnx.Param(m[...], **m.base.get_metadata())
    setattr(_parent(model, path), str(getattr(path[-1], "key", path[-1])), merged)
  return len(wrapped)


def lora_state(model: nnx.Module) -> dict:
  """The adapters alone, as a pure dict (``{path: {"lora_a", "lora_b"}}``) for saving."""
  return nnx.to_pure_dict(nnx.state(model, LoRAParam))


def load_lora_state(model: nnx.Module, pure: dict) -> None:
  """Loads adapters saved by :func:`lora_state` into a model with the same adapters applied."""
  state = nnx.state(model, LoRAParam)
  want = jax.tree.map(lambda v: (v.shape, v.dtype), nnx.to_pure_dict(state))
  got = jax.tree.map(lambda v: (tuple(v.shape), v.dtype), pure)
  if jax.tree.structure(want) != jax.tree.structure(got) or want != got:
    raise ConfigError("the saved adapters do not match the model's (apply_lora with the same "
                      "LoRAConfig before loading)")
  nnx.replace_by_pure_dict(state, jax.tree.map(jnp.asarray, pure))  # numpy in, device arrays held
  nnx.update(model, state)


def trainable_filter(model: nnx.Module, freeze: Sequence[str] = ()):
  """The nnx filter of the parameters training updates: the :class:`LoRAParam` adapters when
  the model has any, else every ``nnx.Param``; minus paths matching a ``freeze`` regex. A
  ``freeze`` pattern that matches nothing, or a filter that leaves nothing to train, raises
  ``ConfigError`` (nothing is silently ignored)."""
  kind = LoRAParam if nnx.state(model, LoRAParam) else nnx.Param
  if not freeze:
    return kind
  names = [path_name(p) for p, v in nnx.iter_graph(model) if isinstance(v, kind)]
  for f in freeze:
    try:
      pattern = re.compile(f)
    except re.error as e:
      raise ConfigError(f"freeze entry {f!r} is not a regular expression: {e}") from None
    if not any(pattern.search(n) for n in names):
      raise ConfigError(f"freeze entry {f!r} matches no trainable parameter "
                        f"(parameters are named like {_example_names(model)})")

  def frozen(path, _value):
    return any(re.search(f, path_name(path)) for f in freeze)

  flt = nnx.All(kind, nnx.Not(frozen))
  if not nnx.state(model, flt):
    raise ConfigError(f"freeze={tuple(freeze)!r} freezes every trainable parameter")
  return flt


def _parent(model, path):
  node = model
  for k in path[:-1]:
    k = getattr(k, "key", k)
    node = node[k] if isinstance(k, int) else getattr(node, k)
  return node


def _example_names(model, n: int = 3) -> str:
  names = [path_name(p) for p, v in nnx.iter_graph(model) if isinstance(v, nnx.Param)]
  return ", ".join(names[:n]) + (", ..." if len(names) > n else "")
