"""Every Python block of the README runs as written, so the README cannot rot.

Each block runs in a fresh interpreter (8 simulated CPU devices, as the README's parallel
examples say) from an empty working directory. Two things are changed before it runs, both
listed here: loop and step counts are scaled down (``SCALE``), and a block preceded by an HTML
comment ``<!-- readme-test: skip REASON -->`` is skipped, REASON naming the test that runs it
instead (e.g. a client snippet that needs a running server).
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _multiprocess import xla_flags  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()

# (pattern, replacement): iteration counts only; shapes and settings stay as written.
SCALE = [
    (r"\bsteps=200\b", "steps=20"),
    (r"\bepochs=200\b", "epochs=20"),
    (r"\btotal_steps=60\b", "total_steps=12"),
    (r"\bcheckpoint_every=30\b", "checkpoint_every=6"),
    (r"\bwarmup_steps=10\b", "warmup_steps=2"),
    (r"for epoch in range\(20\)", "for epoch in range(2)"),
]


def _blocks():
  out = []
  for m in re.finditer(r"```python\n(.*?)```", README, re.S):
    before = README[:m.start()].rstrip().splitlines()[-1:] or [""]
    skip = re.match(r"<!--\s*readme-test:\s*skip\s*(.*?)\s*-->", before[0])
    heading = [h for h in re.findall(r"^#+ (.*)$", README[:m.start()], re.M)][-1:] or ["top"]
    line = README[:m.start()].count("\n") + 2
    out.append(pytest.param(m.group(1), skip.group(1) if skip else None,
                            id=f"L{line}-{re.sub(r'[^A-Za-z0-9]+', '_', heading[0])[:40]}"))
  return out


BLOCKS = _blocks()


def test_readme_has_python_blocks():
  assert len(BLOCKS) >= 8


@pytest.mark.parametrize("code,skip", BLOCKS)
def test_readme_block_runs(code, skip, tmp_path):
  if skip is not None:
    assert re.search(r"tests/\S+\.py", skip), f"a skipped block must name the test that runs it: {skip!r}"
    pytest.skip(skip)
  for pattern, repl in SCALE:
    code = re.sub(pattern, repl, code)
  env = dict(os.environ, MPLBACKEND="Agg", JAXSYS_README_TEST="1")
  env["XLA_FLAGS"] = xla_flags(8)
  r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                     timeout=600)
  assert r.returncode == 0, f"README block failed:\n{code}\n--- stderr ---\n{r.stderr[-3000:]}"
