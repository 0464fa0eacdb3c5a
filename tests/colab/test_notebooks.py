"""Every notebook in colab/ runs top to bottom on CPU-sized settings."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "colab").glob("*.ipynb"))


def _install_cell() -> str:
  nbformat = pytest.importorskip("nbformat")
  return "".join(next(c for c in nbformat.read(NOTEBOOKS[0], as_version=4).cells
                      if c.cell_type == "code").source)


INSTALL_CELL = _install_cell()


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_executes(path, tmp_path):
  nbformat = pytest.importorskip("nbformat")
  nbclient = pytest.importorskip("nbclient")
  nb = nbformat.read(path, as_version=4)
  env_backup = dict(os.environ)
  # Notebooks run in a fresh kernel: one CPU device unless the notebook sets its own count; the
  # suite's backend optimisation level (tests/conftest.py) is kept.
  os.environ["XLA_FLAGS"] = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split()
                                     if "xla_force_host_platform_device_count" not in f)
  os.environ["JAXSYS_NOTEBOOK_TEST"] = "1"
  os.environ["MPLBACKEND"] = "Agg"
  try:
    client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()
  finally:
    os.environ.clear()
    os.environ.update(env_backup)


def _code_cells(path):
  nbformat = pytest.importorskip("nbformat")
  return ["".join(c.source) for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_is_portable_and_checks_itself(path):
  """Without running it: the size switch, own asserts, no forced device count, no script imports."""
  cells = _code_cells(path)
  assert cells[0] == INSTALL_CELL, "the first code cell must be the install cell (tests/colab)"
  assert "JAXSYS_NOTEBOOK_TEST" in cells[1], "the second code cell must read the size switch"
  asserts = sum(line.lstrip().startswith("assert ") for cell in cells for line in cell.splitlines())
  assert asserts >= 2, f"{path.name} asserts {asserts} results; it must check at least 2"
  code = "\n".join(cells)
  assert "matplotlib.use(" not in code, "plots must display inline"
  assert "from experiments" not in code and "import experiments" not in code, \
      "experiments/ is not installed with the library"
  if "xla_force_host_platform_device_count" in code:
    # a simulated device count only on CPU, and never over the user's own XLA_FLAGS
    assert '"xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", "")' in code
    assert "ACCELERATOR" in code
    assert "jax.device_count()" in code, "meshes must be sized from the device count"


def test_install_cell_installs_jaxsys_into_a_fresh_venv(tmp_path):
  """The install cell, run in a fresh venv that lacks jaxsys, installs it from a checkout (a copy
  of this one, as ``JAXSYS_SOURCE``), and the installed copy imports with its bundled assets.
  The venv borrows this environment's dependencies through a ``.pth`` line (nothing downloads:
  ``--no-deps --no-index``); ``--ignore-installed`` keeps pip from touching this environment."""
  import site
  import sysconfig

  src = tmp_path / "checkout"
  shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(
      ".git", ".venv", "runs", "build", "dist", "*.egg-info", "__pycache__", "docs"))
  venv = tmp_path / "venv"
  subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
  py = venv / "bin" / "python"
  purelib = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                           check=True, capture_output=True, text=True).stdout.strip()
  # A plain path line: this environment's packages (pip, setuptools, jax, ...) become importable,
  # but its editable jaxsys finder (a nested .pth) is not run, so jaxsys is missing, as on Colab.
  deps = [p for p in site.getsitepackages() + [sysconfig.get_paths()["purelib"]] if Path(p).is_dir()]
  Path(purelib, "deps.pth").write_text("\n".join(dict.fromkeys(deps)) + "\n")
  work = tmp_path / "work"
  work.mkdir()
  env = dict(os.environ, JAXSYS_SOURCE=str(src),
             JAXSYS_PIP_ARGS="--no-deps --no-index --no-build-isolation --ignore-installed")
  env.pop("PYTHONPATH", None)
  check = ("import importlib.util; assert importlib.util.find_spec('jaxsys') is None, 'already importable'")
  subprocess.run([str(py), "-c", check], cwd=work, env=env, check=True)
  # Without a source, the cell says what to set rather than failing inside pip.
  r = subprocess.run([str(py), "-c", INSTALL_CELL], cwd=work, capture_output=True, text=True,
                     env={k: v for k, v in env.items() if k != "JAXSYS_SOURCE"})
  assert r.returncode != 0 and "set JAXSYS_SOURCE" in r.stderr, r.stderr[-2000:]
  r = subprocess.run([str(py), "-c", INSTALL_CELL], cwd=work, env=env, capture_output=True, text=True)
  assert r.returncode == 0, r.stderr[-3000:]
  probe = ("import jaxsys, jaxsys.models as M; print(jaxsys.__file__); "
           "m = M.load_tiny_lm(); print(m.config.vocab_size)")
  r = subprocess.run([str(py), "-c", probe], cwd=work, env=env, capture_output=True, text=True)
  assert r.returncode == 0, r.stderr[-3000:]
  where, vocab = r.stdout.split()
  assert Path(where).is_relative_to(venv), f"jaxsys imported from {where}, not the fresh venv"
  assert int(vocab) > 0
