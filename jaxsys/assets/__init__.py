"""Files shipped inside the package, and the loader of the named ones that runs produce.

Data assets (``planetoid/``, ``tiny_lm/``, ``traces/``) are read by the layer that uses them. Named
run products live in one folder per kind, one file per name, each with the settings that made it:

* ``gates/<name>.json``: DuoAttention streaming-head gates, the JSON of
  ``jaxsys.serving.streaming.StreamingGates`` (which ignores the extra ``settings`` key), so the
  LServe path reads an asset by name as
  ``StreamingGates.load(jaxsys.assets.path("gates", name))`` (``jaxsys serve --lserve --gates
  <that path>`` too);
* ``drafters/<name>.npz``: an EAGLE drafter's state, one array per state path, and its settings.

``path(kind, name)`` finds one, ``names(kind)`` lists them, ``settings(kind, name)`` reads what
made it; ``write_json`` / ``write_arrays`` write new ones (into a folder given as ``root``, the
package's own folder by default) and ``read_arrays`` reads an ``.npz`` back. This module imports no
other part of jaxsys, so every layer may use it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

__all__ = ["KINDS", "ROOT", "names", "path", "read_arrays", "settings", "write_arrays", "write_json"]

ROOT = Path(__file__).resolve().parent
KINDS = {"gates": ".json", "drafters": ".npz"}   # kind -> file suffix
_META = "__settings__"                           # the settings' key inside an .npz


def _check(kind: str, name: str | None = None) -> None:
  if kind not in KINDS:
    raise ValueError(f"asset kind={kind!r} must be one of {sorted(KINDS)}")
  if name is not None and (not name or "/" in name or name.startswith(".")):
    raise ValueError(f"asset name={name!r} must be a plain file stem (no '/', not starting with '.')")


def names(kind: str, root: os.PathLike | None = None) -> list[str]:
  """The names of the ``kind`` assets under ``root`` (default: the package's)."""
  _check(kind)
  folder = Path(root or ROOT) / kind
  return sorted(p.name[:-len(KINDS[kind])] for p in folder.glob(f"*{KINDS[kind]}")) if folder.is_dir() else []


def path(kind: str, name: str, root: os.PathLike | None = None) -> Path:
  """The file of asset ``name`` of ``kind``; ``FileNotFoundError`` naming the ones there are."""
  _check(kind, name)
  p = Path(root or ROOT) / kind / f"{name}{KINDS[kind]}"
  if not p.is_file():
    raise FileNotFoundError(f"no {kind} asset {name!r} in {p.parent}; known: {names(kind, root)}")
  return p


def settings(kind: str, name: str, root: os.PathLike | None = None) -> dict:
  """The settings recorded with an asset (model, lengths, steps, device, ...)."""
  p = path(kind, name, root)
  if KINDS[kind] == ".json":
    return dict(json.loads(p.read_text()).get("settings", {}))
  return read_arrays(kind, name, root)[1]


def write_json(kind: str, name: str, data: dict, settings: dict, root: os.PathLike | None = None) -> Path:
  """Writes ``data`` plus ``{"settings": settings}`` as asset ``name`` (atomically)."""
  _check(kind, name)
  if KINDS[kind] != ".json":
    raise ValueError(f"asset kind={kind!r} is stored as {KINDS[kind]}, not JSON")
  if "settings" in data:
    raise ValueError("data must not hold a 'settings' key: pass the settings separately")
  return _atomic(kind, name, root, lambda f: f.write(json.dumps({**data, "settings": settings}).encode()))


def write_arrays(kind: str, name: str, arrays: dict, settings: dict, root: os.PathLike | None = None) -> Path:
  """Writes ``arrays`` (name -> numpy array) and the settings as asset ``name`` (.npz, atomically)."""
  import numpy as np
  _check(kind, name)
  if KINDS[kind] != ".npz":
    raise ValueError(f"asset kind={kind!r} is stored as {KINDS[kind]}, not .npz")
  if _META in arrays:
    raise ValueError(f"arrays must not hold the key {_META!r}")
  meta = np.frombuffer(json.dumps(settings).encode(), np.uint8)
  return _atomic(kind, name, root, lambda f: np.savez(f, **arrays, **{_META: meta}))


def read_arrays(kind: str, name: str, root: os.PathLike | None = None) -> tuple[dict, dict]:
  """``(arrays, settings)`` of an ``.npz`` asset."""
  import numpy as np
  with np.load(path(kind, name, root)) as z:
    arrays = {k: z[k] for k in z.files if k != _META}
    meta = json.loads(z[_META].tobytes().decode()) if _META in z.files else {}
  return arrays, meta


def _atomic(kind, name, root, write) -> Path:
  folder = Path(root or ROOT) / kind
  folder.mkdir(parents=True, exist_ok=True)
  dest = folder / f"{name}{KINDS[kind]}"
  tmp = folder / f".{dest.name}.tmp-{os.getpid()}"
  with open(tmp, "wb") as f:
    write(f)
  os.replace(tmp, dest)
  return dest
