import re
import subprocess
import sys
from pathlib import Path

from jaxsys import cli

ROOT = Path(__file__).resolve().parents[1]


def test_readme_test_command_is_what_ci_runs():
  """.ci/run must run exactly the test command the README gives."""
  readme = (ROOT / "README.md").read_text()
  blocks = re.findall(r"```(?:bash|sh)?\n(.*?)```", readme, re.S)
  assert len(blocks) >= 2
  test_cmd = blocks[1].strip()
  assert "pytest" in test_cmd and "jaxsys reproduce --quick" in blocks[0]
  ci = (ROOT / ".ci" / "run").read_text()
  assert test_cmd in ci


def test_info_runs():
  out = subprocess.run([sys.executable, "-m", "jaxsys.cli", "info"], capture_output=True, text=True,
                       check=True).stdout
  assert "attention impl xla" in out


def test_table_reports_failures():
  table = cli.format_table([
      {"name": "attention", "rows": [{"metric": "m", "unit": "ms", "baseline": 2.0, "ours": 1.0,
                                      "ratio": 2.0, "goal": ">= 1", "met": True}]},
      {"name": "cluster", "error": "exit 1: boom"}])
  assert "FAILED: exit 1: boom" in table and "| yes |" in table


def test_reproduce_rejects_unknown(capsys):
  assert cli.main(["reproduce", "--only", "nope"]) == 2
