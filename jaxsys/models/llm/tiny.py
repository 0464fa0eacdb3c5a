"""The tiny trained reference LM shipped in ``jaxsys/assets/tiny_lm`` and its scoring helper.

A small Llama-style decoder trained on CPU on the synthetic tasks of
``jaxsys.data.synthetic`` (copy, multi-query associative recall in a haystack, multi-key
passkey, small arithmetic); it is the real language model that serving, speculative decoding
and RL experiments run on. Reproduce it with the command in ``experiments/train_tiny_lm.py``.

Usage::

  model = jaxsys.models.load_tiny_lm()                 # Decoder (float32)
  acc = exact_match(model, synthetic.examples("recall", seed=1, count=64, length=256))
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxsys.core.errors import InputError

__all__ = ["exact_match", "load_tiny_lm", "TINY_LM_PATH"]

TINY_LM_PATH = Path(__file__).resolve().parents[2] / "assets" / "tiny_lm"


def load_tiny_lm(path: str | Path | None = None, dtype=None, **config_changes):
  """Loads the shipped tiny LM (``config_changes`` e.g. ``rope=RopeConfig(...)`` for scaling)."""
  from jaxsys.models.llm.interop.hf import from_pretrained
  path = Path(path or TINY_LM_PATH)
  if not (path / "config.json").exists():
    raise InputError(f"the tiny LM checkpoint is missing at {path}; train it with "
                     "`python -m experiments.train_tiny_lm` (see its docstring for the exact command)")
  return from_pretrained(path, dtype=dtype, **config_changes)


@nnx.jit
def _answer_hits(model, tokens, answer_mask):
  logits = model(tokens[:, :-1])
  pred = jnp.argmax(logits, -1)
  ok = (pred == tokens[:, 1:]) | (answer_mask[:, 1:] == 0)
  return jnp.all(ok, axis=-1)


def exact_match(model, examples: Sequence, *, batch_size: int = 32) -> float:
  """Fraction of examples whose whole answer is the greedy continuation of the prompt.

  Teacher forcing on ``prompt + answer``: greedy decoding reproduces the answer iff every
  answer token is the argmax given the correct prefix, so this equals greedy exact match
  (one forward pass per batch instead of a decode loop). Only the final answer counts (the
  earlier in-prompt answers of multi-query recall are context).
  """
  if not examples:
    raise InputError("examples must be non-empty")
  length = max(len(e.tokens) for e in examples)
  hits = []
  for i in range(0, len(examples), batch_size):
    chunk = list(examples[i:i + batch_size])
    n = len(chunk)
    chunk += [chunk[-1]] * (batch_size - n) if len(examples) > batch_size else []
    toks = np.zeros((len(chunk), length), np.int32)
    mask = np.zeros((len(chunk), length), np.int32)
    for j, e in enumerate(chunk):
      toks[j, :len(e.tokens)] = e.tokens
      mask[j, len(e.prompt):len(e.tokens)] = 1
    hits.append(np.asarray(jax.device_get(_answer_hits(model, jnp.asarray(toks), jnp.asarray(mask))))[:n])
  return float(np.concatenate(hits).mean())
