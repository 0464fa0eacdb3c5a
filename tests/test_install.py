"""The README's main command installs everything the main job needs.

A fresh virtual environment is made from a copy of the checkout with exactly the install part of the
README's first command (everything before ``jaxsys fetch``), then every registered experiment
module is imported in it (none is run) and every package an experiment loads lazily, such as the
server's and the load generator's, is imported. A missing extra in that line fails here instead of
in the middle of ``jaxsys reproduce``. Packages come from the package index (pip's cache makes a
second install quick).
"""

import os
import re
import shutil
import subprocess
from pathlib import Path

from jaxsys.experiments import REGISTRY

ROOT = Path(__file__).resolve().parents[1]
# Imported inside experiment functions, so importing the modules alone would not catch them.
LAZY = ("uvicorn", "fastapi", "openai", "httpx", "torch", "transformers", "accelerate", "gguf", "matplotlib")


def readme_install_line() -> str:
  first = re.findall(r"```(?:bash|sh)?\n(.*?)```", (ROOT / "README.md").read_text(), re.S)[0].strip()
  install, sep, _ = first.partition(" && jaxsys fetch")
  assert sep and install.startswith("python3 -m venv .venv"), first
  return install


def test_readme_install_line_gives_every_experiment_its_imports(tmp_path):
  src = tmp_path / "jaxsys"
  shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(
      ".git", ".venv", "runs", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache"))
  env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "XLA_FLAGS")}
  r = subprocess.run(["bash", "-c", readme_install_line()], cwd=src, env=env, capture_output=True, text=True,
                     timeout=1500)
  assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
  modules = [m for m, _, _ in REGISTRY.values()] + list(LAZY)
  code = "import importlib, sys\nfor m in sys.argv[1:]:\n  importlib.import_module(m)\nprint('ok')"
  r = subprocess.run([str(src / ".venv" / "bin" / "python"), "-P", "-c", code, *modules], cwd=tmp_path,
                     env=env, capture_output=True, text=True, timeout=600)
  assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-3000:]
  cli = subprocess.run([str(src / ".venv" / "bin" / "jaxsys"), "reproduce", "--list"], env=env,
                       capture_output=True, text=True, timeout=300)
  assert cli.returncode == 0 and all(name in cli.stdout for name in REGISTRY), cli.stderr[-2000:]
