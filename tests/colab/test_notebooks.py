"""Every notebook in colab/ runs top to bottom on CPU-sized settings."""

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "colab").glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_executes(path, tmp_path):
  nbformat = pytest.importorskip("nbformat")
  nbclient = pytest.importorskip("nbclient")
  nb = nbformat.read(path, as_version=4)
  env_backup = dict(os.environ)
  # Notebooks run in a fresh kernel: one CPU device unless the notebook sets its own flags.
  os.environ.pop("XLA_FLAGS", None)
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
  assert "JAXSYS_NOTEBOOK_TEST" in cells[0], "the first code cell must read the size switch"
  asserts = sum(line.lstrip().startswith("assert ") for cell in cells for line in cell.splitlines())
  assert asserts >= 2, f"{path.name} asserts {asserts} results; it must check at least 2"
  code = "\n".join(cells)
  assert "matplotlib.use(" not in code, "plots must display inline"
  assert "from experiments" not in code and "import experiments" not in code, \
      "experiments/ is not installed with the library"
  if "xla_force_host_platform_device_count" in code:
    # a simulated device count only on CPU, and never over the user's own XLA_FLAGS
    assert '"XLA_FLAGS" not in os.environ' in code and "ACCELERATOR" in code
    assert "jax.device_count()" in code, "meshes must be sized from the device count"
