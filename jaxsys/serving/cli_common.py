"""What ``jaxsys generate``, ``jaxsys chat`` and ``jaxsys serve`` share: one ``--model``, one set of
sampling flags, one model loader and one check for a missing extra.

``--model``: a registered name (``smollm2-135m-instruct``; ``jaxsys fetch`` it first), a ``.gguf``
file, a Hugging Face checkpoint folder (its ``tokenizer.json`` / ``tokenizer_config.json`` give the
tokenizer and chat template when present), or ``tiny`` / ``random`` (small test models, no tokenizer).
``--dtype``: float32 (default), bfloat16 or float16 parameters and activations.

Sampling flags (:func:`add_sampling_args`): ``--temperature`` (0: greedy), ``--top-p``, ``--top-k``
(0: off), ``--min-p``, ``--seed``, ``--stop`` (repeatable stop string), ``--max-tokens``, ``--system``
(a system message put before the chat). ``--max-tokens`` default: the context the prompt leaves; EOS
ends a reply earlier. ``generate`` and ``chat`` cap that default at :data:`CLI_MAX_TOKENS` (their
cache is sized by it); ``serve`` caps it only where ``--max-tokens`` is given.

Registering the flags imports nothing heavy; :func:`load_model` imports JAX when it runs.
"""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

from jaxsys.core.errors import InputError
from jaxsys.models.llm.interop.pretrained import DEFAULT_MODEL

__all__ = ["CLI_MAX_TOKENS", "DTYPES", "SERVE_MODULES", "add_model_args", "add_sampling_args", "load_model",
           "missing_extra", "sampling_params", "with_system"]

DTYPES = ("float32", "bfloat16", "float16")
#: ``generate`` / ``chat``: the most tokens a reply gets when ``--max-tokens`` is not given.
CLI_MAX_TOKENS = 512
#: What HTTP serving imports, all in the ``serve`` extra.
SERVE_MODULES = ("fastapi", "uvicorn", "prometheus_client", "llguidance")
_PLAIN = ("tiny", "random")


def missing_extra(command: str, modules, extra: str) -> str | None:
  """One line naming the extra to install when one of ``modules`` is not installed (else None).
  Looked up with ``find_spec``: nothing is imported, so the check runs before any model loads."""
  missing = [m for m in modules if importlib.util.find_spec(m) is None]
  if not missing:
    return None
  return (f"{command} needs {', '.join(missing)} (not installed): pip install 'jaxsys[{extra}]'")


def _positive_int(text: str) -> int:
  try:
    value = int(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
  if value < 1:
    raise argparse.ArgumentTypeError(f"{value} must be >= 1")
  return value


def add_model_args(p: argparse.ArgumentParser, default: str | None) -> None:
  p.add_argument("--model", "-m", default=default,
                 help="registered name (smollm2-135m-instruct), a .gguf file, a Hugging Face checkpoint "
                      f"folder, or tiny / random (default: {default or DEFAULT_MODEL})")
  p.add_argument("--dtype", default="float32", choices=DTYPES, help="parameters and activations")


def add_sampling_args(p: argparse.ArgumentParser, max_tokens_help: str) -> None:
  p.add_argument("--temperature", type=float, default=None, help="0: greedy (default)")
  p.add_argument("--top-p", type=float, default=None, help="nucleus sampling mass (default 1: off)")
  p.add_argument("--top-k", type=int, default=None, help="keep the k most likely tokens (default 0: off)")
  p.add_argument("--min-p", type=float, default=None,
                 help="drop tokens below min-p x the top probability (default 0: off)")
  p.add_argument("--seed", type=int, default=None, help="sampling seed (default 0)")
  p.add_argument("--stop", action="append", default=None, metavar="TEXT",
                 help="end a reply at this string (repeatable)")
  p.add_argument("--max-tokens", "--max-new-tokens", dest="max_tokens", type=_positive_int, default=None,
                 help=max_tokens_help)
  p.add_argument("--system", default=None, help="a system message put before the chat")


def sampling_params(args, turn: int = 0):
  """The :class:`~jaxsys.decoding.sampling.SamplingParams` of the flags; ``turn`` advances the seed
  (a chat's turn ``t`` samples with ``seed + t``, so two turns do not open alike)."""
  from jaxsys.decoding.sampling import SamplingParams  # noqa: PLC0415  (JAX, when a command runs)
  return SamplingParams(0.0 if args.temperature is None else args.temperature,
                        top_p=1.0 if args.top_p is None else args.top_p,
                        top_k=0 if args.top_k is None else args.top_k,
                        min_p=0.0 if args.min_p is None else args.min_p,
                        seed=(0 if args.seed is None else args.seed) + turn)


def with_system(messages: list[dict], system: str | None) -> list[dict]:
  """``messages`` with ``system`` as the first message, unless there is none or the chat has one."""
  if system is None or (messages and messages[0].get("role") == "system"):
    return messages
  return [{"role": "system", "content": system}, *messages]


def load_model(name: str, dtype: str | None = None):
  """``(model, tokenizer or None)`` for a ``--model`` value (module docstring); ``InputError``
  naming ``--model`` when it is none of the accepted kinds."""
  import jax.numpy as jnp  # noqa: PLC0415
  dt = jnp.dtype(dtype or "float32")
  from jaxsys.models.llm.interop.pretrained import MODELS  # noqa: PLC0415
  if name in MODELS:
    from jaxsys.models import load_pretrained  # noqa: PLC0415
    return load_pretrained(name, dtype=dt)
  if name.endswith(".gguf"):
    from jaxsys.models.llm.interop.gguf import from_gguf, load_tokenizer  # noqa: PLC0415
    if not Path(name).is_file():
      raise InputError(f"--model {name}: no such .gguf file")
    return from_gguf(name, dt), load_tokenizer(name)
  if name == "tiny":
    from jaxsys.models import load_tiny_lm  # noqa: PLC0415
    return load_tiny_lm(), None
  if name == "random":
    from jaxsys.models.llm._decoder_config import DecoderConfig  # noqa: PLC0415
    from jaxsys.models.llm.decoder import random_model  # noqa: PLC0415
    return random_model(DecoderConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                                      num_heads=4, num_kv_heads=2), seed=0), None
  folder = Path(name)
  if not (folder / "config.json").is_file():
    raise InputError(f"--model {name!r} is not a registered model ({sorted(MODELS)}), a .gguf file, a "
                     f"Hugging Face checkpoint folder (with config.json) or one of {list(_PLAIN)}")
  from jaxsys.models import from_pretrained  # noqa: PLC0415
  from jaxsys.models.llm.interop.tokenizer import Tokenizer  # noqa: PLC0415
  tokenizer = Tokenizer.from_folder(folder) if (folder / "tokenizer.json").is_file() else None
  return from_pretrained(folder, dt), tokenizer
