"""Carry a named model to the accelerator machine in parts, and put it back together there.

The device machine has no network, and one call takes at most 64 MiB of files (the checkout, ~6 MB,
included). The SmolLM2 GGUF is 98 MB, so it travels in two parts, one per call; each call stashes
the parts it brought outside the checkout, and the call that completes the set joins them, checks
the sha256 of every part and of the whole file (the manifest's, and the one ``jaxsys.models.
pretrained`` pins) and installs the file where ``jaxsys.models.llm.interop.pretrained.find`` looks for it
(``$JAXSYS_HOME/models/<name>/``), so ``load_pretrained(name)`` works there without network.

Here (once; ``.carry/`` ignores itself)::

  python -m experiments.carry split                   # .carry/<name>.part00, .part01, manifest, wheels
  python -m experiments.carry split --check           # the same checks install runs, on this host

On the device, two calls, back to back (the machine stays warm ~30 s after a call; the parts
stashed by the first live until it is given back), each carrying its part::

  python -m experiments.carry install --partial-ok    # call 1: stashes part00
  python -m experiments.carry install && ...          # call 2: stashes part01, joins, installs

``install`` also installs the wheels under ``.carry/wheels`` when their package is missing (the
device image has no ``gguf``, which ``jaxsys.models.llm.interop.gguf`` imports). experiments/README.md has the
exact ``run`` calls. Exit status: 0 installed (or parts stashed with ``--partial-ok``), 3 parts
missing, 2 a bad part or file (the message names it).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from jaxsys.core.errors import ConfigError, InputError

__all__ = ["DEFAULT_DIR", "MissingParts", "join_parts", "install", "sha256", "split_file", "stash_dir",
           "main"]

DEFAULT_DIR = ".carry"
DEFAULT_MODEL = "smollm2-135m-instruct"
MAX_MIB = 50          # per part: the checkout (~6 MB) and a part stay under a call's 64 MiB
WHEELS = ("gguf",)    # what the device image lacks for loading a GGUF (pure-Python wheels)


class MissingParts(InputError):
  """Some parts of a split file are not here yet (the other call brings them)."""


def sha256(path: os.PathLike) -> str:
  h = hashlib.sha256()
  with open(path, "rb") as f:
    for chunk in iter(lambda: f.read(1 << 20), b""):
      h.update(chunk)
  return h.hexdigest()


def manifest_path(directory: os.PathLike, name: str) -> Path:
  return Path(directory) / f"{name}.manifest.json"


def split_file(path: os.PathLike, directory: os.PathLike, name: str, *, max_bytes: int) -> dict:
  """Splits ``path`` into ``<directory>/<name>.partNN`` of at most ``max_bytes`` each (equal sizes,
  the last one shorter) and writes ``<name>.manifest.json``: the file's name, size and sha256, and
  each part's. Returns the manifest."""
  path, directory = Path(path), Path(directory)
  if max_bytes < 1:
    raise ConfigError(f"max_bytes={max_bytes} must be >= 1")
  if not path.is_file():
    raise InputError(f"{path} is not a file")
  size = path.stat().st_size
  n = max(1, -(-size // max_bytes))
  each = -(-size // n)
  directory.mkdir(parents=True, exist_ok=True)
  for old in directory.glob(f"{name}.part*"):
    old.unlink()
  parts = []
  with open(path, "rb") as f:
    for i in range(n):
      part = directory / f"{name}.part{i:02d}"
      part.write_bytes(f.read(each))
      parts.append({"file": part.name, "bytes": part.stat().st_size, "sha256": sha256(part)})
  manifest = {"name": name, "filename": path.name, "bytes": size, "sha256": sha256(path), "parts": parts}
  manifest_path(directory, name).write_text(json.dumps(manifest, indent=1))
  return manifest


def read_manifest(directory: os.PathLike, name: str) -> dict:
  p = manifest_path(directory, name)
  if not p.is_file():
    raise InputError(f"manifest {p} does not exist: run `python -m experiments.carry split` here and "
                     f"carry it with the parts")
  return json.loads(p.read_text())


def _find_part(part: dict, dirs) -> Path | None:
  """The first copy of ``part`` in ``dirs`` (checked: a copy of the wrong size or sha256 raises)."""
  for d in dirs:
    p = Path(d) / part["file"]
    if p.is_file():
      got = sha256(p)
      if p.stat().st_size != part["bytes"] or got != part["sha256"]:
        raise InputError(f"part {p}: sha256 {got} ({p.stat().st_size} bytes) does not match the "
                         f"manifest's {part['sha256']} ({part['bytes']} bytes); split again and re-carry it")
      return p
  return None


def join_parts(manifest: dict, dirs, dest: os.PathLike) -> Path:
  """Joins the manifest's parts, each looked up in ``dirs`` in order, into ``dest`` (atomically),
  after checking every part's sha256; the joined file's sha256 is checked before it replaces
  ``dest``. Raises ``MissingParts`` (naming them) when some are in none of ``dirs``, ``InputError``
  on any checksum mismatch."""
  found = {p["file"]: _find_part(p, dirs) for p in manifest["parts"]}
  missing = [f for f, p in found.items() if p is None]
  if missing:
    raise MissingParts(f"parts {missing} of {manifest['filename']} are in none of "
                       f"{[str(d) for d in dirs]}")
  dest = Path(dest)
  dest.parent.mkdir(parents=True, exist_ok=True)
  tmp = dest.with_name(f".{dest.name}.join-{os.getpid()}")
  with open(tmp, "wb") as out:
    for p in manifest["parts"]:
      with open(found[p["file"]], "rb") as f:
        shutil.copyfileobj(f, out, 1 << 20)
  got = sha256(tmp)
  if got != manifest["sha256"]:
    tmp.unlink()
    raise InputError(f"joined {manifest['filename']}: sha256 {got} does not match the manifest's "
                     f"{manifest['sha256']}")
  os.replace(tmp, dest)
  return dest


def stash_dir(name: str) -> Path:
  """Where ``install`` keeps the parts between calls: outside the checkout, in ``$JAXSYS_HOME``."""
  from jaxsys.models.llm.interop.pretrained import cache_dir
  return cache_dir() / "carry" / name


def _stash(manifest: dict, directory: Path, name: str) -> list[str]:
  """Copies the (checked) parts present in ``directory`` into the stash; returns their names."""
  stash = stash_dir(name)
  stash.mkdir(parents=True, exist_ok=True)
  done = []
  for part in manifest["parts"]:
    p = _find_part(part, [directory])
    if p is not None and _find_part(part, [stash]) is None:
      shutil.copyfile(p, stash / part["file"])
    if p is not None:
      done.append(part["file"])
  return done


def install(name: str = DEFAULT_MODEL, directory: os.PathLike = DEFAULT_DIR) -> Path:
  """Stashes the parts in ``directory``; with the set complete, joins and installs the model where
  ``jaxsys.models.llm.interop.pretrained`` finds it and returns its path (``MissingParts`` otherwise). The
  file's sha256 must be the manifest's and the one ``pretrained.MODELS`` pins for ``name``."""
  from jaxsys.models.llm.interop import pretrained
  spec = pretrained.MODELS.get(name)
  if spec is None:
    raise ConfigError(f"model {name=} is not known; known models: {sorted(pretrained.MODELS)}")
  found = pretrained.find(name)
  if found is not None:
    return found
  manifest = read_manifest(directory, name)
  if spec.sha256 and manifest["sha256"] != spec.sha256:
    raise InputError(f"manifest sha256 {manifest['sha256']} is not the pinned sha256 {spec.sha256} "
                     f"of {name}: split the file `jaxsys fetch {name}` installs")
  _stash(manifest, Path(directory), name)
  dest = pretrained.cache_dir() / "models" / name / spec.filename
  join_parts(manifest, [stash_dir(name)], dest)
  if pretrained.find(name) != dest:
    raise InputError(f"installed {dest}, but jaxsys.models.llm.interop.pretrained.find({name!r}) returns "
                     f"{pretrained.find(name)}")
  return dest


def _install_wheels(directory: Path) -> None:
  """pip-installs (no index, no dependencies) the carried wheels whose package is missing."""
  wheels = sorted((directory / "wheels").glob("*.whl"))
  need = [w for w in wheels if importlib.util.find_spec(w.name.split("-")[0]) is None]
  if need:
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                    "--disable-pip-version-check", *map(str, need)], check=True)
    print(f"[carry] installed {[w.name for w in need]}", flush=True)


def _download_wheels(directory: Path) -> None:
  """The installed versions of ``WHEELS`` as wheels under ``directory/wheels`` (pip download)."""
  out = directory / "wheels"
  out.mkdir(parents=True, exist_ok=True)
  for pkg in WHEELS:
    pin = f"{pkg}=={importlib.metadata.version(pkg)}"
    if not any(out.glob(f"{pkg}-{pin.split('==')[1]}-*.whl")):
      subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                      "--disable-pip-version-check", "-d", str(out), pin], check=True)


def run_calls(manifest: dict, directory: str) -> list[str]:
  """The carry list of each device call, one per part (README: the exact ``run`` calls)."""
  m = str(manifest_path(directory, manifest["name"]))
  return [json.dumps([m, f"{directory}/{p['file']}", f"{directory}/wheels"]) for p in manifest["parts"]]


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="python -m experiments.carry", description=__doc__.splitlines()[0])
  p.add_argument("command", choices=("split", "install"))
  p.add_argument("--model", default=DEFAULT_MODEL, help=f"a jaxsys.models.llm.interop.pretrained name ({DEFAULT_MODEL})")
  p.add_argument("--dir", default=DEFAULT_DIR, help="where the parts and manifest live (default .carry)")
  p.add_argument("--max-mib", type=float, default=MAX_MIB, help="largest part, MiB (default 50)")
  p.add_argument("--partial-ok", action="store_true", help="install: exit 0 when parts are still missing")
  p.add_argument("--check", action="store_true", help="split: re-join the parts into a temporary file")
  p.add_argument("--no-wheels", action="store_true", help="split: do not download the wheels")
  a = p.parse_args(argv)
  directory = Path(a.dir)
  try:
    if a.command == "split":
      from jaxsys.models.llm.interop.pretrained import model_path
      directory.mkdir(parents=True, exist_ok=True)
      (directory / ".gitignore").write_text("*\n")  # the folder ignores itself: carried, never committed
      m = split_file(model_path(a.model), directory, a.model, max_bytes=int(a.max_mib * 2**20))
      if not a.no_wheels:
        _download_wheels(directory)
      if a.check:
        tmp = directory / f".{a.model}.check"
        join_parts(m, [directory], tmp)
        tmp.unlink()
      print(f"[carry] {m['filename']}: {len(m['parts'])} parts of <= {a.max_mib} MiB in {directory}; "
            f"carry lists, one call each:\n  " + "\n  ".join(run_calls(m, a.dir)))
      return 0
    _install_wheels(directory)
    path = install(a.model, directory)
    print(f"[carry] {a.model} installed at {path}", flush=True)
    return 0
  except MissingParts as e:
    print(f"[carry] {e}; stashed in {stash_dir(a.model)} so far: "
          f"{sorted(x.name for x in stash_dir(a.model).glob('*'))}", flush=True)
    return 0 if a.partial_ok else 3
  except (ConfigError, InputError) as e:
    print(f"python -m experiments.carry: error: {e}", file=sys.stderr)
    return 2


if __name__ == "__main__":
  sys.exit(main())
