"""Verified orbax checkpoints of arbitrary pytrees (params, optimizer state, step, data cursor).

``Checkpointer(directory)`` wraps ``orbax.checkpoint.CheckpointManager``: ``save(step, tree)``,
``restore(step=None, like=tree)``, ``verify(step)``, ``intact_steps()``. Restoring against
``like`` (an example tree or ``jax.ShapeDtypeStruct`` tree with shardings) gives back the same
structure, dtypes and placement, so a resumed run continues bit for bit.

Guarantees (the policy follows orbax and torchrun: a checkpoint exists only once it is complete,
and a run resumes from the newest complete one):

* **Atomic saves.** Orbax writes a step into a temporary folder and renames it when every file
  is written. After that, this class hashes every file of the step (sha256, with its size) and
  writes ``<step>/MANIFEST.json`` through a temporary file + ``os.replace``. A step is *intact*
  only when its manifest exists and every file it lists has that size and hash. A process killed
  at any moment leaves either an intact step or one that is reported and ignored ("no manifest",
  "empty folder", "truncated <file>", "hash mismatch in <file>", "missing <file>").
* **Verified restores.** ``restore()`` restores the newest intact step, logging a warning on the
  ``"jaxsys"`` logger that names every newer step it skipped and why; ``restore(step)`` of a step
  that is not intact raises :class:`InputError` with the reason. The manifest also records the
  shape and dtype of every leaf, and a ``like`` of another structure, shape or dtype is an
  ``InputError`` naming the leaf (never a silent reinterpretation).
* **No silent rewinds.** Saving a step lower than (or equal to) an intact existing one is an
  ``InputError`` naming both steps, unless ``overwrite=True``, which first deletes the intact
  steps at or above it. Non-intact folders at or above the step (leftovers of an interrupted
  save, a corrupted newer step) are deleted with a warning, since nothing can restore them.
* **Rotation keeps good checkpoints.** With ``max_to_keep=k`` the newest ``k`` steps that *verify*
  are kept (the step just written, whose files were hashed as it was written, is always one of
  them) and older step folders are deleted; a step corrupted after it was written does not count,
  so ``k`` intact steps survive (rotation re-hashes up to ``k`` steps). Corruption caught at
  restore falls back to the older kept steps.

``all_steps()`` / ``latest_step()`` list every step folder, intact or not; ``intact_steps()`` /
``latest_intact_step()`` only the verified ones.

Not covered: hashing reads every file back once per save and once per verify (I/O-bound, about
a second per GB); data files are not fsync'ed, so after a power loss a torn step fails its hash
and is skipped rather than repaired; one writer per directory is assumed; manifests are written
by process 0, for a directory all processes share.

Usage::

  ckpt = Checkpointer("/tmp/run/ckpt", max_to_keep=2)
  ckpt.save(100, {"params": params, "opt_state": opt_state}, metadata={"lr": 1e-3})
  state = ckpt.restore(like={"params": params, "opt_state": opt_state})
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from jaxsys.core.errors import InputError

__all__ = ["Checkpointer", "MANIFEST", "tree_signature", "write_atomic"]

log = logging.getLogger("jaxsys")

MANIFEST = "MANIFEST.json"
_FORMAT = 1


def write_atomic(path: str | os.PathLike, text: str) -> None:
  """Replaces ``path`` with ``text`` so that a reader (or a crash) sees the old or the new file,
  never half of one: write a temporary file beside it, fsync, ``os.replace``."""
  path = Path(path)
  tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
  with open(tmp, "w") as f:
    f.write(text)
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, path)


def _abstract(tree):
  def one(x):
    if isinstance(x, jax.ShapeDtypeStruct):
      return x
    if hasattr(x, "shape") and hasattr(x, "dtype"):
      return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))
    return x
  return jax.tree.map(one, tree)


def _key_name(k) -> str:
  for attr in ("key", "idx", "name"):
    if hasattr(k, attr):
      return str(getattr(k, attr))
  return str(k)


def _named_leaves(tree) -> list[tuple[str, Any]]:
  """``[("params/layers/0/w", leaf), ...]`` in ``tree``'s flattening order."""
  return [("/".join(_key_name(k) for k in path), x) for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]]


def tree_signature(tree) -> dict[str, list]:
  """``{"params/layers/0/w": [[32, 64], "float32"], "step": ["int"], ...}``: the structure,
  shapes and dtypes a checkpoint holds (arrays by shape and dtype, other leaves by type)."""
  out = {}
  for name, x in _named_leaves(tree):
    if hasattr(x, "shape") and hasattr(x, "dtype"):
      out[name] = [list(x.shape), str(x.dtype)]
    else:
      out[name] = [type(x).__name__]
  return out


def _renamed_sources(like: dict, saved: dict, renames: dict) -> dict[str, str]:
  """For each leaf name of ``like``, the saved leaf it is read from: itself, or ``.../old`` when
  the checkpoint lacks ``.../new`` and ``renames[old]`` lists ``new``."""
  out = {}
  for name in like:
    out[name] = name
    if name in saved:
      continue
    head, _, leaf = name.rpartition("/")
    for old, new in renames.items():
      cand = f"{head}/{old}" if head else old
      if leaf in tuple(new) and cand in saved:
        out[name] = cand
        break
  return out


def _compare_signatures(step: int, saved: dict, like: dict) -> None:
  missing = sorted(set(like) - set(saved))
  extra = sorted(set(saved) - set(like))
  if missing or extra:
    raise InputError(f"checkpoint step={step} has another structure than like: like has "
                     f"{missing[:4]} that the checkpoint lacks, the checkpoint has {extra[:4]} "
                     f"that like lacks (leaves renamed since it was written: restore(..., renames=...), "
                     f"e.g. jaxsys.nn.FLAX_RENAMES)")
  # arrays: shape and dtype must match; the shallowest leaves first (params before moments)
  bad = sorted((n for n, want in like.items() if len(want) == 2 and saved[n] != want),
               key=lambda n: (n.count("/"), n))
  if bad:
    def say(sig):
      return f"shape {tuple(sig[0])} {sig[1]}" if len(sig) == 2 else sig[0]
    diff = "; ".join(f"{n} with {say(saved[n])} but like has {say(like[n])}" for n in bad[:3])
    more = f" (and {len(bad) - 3} more leaves)" if len(bad) > 3 else ""
    raise InputError(f"checkpoint step={step} holds {diff}{more}")


def _hash(path: Path) -> str:
  with open(path, "rb") as f:
    return hashlib.file_digest(f, "sha256").hexdigest()


def _files(folder: Path) -> list[str]:
  """Relative paths of the files under ``folder``, sorted, without the manifest."""
  out = []
  for root, _, names in os.walk(folder):
    for n in names:
      rel = os.path.relpath(os.path.join(root, n), folder)
      if rel != MANIFEST and not n.startswith(f".{MANIFEST}.tmp"):
        out.append(rel)
  return sorted(out)


class Checkpointer:
  """Step-numbered, verified checkpoints in ``directory`` keeping the newest ``max_to_keep``."""

  def __init__(self, directory: str | os.PathLike, *, max_to_keep: int | None = 3):
    if max_to_keep is not None and max_to_keep < 1:
      raise InputError(f"{max_to_keep=} must be >= 1 or None")
    self.directory = Path(directory).absolute()
    self.directory.mkdir(parents=True, exist_ok=True)
    self.max_to_keep = max_to_keep
    # Rotation is ours (manifest-aware), not orbax's: orbax would count junk and unverified
    # folders among the kept ones. Interrupted saves leave orbax tmp folders: removed here.
    options = ocp.CheckpointManagerOptions(max_to_keep=None, create=True,
                                           cleanup_tmp_directories=True)
    self._manager = ocp.CheckpointManager(self.directory, options=options)
    self._pending: list[tuple[int, dict, dict | None]] = []  # async saves awaiting a manifest
    self._primary = jax.process_index() == 0

  # -- listing and verification ------------------------------------------------------------

  def all_steps(self) -> list[int]:
    """Every step folder, intact or not, oldest first."""
    return sorted(int(p.name) for p in self.directory.iterdir()
                  if p.name.isdigit() and p.is_dir())

  def latest_step(self) -> int | None:
    """The newest step folder (intact or not); see :meth:`latest_intact_step`."""
    steps = self.all_steps()
    return steps[-1] if steps else None

  def _manifest(self, step: int) -> dict | None:
    try:
      return json.loads((self.directory / str(step) / MANIFEST).read_text())
    except (OSError, ValueError):
      return None

  def verify(self, step: int) -> str | None:
    """None if ``step``'s checkpoint is intact, else a one-line reason."""
    self._finish_pending()
    folder = self.directory / str(int(step))
    if not folder.is_dir():
      return "no such step folder"
    if not any(folder.iterdir()):
      return "empty folder"
    if not (folder / MANIFEST).exists():
      return "no manifest (the save did not complete)"
    man = self._manifest(step)
    if not isinstance(man, dict) or not isinstance(man.get("files"), dict):
      return "unreadable manifest"
    if man.get("step") != int(step):
      return f"manifest is for step {man.get('step')}"
    files = man["files"]
    for rel, info in files.items():  # sizes first: cheap, and names truncation as such
      try:
        size = (folder / rel).stat().st_size
      except OSError:
        return f"missing {rel}"
      if size < info["size"]:
        return f"truncated {rel} ({size} of {info['size']} bytes)"
      if size != info["size"]:
        return f"size mismatch in {rel} ({size} != {info['size']} bytes)"
    for rel, info in files.items():
      if _hash(folder / rel) != info["sha256"]:
        return f"hash mismatch in {rel}"
    return None

  def intact_steps(self) -> list[int]:
    return [s for s in self.all_steps() if self.verify(s) is None]

  def latest_intact_step(self) -> int | None:
    """The newest intact step (newer broken ones are logged and skipped), or None."""
    for s in reversed(self.all_steps()):
      reason = self.verify(s)
      if reason is None:
        return s
      log.warning("skipping checkpoint step %d in %s: %s", s, self.directory, reason)
    return None

  def metadata(self, step: int) -> dict | None:
    """The ``metadata`` dict given to ``save`` for ``step`` (None if none or no manifest)."""
    self._finish_pending()
    man = self._manifest(step)
    return man.get("metadata") if isinstance(man, dict) else None

  # -- save ----------------------------------------------------------------------------------

  def save(self, step: int, tree: Any, *, wait: bool = True, metadata: dict | None = None,
           overwrite: bool = False) -> None:
    """Saves ``tree`` as ``step``; ``metadata`` (JSON-able) is stored in the manifest.

    A step at or below an intact existing step is an error unless ``overwrite=True`` (which
    deletes the intact steps >= ``step`` first). With ``wait=False`` orbax writes in the
    background and the manifest is written at the next ``save``/``restore``/``verify``/
    ``wait_until_finished``/``close``; until then the step is not intact.
    """
    step = int(step)
    self._finish_pending()
    for s in [s for s in self.all_steps() if s >= step]:
      reason = self.verify(s)
      if reason is None and not overwrite:
        what = "exists" if s == step else f"is newer than step={step}"
        raise InputError(f"cannot save step={step}: intact checkpoint step={s} {what} in "
                         f"{self.directory}; pass overwrite=True to replace it")
      if reason is not None:
        log.warning("deleting checkpoint step %d in %s before saving step %d: %s", s,
                    self.directory, step, reason)
      self._delete(s)
    self._manager.reload()
    self._manager.save(step, args=ocp.args.StandardSave(tree), force=True)
    self._pending.append((step, tree_signature(tree), metadata))
    if wait:
      self._finish_pending()

  def wait_until_finished(self) -> None:
    self._finish_pending()

  def _finish_pending(self) -> None:
    if not self._pending:
      return
    self._manager.wait_until_finished()
    pending, self._pending = self._pending, []
    for step, sig, meta in pending:
      if self._primary:
        self._write_manifest(step, sig, meta)
    if self._primary:
      self._rotate()
    if jax.process_count() > 1:
      from jax.experimental import multihost_utils
      multihost_utils.sync_global_devices("jaxsys_checkpoint_manifest")

  def _write_manifest(self, step: int, sig: dict, meta: dict | None) -> None:
    folder = self.directory / str(step)
    files = {rel: {"size": (folder / rel).stat().st_size, "sha256": _hash(folder / rel)}
             for rel in _files(folder)}
    man = {"format": _FORMAT, "step": step, "files": files, "tree": sig, "metadata": meta}
    write_atomic(folder / MANIFEST, json.dumps(man, indent=1, sort_keys=True))

  def _rotate(self) -> None:
    if self.max_to_keep is None:
      return
    steps = self.all_steps()
    kept = []  # the newest max_to_keep steps that verify (the one just written always does)
    for s in reversed(steps):
      if len(kept) == self.max_to_keep:
        break
      if self.verify(s) is None:
        kept.append(s)
    if len(kept) < self.max_to_keep:
      return
    for s in steps:
      if s < kept[-1]:
        self._delete(s)

  def _delete(self, step: int) -> None:
    if self._primary:
      shutil.rmtree(self.directory / str(step), ignore_errors=True)
    self._manager.reload()

  # -- restore -------------------------------------------------------------------------------

  def restore(self, step: int | None = None, *, like: Any, renames: dict | None = None) -> Any:
    """Restores ``step`` (default: the newest intact step) into the structure of ``like``.

    ``renames`` (``{old leaf name: (new leaf names, ...)}``, e.g. ``jaxsys.nn.FLAX_RENAMES``)
    reads a checkpoint written under older parameter names: a leaf of ``like`` at ``.../new``
    that the checkpoint lacks is read from ``.../old``. Shapes and dtypes are checked as always."""
    step = self._restorable_step(step)
    abstract = _abstract(like)
    saved = self._manifest(step).get("tree", {})
    like_sig = tree_signature(abstract)
    source = _renamed_sources(like_sig, saved, renames or {})
    _compare_signatures(step, saved, {source[n]: sig for n, sig in like_sig.items()})
    self._manager.reload()
    if all(source[n] == n for n in like_sig):
      return self._manager.restore(step, args=ocp.args.StandardRestore(abstract))
    # renamed leaves: read the saved tree as written, then place each leaf where ``like`` has it
    by_name = dict(_named_leaves(self._manager.restore(step, args=ocp.args.StandardRestore())))
    out = []
    for name, want in _named_leaves(abstract):
      x = by_name[source[name]]
      sharding = getattr(want, "sharding", None)
      out.append(jax.device_put(x, sharding) if sharding is not None else x)
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(abstract), out)

  def _restorable_step(self, step: int | None) -> int:
    """``step`` (default: the newest intact one), checked to exist and to verify."""
    self._finish_pending()
    if step is None:
      if not self.all_steps():
        raise InputError(f"no checkpoint in {self.directory}")
      step = self.latest_intact_step()
      if step is None:
        reasons = "; ".join(f"step {s}: {self.verify(s)}" for s in self.all_steps())
        raise InputError(f"no intact checkpoint in {self.directory} ({reasons})")
    else:
      step = int(step)
      if step not in self.all_steps():
        raise InputError(f"step={step} is not in {self.directory}; have {self.all_steps()}")
      reason = self.verify(step)
      if reason is not None:
        raise InputError(f"checkpoint step={step} in {self.directory} is not intact: {reason}")
    return step

  def close(self):
    self._finish_pending()
    self._manager.close()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()
