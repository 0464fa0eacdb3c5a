import importlib
import json
import re
import shlex
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest

import jaxsys
from jaxsys import cli
from jaxsys import experiments as runner

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
  table = runner.format_table([
      {"name": "attention", "rows": [{"metric": "m", "unit": "ms", "baseline": 2.0, "ours": 1.0,
                                      "ratio": 2.0, "goal": ">= 1", "met": True}]},
      {"name": "cluster", "error": "exit 1: boom"}])
  assert "FAILED: exit 1: boom" in table and "| yes |" in table


def test_reproduce_rejects_unknown(capsys):
  assert cli.main(["reproduce", "--only", "nope"]) == 2


def test_table_escapes_pipes_in_cells():
  table = runner.format_table([{"name": "attention", "rows": [
      {"metric": "a | b", "unit": "ms", "baseline": 1.0, "ours": 1.0, "ratio": 1.0}]}])
  row = table.splitlines()[2]
  assert "a \\| b" in row and row.count("|") - row.count("\\|") == 11  # 10 cells


def test_reproduce_is_not_shadowed_by_a_local_experiments_package(tmp_path, monkeypatch):
  """A user's own ``experiments`` package in the working directory hides neither the registry
  (``jaxsys.experiments``) nor the scripts (run with ``python -P``, cwd off sys.path)."""
  (tmp_path / "experiments").mkdir()
  (tmp_path / "experiments" / "__init__.py").write_text("raise ImportError('the user package')\n")
  monkeypatch.chdir(tmp_path)
  calls, real_run, real_popen = [], subprocess.run, subprocess.Popen

  def fake_popen(cmd, **kwargs):
    if "-m" not in cmd:  # the probe below, through subprocess.run
      return real_popen(cmd, **kwargs)
    calls.append(cmd)
    probe = [cmd[0], *cmd[1:cmd.index("-m")], "-c",
             "import experiments.cluster as m, sys; sys.stdout.write(m.__file__)"]
    found = real_run(probe, capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert found.returncode == 0, found.stderr
    assert Path(found.stdout).resolve() == ROOT / "experiments" / "cluster.py"
    return types.SimpleNamespace(returncode=1, wait=lambda timeout=None: 1, kill=lambda: None)

  monkeypatch.setattr(runner.subprocess, "Popen", fake_popen)
  cli.main(["reproduce", "--only", "cluster", "--quick", "--out", str(tmp_path / "runs")])
  assert len(calls) == 1 and calls[0][-3:] == ["--out", str(tmp_path / "runs"), "--quick"]


def _console_script() -> str:
  """The installed ``jaxsys`` entry point (the venv's, else the one on PATH)."""
  script = Path(sys.executable).with_name("jaxsys")
  found = str(script) if script.exists() else shutil.which("jaxsys")
  assert found, "the jaxsys console script is not installed (pip install -e .)"
  return found


def _run(*args):
  return subprocess.run([_console_script(), *args], capture_output=True, text=True, timeout=300)


def test_console_script_help_version_and_exit_codes():
  """Leading options and --help reach the forwarded subcommand; its exit code comes back."""
  out = _run("--version")
  assert out.returncode == 0 and out.stdout.strip() == f"jaxsys {cli.version()}"
  for command, usage in (("serve", "--prompts PROMPTS"), ("cluster", "summary")):
    out = _run(command, "--help")
    assert out.returncode == 0 and out.stdout.startswith(f"usage: jaxsys {command}"), out.stderr
    assert usage in out.stdout
  out = _run("cluster", "no-such-command")
  assert out.returncode == 2 and "no-such-command" in out.stderr


def test_console_script_serves_the_tiny_model(tmp_path):
  f = tmp_path / "p.jsonl"
  f.write_text("[5, 6, 7, 8]\n" + json.dumps({"tokens": [9, 10, 11], "max_new_tokens": 2}) + "\n")
  out = _run("serve", "--prompts", str(f), "--model", "tiny", "--dense", "--max-new-tokens", "3",
             "--page-size", "16", "--logical-page", "4", "--budget", "64", "--num-pages", "16",
             "--max-batch", "2", "--out", str(tmp_path / "out.jsonl"))
  assert out.returncode == 0, out.stderr
  rows = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
  assert [r["index"] for r in rows] == [0, 1] and all(r["error"] is None for r in rows)
  assert 1 <= len(rows[0]["tokens"]) <= 3 and 1 <= len(rows[1]["tokens"]) <= 2
  assert "served 2 prompts (0 rejected)" in out.stderr


def _readme_commands():
  """Every concrete ``jaxsys ...`` command line of README.md (code blocks and inline code)."""
  readme = (ROOT / "README.md").read_text()
  found = re.findall(r"(?:^|&& |`)(jaxsys [^`&\n]*)", readme, re.M)
  cmds = {c.strip() for c in found if "..." not in c and "[" not in c}
  return sorted(shlex.split(c, comments=True) for c in cmds)


def test_readme_commands_reach_their_subcommand_untouched(monkeypatch):
  cmds = _readme_commands()
  assert {c[1] for c in cmds} >= {"reproduce", "info", "serve", "cluster"}
  seen = []
  fake = types.SimpleNamespace(main=lambda argv: seen.append(argv) or 3)
  import jaxsys.serving.chat_cli  # noqa: F401  (imported before import_module is patched)
  import jaxsys.serving.cli as serve_cli
  import jaxsys.serving.finetune_cli as finetune_cli
  import jaxsys.serving.gates_cli as gates_cli
  parsers = {"serve": serve_cli, "gates": gates_cli, "finetune": finetune_cli}
  monkeypatch.setattr(importlib, "import_module", lambda name: fake)
  for argv in cmds:
    if argv[1] in ("serve", "cluster", "gates", "finetune"):
      assert cli.main(argv[1:]) == 3 and seen[-1] == argv[2:]  # the exit code passes through
      if argv[1] in parsers:
        parsers[argv[1]].build_parser().parse_args(argv[2:])
    else:
      cli.build_parser().parse_args(argv[1:])


def test_info_shows_the_version(capsys):
  assert cli.main(["info"]) == 0
  assert f"jaxsys {jaxsys.__version__}" in capsys.readouterr().out
  with pytest.raises(SystemExit):
    cli.main(["--version"])
  assert capsys.readouterr().out.strip() == f"jaxsys {cli.version()}"


@pytest.mark.slow
def test_readme_serve_section_runs(tmp_path):
  """The README's "Serve a model" commands and client snippet, as written (a free port instead of
  8000, and a smaller page pool to bound memory), against the real SmolLM2."""
  import socket
  import time
  import urllib.request
  from jaxsys.models.llm.interop import pretrained
  if pretrained.find("smollm2-135m-instruct") is None:
    pytest.skip("SmolLM2 not installed: run `jaxsys fetch smollm2-135m-instruct`")
  readme = (ROOT / "README.md").read_text()
  sec = readme[readme.index("### Serve a model"):]
  sec = sec[:sec.index("\n### ", 1)]
  fetch, serve = re.search(r"```bash\n(.*?)```", sec, re.S).group(1).strip().splitlines()
  snippet = re.search(r"```python\n(.*?)```", sec, re.S).group(1)
  out = _run(*shlex.split(fetch)[1:])
  assert fetch.startswith("jaxsys fetch") and out.returncode == 0, out.stderr
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  argv = shlex.split(serve)[1:]
  argv[argv.index("--port") + 1] = str(port)
  log = open(tmp_path / "serve.log", "w")
  proc = subprocess.Popen([_console_script(), *argv, "--num-pages", "64"], stdout=log, stderr=log)
  try:
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
      try:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
        break
      except OSError:
        time.sleep(1)
    assert proc.poll() is None, (tmp_path / "serve.log").read_text()
    res = subprocess.run([sys.executable, "-c", snippet.replace("8000", str(port))],
                         capture_output=True, text=True, timeout=400)
    assert res.returncode == 0, res.stderr
    assert "Paris" in res.stdout
    _sigterm_during_a_stream_stops_the_server(proc, port)
  finally:
    proc.terminate()
    proc.wait(timeout=60)
    log.close()


def _sigterm_during_a_stream_stops_the_server(proc, port):
  """SIGTERM while a client streams a long reply: the server exits within a bounded time (5 s of
  grace for open requests, then they are cancelled and the engine thread joined), not when the
  stream would have ended."""
  import threading
  import time

  import httpx
  started = threading.Event()

  def stream():
    body = {"model": "smollm2-135m-instruct", "prompt": "Once upon a time", "max_tokens": 400,
            "ignore_eos": True, "stream": True}
    try:
      with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=120) as s:
        for _ in s.iter_lines():
          started.set()
    except httpx.HTTPError:
      pass
  threading.Thread(target=stream, daemon=True).start()
  assert started.wait(120)
  t0 = time.monotonic()
  proc.terminate()
  proc.wait(timeout=60)
  assert time.monotonic() - t0 < 30


def test_reproduce_heartbeat_shows_the_running_experiments_last_line(tmp_path, capsys):
  import subprocess
  import sys
  import time
  log_path = tmp_path / "log.txt"
  code = ("import sys, time\nfor i in range(4):\n  sys.stdout.write(f'\\rstep {i}/4'); sys.stdout.flush(); "
          "time.sleep(0.4)\nprint()\nprint('done')")
  with open(log_path, "w") as log:
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=log, stderr=subprocess.STDOUT)
    assert runner._wait_with_heartbeat(proc, log_path, t0, None, every=0.5) == 0
  out = capsys.readouterr().out
  assert "step " in out and "s  step" in out
  assert runner._last_line(log_path) == "done"
  with open(log_path, "w") as log:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], stdout=log)
    assert runner._wait_with_heartbeat(proc, log_path, time.perf_counter(), 1.0, every=0) is None
  assert proc.returncode is not None  # killed, not left running


def test_run_params_match_each_experiments_signature():
  """The runner reads each ``run``'s parameters from source; they agree with the imported function,
  so a flag goes exactly to the experiments whose ``_cli`` parser accepts it."""
  import inspect
  for name, (module, _, _) in runner.REGISTRY.items():
    assert runner.run_params(name) == tuple(inspect.signature(importlib.import_module(module).run).parameters)


def test_reproduce_forwards_flags_to_the_experiments_that_take_them(tmp_path, monkeypatch, capsys):
  calls = []

  def fake_popen(cmd, **kwargs):
    calls.append(cmd)
    return types.SimpleNamespace(returncode=1, wait=lambda timeout=None: 1, kill=lambda: None)

  monkeypatch.setattr(runner.subprocess, "Popen", fake_popen)
  rc = cli.main(["reproduce", "--only", "mmsp", "cluster", "--quick", "--devices", "4", "--mesh", "ring=2,ulysses=2",
                 "--dtype", "bfloat16", "--seed", "3", "--out", str(tmp_path), "--heartbeat", "0"])
  assert rc == 1  # both "failed": the fake process wrote no result
  mmsp, cluster = (" ".join(c) for c in calls)
  for flag in ("--devices 4", "--mesh ring=2,ulysses=2", "--dtype bfloat16", "--quick"):
    assert flag in mmsp
  assert "--devices 4" in cluster and "--mesh" not in cluster and "--dtype" not in cluster
  out = capsys.readouterr().out
  assert "cluster takes no --mesh, --dtype" in out and "[1/2] mmsp" in out and "left)" in out
  summary = (tmp_path / "summary.md").read_text()
  assert "| experiment | wall time |" in summary and "| cluster |" in summary and "2 experiments in" in summary


def test_reproduce_rejects_a_malformed_mesh(capsys):
  with pytest.raises(SystemExit):
    cli.main(["reproduce", "--mesh", "ring"])
  assert "expected axis=size" in capsys.readouterr().err


def test_reproduce_lists_experiments_and_their_flags(capsys):
  assert cli.main(["reproduce", "--list"]) == 0
  lines = capsys.readouterr().out.splitlines()
  assert [ln.split()[0] for ln in lines] == list(runner.REGISTRY)
  mmsp = next(ln for ln in lines if ln.startswith("mmsp "))
  assert "--mesh" in mmsp and "--dtype" in mmsp


def test_reproduce_help_names_every_experiment():
  r = subprocess.run([sys.executable, "-m", "jaxsys.cli", "reproduce", "--help"], capture_output=True, text=True)
  assert r.returncode == 0 and all(f"  {n} " in r.stdout for n in runner.REGISTRY)


def test_eta_scales_the_remaining_expected_times():
  names = ["attention", "cluster", "date"]
  q = runner.QUICK_SECONDS
  left = runner._eta(names, 1, t_start=100.0, done_s=2 * q["attention"], quick=True)
  assert left(100.0) == f", ~{runner._minutes(2 * (q['cluster'] + q['date']))} left"  # twice as slow so far
  assert runner._eta(names, 0, 0.0, 0.0, quick=False)(5.0) == ""


def test_experiments_readme_table_is_one_reproduce_run_of_every_experiment():
  """experiments/README.md's latest table is a ``runs/summary.md`` (table, then the footer of wall
  times) with a row, and a footer line, for every registered experiment."""
  text = (ROOT / "experiments" / "README.md").read_text()
  section = text.split("## Latest `jaxsys reproduce --quick` table", 1)[1].split("\n## ", 1)[0]
  rows = [ln.split("|")[2].strip() for ln in section.splitlines() if ln.startswith("| ") and ln.count("|") == 11]
  assert set(runner.REGISTRY) <= set(rows), sorted(set(runner.REGISTRY) - set(rows))
  footer = {ln.split("|")[1].strip() for ln in section.splitlines() if ln.startswith("| ") and ln.count("|") == 6}
  assert set(runner.REGISTRY) <= footer, sorted(set(runner.REGISTRY) - footer)
  assert re.search(rf"`jaxsys reproduce --quick`: {len(runner.REGISTRY)} experiments in [\d.]+ min", section)
  assert "FAILED" not in section


def test_serve_reports_a_bad_gates_file_and_port_in_one_line(tmp_path):
  """A gates file that is not JSON was a raw JSONDecodeError traceback, and ``--port -1`` uvicorn's
  ``[Errno -8]``: each is one ``error:`` line naming the file or the flag, exit 2."""
  bad = tmp_path / "gates.json"
  bad.write_text("{not json")
  f = tmp_path / "p.jsonl"
  f.write_text("[5, 6, 7]\n")
  out = _run("serve", "--prompts", str(f), "--model", "tiny", "--lserve", "--gates", str(bad),
             "--page-size", "16", "--logical-page", "4", "--budget", "64", "--num-pages", "16")
  assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
  assert "error:" in out.stderr and "gates.json" in out.stderr
  out = _run("serve", "--model", "tiny", "--port", "-1")
  assert out.returncode == 2 and "Traceback" not in out.stderr and "--port -1" in out.stderr, out.stderr


def test_reproduce_shares_a_compilation_cache(tmp_path, monkeypatch):
  """Every experiment gets the same persistent cache (every executable stored); 'off' gives none."""
  import argparse
  monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
  monkeypatch.setenv("JAXSYS_HOME", str(tmp_path / "home"))
  env = runner.child_env(argparse.Namespace(compile_cache=None))
  assert env["JAX_COMPILATION_CACHE_DIR"] == str(tmp_path / "home" / "xla-cache")
  assert env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] == "0" and env["PYTHONUNBUFFERED"] == "1"
  env = runner.child_env(argparse.Namespace(compile_cache=str(tmp_path / "c")))
  assert env["JAX_COMPILATION_CACHE_DIR"] == str(tmp_path / "c") and (tmp_path / "c").is_dir()
  monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "user"))
  assert "JAX_COMPILATION_CACHE_DIR" not in runner.child_env(argparse.Namespace(compile_cache="off"))
  assert runner.child_env(argparse.Namespace(compile_cache=None))["JAX_COMPILATION_CACHE_DIR"] == str(tmp_path / "user")
