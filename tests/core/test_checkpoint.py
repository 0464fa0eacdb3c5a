"""Checkpointer: verified restores (corrupt, truncated, empty, missing files), junk folders,
no silent rewinds, manifest-aware rotation, structure checks."""

import logging

import jax.numpy as jnp
import numpy as np
import pytest

from jaxsys.core.checkpoint import Checkpointer
from jaxsys.core.errors import InputError

MANIFEST = "MANIFEST.json"


def tree(step):
  return {"w": jnp.arange(256, dtype=jnp.float32) + step, "b": jnp.full((3, 4), step, jnp.int32),
          "step": step}


def largest_data_file(folder):
  return max((p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST),
             key=lambda p: p.stat().st_size)


def test_restore_skips_corrupt_truncated_empty_and_incomplete_steps(tmp_path, caplog):
  ck = Checkpointer(tmp_path, max_to_keep=None)
  for s in (1, 2, 3, 4, 5):
    ck.save(s, tree(s))
  ck.close()
  # 5: bytes overwritten inside orbax's files; 4: a file truncated; 3: metadata deleted;
  # 6: an empty step folder (e.g. a crash right after mkdir)
  f = largest_data_file(tmp_path / "5")
  data = bytearray(f.read_bytes())
  data[len(data) // 2: len(data) // 2 + 8] = b"\xff" * 8
  f.write_bytes(bytes(data))
  f = largest_data_file(tmp_path / "4")
  f.write_bytes(f.read_bytes()[:-7])
  (tmp_path / "3" / "default" / "_METADATA").unlink()
  (tmp_path / "6").mkdir()

  ck = Checkpointer(tmp_path, max_to_keep=None)  # constructing with broken folders works
  with caplog.at_level(logging.WARNING, logger="jaxsys"):
    got = ck.restore(like=tree(0))
  assert got["step"] == 2
  np.testing.assert_array_equal(got["w"], tree(2)["w"])
  for s in (6, 5, 4, 3):
    assert f"step {s}" in caplog.text
  assert ck.verify(2) is None and ck.verify(1) is None
  assert ck.verify(6) == "empty folder"
  assert ck.verify(5).startswith("hash mismatch in ")
  assert ck.verify(4).startswith("truncated ")
  assert ck.verify(3) == "missing default/_METADATA"
  assert ck.all_steps() == [1, 2, 3, 4, 5, 6]
  assert ck.intact_steps() == [1, 2] and ck.latest_intact_step() == 2
  with pytest.raises(InputError, match="step=5 .*hash mismatch"):
    ck.restore(5, like=tree(0))
  with pytest.raises(InputError, match="step=9 is not in"):
    ck.restore(9, like=tree(0))
  (tmp_path / "2" / MANIFEST).unlink()  # a crash between orbax's commit and the manifest
  assert ck.verify(2).startswith("no manifest")
  assert ck.restore(like=tree(0))["step"] == 1
  # saving over the broken newer folders replaces them (nothing could restore them)
  ck.save(3, tree(3))
  assert ck.all_steps() == [1, 2, 3] and ck.restore(like=tree(0))["step"] == 3


def test_no_silent_rewind_rotation_and_structure(tmp_path):
  (tmp_path / "notes").mkdir()  # junk beside the steps is ignored
  ck = Checkpointer(tmp_path, max_to_keep=2)
  for s in (10, 20, 30):
    ck.save(s, tree(s))
  with pytest.raises(InputError, match="step=25.*step=30"):
    ck.save(25, tree(25))
  with pytest.raises(InputError, match="step=30 exists"):
    ck.save(30, tree(30))
  assert ck.all_steps() == [20, 30]  # rotation kept two; the refused saves deleted nothing
  # an unfinished (manifest-less) newer step does not count as kept: the good ones stay
  (tmp_path / "40").mkdir()
  ck.save(35, tree(35), metadata={"lr": 0.5})
  assert ck.all_steps() == [30, 35] and ck.metadata(35) == {"lr": 0.5}
  ck.save(15, tree(15), overwrite=True)  # an explicit rewind deletes the newer steps
  assert ck.all_steps() == [15] and ck.restore(like=tree(0))["step"] == 15
  with pytest.raises(InputError, match=r"w with shape \(256,\) float32 but like has shape \(8,\)"):
    ck.restore(like={**tree(0), "w": jnp.zeros(8)})
  with pytest.raises(InputError, match="another structure"):
    ck.restore(like={"w": tree(0)["w"]})
  ck.close()


def test_rotation_keeps_max_to_keep_intact_steps(tmp_path):
  """A step corrupted after it was written does not count as kept: with ``max_to_keep=2`` and
  step 20 corrupted, saving 30 keeps 10 (the older intact one) rather than leaving one intact."""
  ck = Checkpointer(tmp_path, max_to_keep=2)
  for s in (10, 20):
    ck.save(s, tree(s))
  data = max((f for f in (tmp_path / "20").rglob("*") if f.is_file() and f.name != MANIFEST),
             key=lambda f: f.stat().st_size)
  data.write_bytes(b"\0" * data.stat().st_size)  # same size, other bytes: only the hash tells
  ck.save(30, tree(30))
  assert [s for s in ck.all_steps() if ck.verify(s) is None] == [10, 30]
  ck.save(40, tree(40))
  assert ck.all_steps() == [30, 40]
  ck.close()
