"""Fault injection for ``save_pretrained``: saves a tiny model, SIGKILLed at a chosen moment.

Run as ``python _save_kill_worker.py DIR``. It imports jaxsys once but runs no JAX computation,
so it can fork safely; then for each line ``k`` on stdin it forks a child that builds the model
(weights from :func:`weights` with ``NEW_SEED``) and saves it to DIR unsharded, with a profiler
that SIGKILLs the child just before its ``k``-th I/O moment (``k < 0``: never). A moment is a
call of a C function of ``os`` / ``io`` or of a file object (open, write, fsync, link, rename,
unlink, scandir, ...), so the kills land between the individual system calls of a save. One
line comes back per command: ``killed``, or ``done N`` with N the number of moments of the
whole save.

The test (``test_weights_safety.py``) imports this module for :data:`CONFIG` and
:func:`weights`; nothing heavy runs at import.
"""

from __future__ import annotations

import io
import os
import signal
import sys
import traceback

import numpy as np

from jaxsys.models.llm._decoder_config import DecoderConfig

CONFIG = DecoderConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_layers=2,
                       num_heads=2, num_kv_heads=1, head_dim=8)
NEW_SEED = 2
_IO_MODULES = ("posix", "nt", "io", "_io")


def weights(config: DecoderConfig, seed: int) -> dict[str, np.ndarray]:
  """Random HF-named f32 weights for ``config`` (numpy only)."""
  from jaxsys.models.llm.interop.hf import _weight_map  # noqa: PLC0415
  rng = np.random.default_rng(seed)
  return {name: rng.standard_normal(shape).astype(np.float32)
          for name, (_, shape, _, _) in _weight_map(config).items()}


def is_moment(event: str, arg) -> bool:
  return event == "c_call" and (getattr(arg, "__module__", None) in _IO_MODULES or
                                isinstance(getattr(arg, "__self__", None), io.IOBase))


def _child(path: str, k: int):
  import jaxsys.models.llm.interop.hf as hf  # noqa: PLC0415
  model = hf.load_state_dict(CONFIG, weights(CONFIG, NEW_SEED))
  count = 0

  def profile(frame, event, arg):
    nonlocal count
    if is_moment(event, arg):
      if count == k:
        os.kill(os.getpid(), signal.SIGKILL)
      count += 1

  sys.setprofile(profile)
  hf.save_pretrained(model, path)
  sys.setprofile(None)
  print(f"done {count}", flush=True)


def main():
  path = sys.argv[1]
  import jaxsys.models.llm.interop.hf  # noqa: F401, PLC0415  (imported once, before the forks)
  for line in sys.stdin:
    pid = os.fork()
    if pid == 0:
      code = 1
      try:
        _child(path, int(line))
        code = 0
      except BaseException:  # noqa: BLE001  (report, then leave without running atexit hooks)
        traceback.print_exc()
      finally:
        sys.stdout.flush()
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL:
      print("killed", flush=True)
    elif status != 0:
      print(f"failed {status}", flush=True)


if __name__ == "__main__":
  main()
