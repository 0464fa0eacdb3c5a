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
