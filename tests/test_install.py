"""A plain install generates text, and the README's main command installs everything the main job needs.

First the package's wheel is built and installed with no extras into a fresh virtual environment
(no torch there), and ``jaxsys fetch smollm2-135m-instruct`` then ``jaxsys generate`` must print a
reply: the tokenizer and the chat template come from the GGUF without torch or transformers'
converters. Then, in the same environment (so the dependencies are not installed twice), a fresh
virtual environment is made from a copy of the checkout with exactly the install part of the
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
import sys
from pathlib import Path

from jaxsys.experiments import REGISTRY

ROOT = Path(__file__).resolve().parents[1]
SMOLLM2 = "smollm2-135m-instruct"
# Imported inside experiment functions, so importing the modules alone would not catch them.
LAZY = ("uvicorn", "fastapi", "prometheus_client", "llguidance", "openai", "httpx", "torch", "transformers", "accelerate", "gguf", "matplotlib")


def readme_install_line() -> str:
  first = re.findall(r"```(?:bash|sh)?\n(.*?)```", (ROOT / "README.md").read_text(), re.S)[0].strip()
  install, sep, _ = first.partition(" && jaxsys fetch")
  assert sep and install.startswith("python3 -m venv .venv"), first
  return install


def _plain_install_generates(src: Path, env: dict) -> None:
  """``pip install <wheel>`` (no extras) into ``src/.venv``, then fetch + generate print a reply."""
  r = subprocess.run(f"{sys.executable} -m pip wheel -q --no-deps --no-build-isolation -w dist . && "
                     "python3 -m venv .venv && .venv/bin/pip install -q --no-compile dist/jaxsys-*.whl",
                     shell=True, cwd=src, env=env, capture_output=True, text=True, timeout=1500)
  assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
  bin_ = src / ".venv" / "bin"
  r = subprocess.run([str(bin_ / "python"), "-c", "import importlib.util as u; print(u.find_spec('torch'))"],
                     env=env, capture_output=True, text=True, timeout=60)
  assert r.stdout.strip() == "None", "the plain install pulled in torch"
  r = subprocess.run([str(bin_ / "jaxsys"), "fetch", SMOLLM2], env=env, capture_output=True, text=True,
                     timeout=900)
  assert r.returncode == 0, r.stderr[-3000:]
  # XLA's backend optimisation off: the reply is the same and the compile is cheaper.
  r = subprocess.run([str(bin_ / "jaxsys"), "generate", "--model", SMOLLM2, "--max-new-tokens", "8",
                      "What is the capital of France?"], env=dict(env, XLA_FLAGS="--xla_backend_optimization_level=0"),
                     cwd=src.parent, capture_output=True, text=True, timeout=600)
  assert r.returncode == 0 and "Paris" in r.stdout, r.stdout[-2000:] + r.stderr[-3000:]


def test_plain_install_generates_and_readme_install_line_gives_every_experiment_its_imports(tmp_path):
  src = tmp_path / "jaxsys"
  shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(
      ".git", ".venv", "runs", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache"))
  env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "XLA_FLAGS")}
  _plain_install_generates(src, env)
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
