"""A tiny ``jaxsys.train`` job for the training tests and the kill/resume test (run as a script).

``python tests/_train_job.py WORKDIR OUT.npz [--kill-timer K:SECONDS] [--kill-at SAVE:PHASE]``
trains :class:`Tiny` for ``STEPS`` steps with a checkpoint every step in ``WORKDIR`` (resuming
from it) and writes the final parameters to ``OUT.npz``. It SIGKILLs itself ``SECONDS`` after
its ``K``-th step ends (before that step's save: the kill lands in the save or the next step),
or at the ``SAVE``-th save of this process at ``PHASE``: ``commit`` (orbax's files written, just
before it renames the step folder into place) or ``manifest`` (the manifest written to its
temporary file, just before it is renamed). Either way a run advances at most K + 1 steps.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxsys import train as T

STEPS = 20
CFG = T.TrainConfig(learning_rate=0.05, warmup_steps=2, total_steps=STEPS, log_every=1,
                    checkpoint_every=1, max_to_keep=2)


class Tiny(nnx.Module):
  """y = w2 . tanh(W1 x + b1) + b2 on 4 inputs (81 parameters)."""

  def __init__(self, hidden: int = 16, seed: int = 0):
    rngs = nnx.Rngs(seed)
    self.l1 = nnx.Linear(4, hidden, rngs=rngs)
    self.l2 = nnx.Linear(hidden, 1, rngs=rngs)

  def __call__(self, x):
    return self.l2(jnp.tanh(self.l1(x)))[:, 0]


def loss_fn(model, batch):
  err = model(batch["x"]) - batch["y"]
  return jnp.sum(err * err), jnp.float32(err.shape[0]), {}


def batches(step: int, nan_at=()) -> dict:
  """A pure function of the step (a resumed run sees the same data); NaN inputs at ``nan_at``."""
  rng = np.random.default_rng(step)
  x = rng.normal(size=(8, 4)).astype(np.float32)
  if step in nan_at:
    x[0, 0] = np.nan
  return {"x": x, "y": np.sin(x.sum(1)).astype(np.float32)}


def params(model) -> dict[str, np.ndarray]:
  flat = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(nnx.state(model, nnx.Param)))[0]
  return {jax.tree_util.keystr(k): np.asarray(v) for k, v in flat}


def _die():
  os.kill(os.getpid(), signal.SIGKILL)


def _kill_at(save: int, phase: str):
  """Wraps os.rename / os.replace to die on the ``save``-th commit rename or manifest rename."""
  count = {"n": 0}
  name = "rename" if phase == "commit" else "replace"
  orig = getattr(os, name)

  def wrapped(src, dst, *a, **kw):
    s, d = str(src), str(dst)
    hit = (s.endswith(".orbax-checkpoint-tmp") and os.path.basename(d).isdigit()
           if phase == "commit" else d.endswith("MANIFEST.json"))
    if hit:
      count["n"] += 1
      if count["n"] == save:
        _die()
    return orig(src, dst, *a, **kw)

  setattr(os, name, wrapped)


def main(argv=None) -> int:
  p = argparse.ArgumentParser()
  p.add_argument("workdir")
  p.add_argument("out")
  p.add_argument("--kill-timer", default=None, help="K:SECONDS")
  p.add_argument("--kill-at", default=None, help="SAVE:PHASE, PHASE in commit|manifest")
  a = p.parse_args(argv)
  jax.config.update("jax_default_matmul_precision", "highest")  # as tests/conftest.py
  if a.kill_at:
    save, phase = a.kill_at.split(":")
    _kill_at(int(save), phase)
  seen = []

  def on_step(step, row):  # runs after each step (log_every=1), before its checkpoint
    seen.append(step)
    if len(seen) == 1:
      print(f"first step {step}", flush=True)
    if a.kill_timer and len(seen) == int(a.kill_timer.split(":")[0]):
      threading.Timer(float(a.kill_timer.split(":")[1]), _die).start()

  model = Tiny()
  T.train(model, batches, CFG, workdir=a.workdir, loss_fn=loss_fn, progress=False,
          callback=on_step)
  np.savez(a.out, **params(model))
  return 0


if __name__ == "__main__":
  sys.exit(main())
