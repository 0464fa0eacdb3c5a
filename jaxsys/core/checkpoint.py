"""Orbax checkpoints of arbitrary pytrees (params, optimizer state, step, data cursor).

``Checkpointer(directory)`` wraps ``orbax.checkpoint.CheckpointManager``: ``save(step, tree)``,
``latest_step()``, ``restore(step, like=tree)``. Restoring against ``like`` (an example tree or
``jax.ShapeDtypeStruct`` tree with shardings) gives back the same structure, dtypes and
placement, so a resumed run continues bit for bit.

Usage::

  ckpt = Checkpointer("/tmp/run/ckpt", max_to_keep=2)
  ckpt.save(100, {"params": params, "opt_state": opt_state})
  state = ckpt.restore(like={"params": params, "opt_state": opt_state})
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from jaxsys.core.errors import InputError


def _abstract(tree):
  def one(x):
    if isinstance(x, jax.ShapeDtypeStruct):
      return x
    if hasattr(x, "shape") and hasattr(x, "dtype"):
      return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))
    return x
  return jax.tree.map(one, tree)


class Checkpointer:
  """Step-numbered checkpoints in ``directory`` keeping the newest ``max_to_keep``."""

  def __init__(self, directory: str | os.PathLike, *, max_to_keep: int | None = 3):
    self.directory = Path(directory).absolute()
    self.directory.mkdir(parents=True, exist_ok=True)
    options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True)
    self._manager = ocp.CheckpointManager(self.directory, options=options)

  def save(self, step: int, tree: Any, *, wait: bool = True) -> None:
    self._manager.save(int(step), args=ocp.args.StandardSave(tree), force=True)
    if wait:
      self._manager.wait_until_finished()

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    return list(self._manager.all_steps())

  def restore(self, step: int | None = None, *, like: Any) -> Any:
    """Restores ``step`` (default: latest) into the structure of ``like``."""
    step = self.latest_step() if step is None else int(step)
    if step is None:
      raise InputError(f"no checkpoint in {self.directory}")
    if step not in self._manager.all_steps():
      raise InputError(f"step={step} is not in {self.directory}; have {self.all_steps()}")
    return self._manager.restore(step, args=ocp.args.StandardRestore(_abstract(like)))

  def close(self):
    self._manager.wait_until_finished()
    self._manager.close()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()
