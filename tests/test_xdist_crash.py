"""The suite's crash handling (tests/_xdist_crash.py) in a bare pytest-xdist run of its own: a test
whose worker dies is rerun once on a fresh worker, a second crash fails it, an ordinary failure is
not retried, and the run finishes instead of hanging."""

import pathlib
import shutil
import subprocess
import sys

import pytest

TESTS = '''
import os, pathlib, signal

def test_crashes_once():
  mark = pathlib.Path(__file__).with_name("crashed")
  if not mark.exists():
    mark.write_text("1")
    os.kill(os.getpid(), signal.SIGSEGV)

def test_crashes_always():
  os.kill(os.getpid(), signal.SIGSEGV)

def test_fails():
  assert False, "an ordinary failure"

def test_passes():
  pass
'''

CONFTEST = '''
import importlib.util
spec = importlib.util.spec_from_file_location("xdist_crash", {path!r})
plugin = importlib.util.module_from_spec(spec)
spec.loader.exec_module(plugin)

def pytest_configure(config):
  config.pluginmanager.register(plugin, "xdist-crash")
'''


@pytest.mark.parametrize("dist", ["worksteal", "load"])
def test_a_crashed_test_is_rerun_once_and_the_run_finishes(tmp_path, dist):
  src = pathlib.Path(__file__).with_name("_xdist_crash.py")
  shutil.copy(src, tmp_path / "_xdist_crash.py")
  (tmp_path / "conftest.py").write_text(CONFTEST.format(path=str(tmp_path / "_xdist_crash.py")))
  (tmp_path / "test_crashy.py").write_text(TESTS)
  (tmp_path / "pytest.ini").write_text("[pytest]\n")  # keeps the project's own options out
  cmd = [sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", dist, "-p", "no:cacheprovider",
         "-p", "no:randomly", str(tmp_path)]
  out = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)
  log = out.stdout + out.stderr
  assert out.returncode == 1, log
  assert "2 failed, 2 passed, 2 rerun" in log, log  # crashes_always (twice) and fails; once+passes
  assert "FAILED test_crashy.py::test_fails" in log, log
  # The end-of-run section lists each rerun: the two crashes' first attempts, not the failure.
  section = log.split("crashed and rerun")[1].split("\n=")[0]
  assert "test_crashes_once" in section and "test_crashes_always" in section, log
  assert "test_fails" not in section, log
