"""A small deterministic JAX training job with asynchronous orbax checkpoints, for supervision.

The model is a 2-layer MLP regressing a fixed random teacher; the batch of step ``s`` is drawn
from ``fold_in(PRNGKey(seed), s)``, so the data order is keyed by step and a run resumed from
a checkpoint of (params, full optax state, step) continues bit-for-bit like an uninterrupted
one. Checkpoints are written every ``ckpt_every`` steps by :class:`jaxsys.core.checkpoint.Checkpointer`
(orbax, async saving, a verified manifest per step); a run resumes from the newest *intact*
checkpoint, so a corrupted or half-written newest one falls back to the one before it.

Each step reports a heartbeat ``{"step", "loss", "restored", "time"}`` (a JSON file written
atomically, or a callback in-process). A :class:`FailureInjector` fires injected failures
(crash with a realistic error message, NaN loss, hang, hard kill) at given steps, once each,
remembering fired injections across restarts in a state folder.

Usage::

  python -m jaxsys.cluster.demo_job --ckpt-dir /tmp/ck --steps 60 --inject 17:nccl,40:nan
  # or in-process: train(DemoConfig(ckpt_dir=...), heartbeat=fn, injector=FailureInjector(...))
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import sys
import time
from pathlib import Path

from jaxsys.core.optim import OptimizerConfig, check_nested
from jaxsys.core.errors import ConfigError, check_positive

__all__ = [
    "DemoConfig", "FAILURE_MESSAGES", "FailureInjector", "FileHeartbeat", "InjectedFailure", "KINDS",
    "main", "parse_inject", "train",
]

# Realistic last lines of the logs of failing jobs, by failure kind (what the injector prints).
FAILURE_MESSAGES = {
    "nccl": ("RuntimeError: NCCL error in: ../torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:1275, "
             "unhandled system error, NCCL version 2.14.3\nncclSystemError: System call (e.g. socket, "
             "malloc) or external library call failed or device error."),
    "nccl_timeout": ("[Rank 3] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=5821, "
                     "OpType=ALLREDUCE, Timeout(ms)=1800000) ran for 1800412 milliseconds before timing out."),
    "ecc": "RuntimeError: CUDA error: uncorrectable ECC error encountered",
    "cuda": ("RuntimeError: CUDA error: an illegal memory access was encountered\nCUDA kernel errors "
             "might be asynchronously reported at some other API call."),
    "node": "slurmstepd: error: *** STEP 2071.0 ON node-17 CANCELLED DUE TO NODE FAILURE ***",
    "oom": ("jaxlib.xla_extension.XlaRuntimeError: RESOURCE_EXHAUSTED: Out of memory while trying to "
            "allocate 17179869184 bytes."),
    "dataloader": "RuntimeError: DataLoader worker (pid 48213) is killed by signal: Killed.",
    "import": "ModuleNotFoundError: No module named 'flash_attn'",
    "syntax": '  File "train.py", line 88\n    for i in range(10)\n                     ^\nSyntaxError: expected \':\'',
    "type": "TypeError: forward() got an unexpected keyword argument 'attention_mask'",
    "key": "KeyError: 'input_ids'",
    "file": "FileNotFoundError: [Errno 2] No such file or directory: '/data/shards/train-00017.bin'",
}
KINDS = tuple(FAILURE_MESSAGES) + ("nan", "hang", "kill")


class InjectedFailure(RuntimeError):
  """Raised in-process by the injector; its message is a realistic failure log line."""


def parse_inject(spec: str) -> dict[int, str]:
  """"17:nccl,40:nan" -> {17: "nccl", 40: "nan"}."""
  out = {}
  for part in filter(None, (p.strip() for p in (spec or "").split(","))):
    try:
      step, kind = part.split(":")
      step = int(step)
    except ValueError:
      raise ConfigError(f"inject entry {part!r} must look like STEP:KIND") from None
    if kind not in KINDS:
      raise ConfigError(f"inject kind {kind!r} must be one of {KINDS}")
    if step < 1:
      raise ConfigError(f"inject step {step} must be >= 1")
    out[step] = kind
  return out


class FailureInjector:
  """Fires each scheduled failure once (fired ones are remembered in ``state_dir`` if given)."""

  def __init__(self, schedule: dict[int, str] | str = "", state_dir: str | os.PathLike | None = None):
    self.schedule = parse_inject(schedule) if isinstance(schedule, str) else dict(schedule)
    for k in self.schedule.values():
      if k not in KINDS:
        raise ConfigError(f"inject kind {k!r} must be one of {KINDS}")
    self.state_dir = Path(state_dir) if state_dir else None
    self.fired: set[int] = set()
    if self.state_dir:
      self.state_dir.mkdir(parents=True, exist_ok=True)
      self.fired = {int(p.name.split("_")[1]) for p in self.state_dir.glob("fired_*")}

  @classmethod
  def random(cls, steps: int, n: int, kinds=("nccl", "cuda", "nan"), seed: int = 0, state_dir=None):
    """``n`` failures at distinct random steps in [2, steps - 1]."""
    import random
    rng = random.Random(seed)
    at = rng.sample(range(2, steps), n)
    return cls({s: rng.choice(kinds) for s in at}, state_dir)

  def due(self, step: int) -> str | None:
    kind = self.schedule.get(step)
    if kind is None or step in self.fired:
      return None
    self.fired.add(step)
    if self.state_dir:
      (self.state_dir / f"fired_{step}_{kind}").touch()
    return kind


@dataclasses.dataclass(frozen=True)
class DemoConfig:
  """The job's settings. ``optimizer`` (a ``jaxsys.core.optim.OptimizerConfig``): the MLP's
  optimizer; None: Adam at ``lr``, and given, ``lr`` stays at its default."""
  ckpt_dir: str
  steps: int = 40
  ckpt_every: int = 5
  seed: int = 0
  batch: int = 16
  dim: int = 8
  hidden: int = 32
  lr: float = 1e-2
  max_to_keep: int = 3
  step_sleep: float = 0.0
  optimizer: OptimizerConfig | None = None

  def __post_init__(self):
    check_positive(self, "steps", "ckpt_every", "batch", "dim", "hidden", "max_to_keep", "lr")
    check_nested(self, "lr")

  def optimizer_config(self) -> OptimizerConfig:
    """The MLP's optimizer: ``optimizer``, or Adam at ``lr``."""
    return self.optimizer or OptimizerConfig("adam", self.lr)


def _model(cfg: DemoConfig):
  # One compiled step per model shape and optimizer (a frozen, hashable OptimizerConfig):
  # restarts in the same process reuse it.
  return _model_cached(cfg.seed, cfg.batch, cfg.dim, cfg.hidden, cfg.optimizer_config())


@functools.lru_cache(maxsize=8)
def _model_cached(seed, batch_size, dim, hidden, optimizer: OptimizerConfig):
  cfg = argparse.Namespace(seed=seed, batch=batch_size, dim=dim, hidden=hidden)
  import jax
  import jax.numpy as jnp

  from jaxsys.train import apply_optax

  def init(key):
    k1, k2 = jax.random.split(key)
    return {"w1": jax.random.normal(k1, (cfg.dim, cfg.hidden)) / math.sqrt(cfg.dim),
            "b1": jnp.zeros((cfg.hidden,)),
            "w2": jax.random.normal(k2, (cfg.hidden, 1)) / math.sqrt(cfg.hidden)}

  def batch(step):
    # Data keyed by step: the same batch whatever attempt runs this step.
    k = jax.random.fold_in(jax.random.PRNGKey(cfg.seed + 1), step)
    kx, kn = jax.random.split(k)
    x = jax.random.normal(kx, (cfg.batch, cfg.dim))  # [batch, dim]
    teacher = jax.random.normal(jax.random.PRNGKey(cfg.seed + 2), (cfg.dim, 1))
    y = jnp.sin(x @ teacher) + 0.01 * jax.random.normal(kn, (cfg.batch, 1))  # [batch, 1]
    return x, y

  def loss_fn(p, x, y):
    h = jax.nn.gelu(x @ p["w1"] + p["b1"])  # [batch, hidden]
    return jnp.mean((h @ p["w2"] - y) ** 2)

  opt = optimizer.build()

  @jax.jit
  def step_fn(p, o, step, poison):
    x, y = batch(step)
    x = x * poison  # poison = NaN injects a NaN loss; 1.0 otherwise
    loss, g = jax.value_and_grad(loss_fn)(p, x, y)
    p, o = apply_optax(opt, g, o, p)
    return p, o, loss

  return init, opt, step_fn


def train(cfg: DemoConfig, heartbeat=None, injector: FailureInjector | None = None,
          log=print) -> dict:
  """Trains ``cfg.steps`` steps, resuming from the latest checkpoint in ``cfg.ckpt_dir``.

  ``heartbeat(step, loss, restored)`` is called after every step. Returns
  {"params", "step", "restored", "losses"}.
  """
  import jax
  import jax.numpy as jnp
  import numpy as np

  from jaxsys.core.checkpoint import Checkpointer

  init, opt, step_fn = _model(cfg)
  params = init(jax.random.PRNGKey(cfg.seed))
  state = {"params": params, "opt_state": opt.init(params), "step": jnp.asarray(0, jnp.int32)}
  ckpt = Checkpointer(os.path.abspath(cfg.ckpt_dir), max_to_keep=cfg.max_to_keep)
  restored = 0
  try:
    # Newer steps that are not intact (corrupted, or their save never completed) are logged
    # and skipped; with none intact the run starts over.
    latest = ckpt.latest_intact_step()
    if latest is not None:
      state = ckpt.restore(latest, like=state)
      restored = int(state["step"])
      log(f"restored checkpoint at step {restored}")
    p, o = state["params"], state["opt_state"]
    losses = {}
    for step in range(restored + 1, cfg.steps + 1):
      kind = injector.due(step) if injector else None
      if kind in FAILURE_MESSAGES:
        raise InjectedFailure(FAILURE_MESSAGES[kind])
      if kind == "kill":
        os._exit(137)
      if kind == "hang":
        time.sleep(3600)
      poison = jnp.float32(float("nan") if kind == "nan" else 1.0)
      p, o, loss = step_fn(p, o, jnp.int32(step - 1), poison)
      loss = float(loss)
      losses[step] = loss
      if cfg.step_sleep:
        time.sleep(cfg.step_sleep)
      if heartbeat is not None:
        heartbeat(step, loss, restored)
      # Checkpoint holds the state *after* `step` updates (params, full optimizer state, step).
      if step % cfg.ckpt_every == 0:
        ckpt.save(step, {"params": p, "opt_state": o, "step": jnp.asarray(step, jnp.int32)},
                  wait=False)
    ckpt.wait_until_finished()
    return {"params": jax.tree.map(np.asarray, p), "step": cfg.steps, "restored": restored,
            "losses": losses}
  finally:
    ckpt.close()  # waits for a pending save and writes its manifest


class FileHeartbeat:
  """Writes the heartbeat JSON atomically (tmp file + rename) so readers never see half a file."""

  def __init__(self, path: str | os.PathLike):
    self.path = Path(path)
    self.first_bad = None  # first step with a non-finite loss (a reader may miss that beat)

  def __call__(self, step: int, loss: float, restored: int):
    if not math.isfinite(loss) and self.first_bad is None:
      self.first_bad = step
    tmp = self.path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"step": step, "loss": loss if math.isfinite(loss) else str(loss),
                               "restored": restored, "time": time.time(), "pid": os.getpid(),
                               "first_bad": self.first_bad}))
    os.replace(tmp, self.path)


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(prog="python -m jaxsys.cluster.demo_job")
  ap.add_argument("--ckpt-dir", default=os.environ.get("JAXSYS_CKPT_DIR"))
  ap.add_argument("--heartbeat", default=os.environ.get("JAXSYS_HEARTBEAT"))
  ap.add_argument("--steps", type=int, default=40)
  ap.add_argument("--ckpt-every", type=int, default=5)
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--step-sleep", type=float, default=0.0)
  ap.add_argument("--inject", default="", help="STEP:KIND,... e.g. 17:nccl,40:nan")
  ap.add_argument("--inject-state", default=None, help="folder remembering fired injections")
  ap.add_argument("--out", default=None, help="write final params here (.npz)")
  args = ap.parse_args(argv)
  if not args.ckpt_dir:
    ap.error("--ckpt-dir (or JAXSYS_CKPT_DIR) is required")
  cfg = DemoConfig(ckpt_dir=args.ckpt_dir, steps=args.steps, ckpt_every=args.ckpt_every,
                   seed=args.seed, step_sleep=args.step_sleep)
  injector = FailureInjector(args.inject, args.inject_state or os.path.join(args.ckpt_dir, "..", "inject_state"))
  hb = FileHeartbeat(args.heartbeat) if args.heartbeat else None
  try:
    out = train(cfg, heartbeat=hb, injector=injector, log=lambda m: print(m, flush=True))
  except InjectedFailure as e:
    print("Traceback (most recent call last):\n  File \"train.py\", line 212, in <module>", file=sys.stderr)
    print(str(e), file=sys.stderr, flush=True)
    return 1
  if args.out:
    import numpy as np
    np.savez(args.out, **out["params"])
  print(f"finished {out['step']} steps (resumed from {out['restored']})", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
