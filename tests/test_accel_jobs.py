"""The accelerator jobs, prepared on CPU: carrying the model in parts (split, stash, re-join with
checksums, install where ``jaxsys.models.llm.interop.pretrained`` finds it), the named assets the jobs bring back
(``jaxsys.assets``: gates, drafters), the gates job's ``--smoke`` run, the TLT job's plumbing around
the tlt experiment, and the runner's budget (``experiments.accel``)."""

import dataclasses
import hashlib
import json
import os
import sys

import numpy as np
import pytest

import jaxsys.assets as A
from experiments import carry
from jaxsys.core.errors import InputError
from jaxsys.models.llm.interop import pretrained as P

# ----------------------------------------------------------------------------- carry


def _blob(tmp_path, n=1000, name="model.gguf"):
  p = tmp_path / name
  p.write_bytes(np.random.default_rng(0).integers(0, 256, n, dtype=np.uint8).tobytes())
  return p


def test_split_and_join_from_two_calls(tmp_path):
  src = _blob(tmp_path)
  m = carry.split_file(src, tmp_path / "c", "m", max_bytes=400)
  assert [p["bytes"] for p in m["parts"]] == [334, 334, 332] and m["bytes"] == 1000
  assert json.loads((tmp_path / "c" / "m.manifest.json").read_text()) == m
  # the parts arrive in two places (the first call's stash, the second call's checkout)
  first, second = tmp_path / "first", tmp_path / "second"
  first.mkdir(), second.mkdir()
  for i, d in ((0, first), (1, second), (2, second)):
    (tmp_path / "c" / f"m.part{i:02d}").rename(d / f"m.part{i:02d}")
  with pytest.raises(carry.MissingParts, match=r"m\.part00"):
    carry.join_parts(m, [second], tmp_path / "out.gguf")
  out = carry.join_parts(m, [first, second], tmp_path / "out" / "model.gguf")
  assert out.read_bytes() == src.read_bytes()


def test_checksum_mismatch_names_the_part(tmp_path):
  src = _blob(tmp_path)
  m = carry.split_file(src, tmp_path, "m", max_bytes=600)
  part = tmp_path / "m.part01"
  part.write_bytes(b"x" + part.read_bytes()[1:])
  with pytest.raises(InputError, match=r"part .*m\.part01: sha256 .* does not match"):
    carry.join_parts(m, [tmp_path], tmp_path / "out.gguf")
  m2 = carry.split_file(src, tmp_path, "m", max_bytes=600)
  m2["sha256"] = "0" * 64                   # parts intact, the whole file's checksum wrong
  with pytest.raises(InputError, match="joined model.gguf: sha256"):
    carry.join_parts(m2, [tmp_path], tmp_path / "out.gguf")
  assert not (tmp_path / "out.gguf").exists()
  with pytest.raises(Exception, match="must be >= 1"):
    carry.split_file(src, tmp_path, "m", max_bytes=0)


def test_install_over_two_calls_puts_the_model_where_pretrained_finds_it(tmp_path, monkeypatch, capsys):
  src = _blob(tmp_path, 900)
  spec = P.PretrainedSpec(pip_name="none", version="0", package="no_such_package_for_carry",
                          filename="tiny.gguf", sha256=hashlib.sha256(src.read_bytes()).hexdigest(),
                          license="-", description="test")
  monkeypatch.setitem(P.MODELS, "tiny-carry", spec)
  monkeypatch.setenv("JAXSYS_HOME", str(tmp_path / "home"))
  here = tmp_path / "here"
  carry.split_file(src, here, "tiny-carry", max_bytes=500)
  calls = []
  for i in (0, 1):  # what each device call's checkout holds: the manifest and its own part
    d = tmp_path / f"call{i}"
    d.mkdir()
    for f in ("tiny-carry.manifest.json", f"tiny-carry.part{i:02d}"):
      (d / f).write_bytes((here / f).read_bytes())
    calls.append(d)
  args = ["install", "--model", "tiny-carry", "--dir"]
  assert carry.main(args + [str(calls[0])]) == 3              # part01 missing
  assert carry.main(args + [str(calls[0]), "--partial-ok"]) == 0
  assert "part01" in capsys.readouterr().out
  assert P.find("tiny-carry") is None
  assert carry.main(args + [str(calls[1])]) == 0
  assert P.find("tiny-carry") == tmp_path / "home" / "models" / "tiny-carry" / "tiny.gguf"
  assert P.find("tiny-carry").read_bytes() == src.read_bytes()
  # a manifest of another file than the pinned one is refused before anything is joined
  monkeypatch.setitem(P.MODELS, "tiny-other", dataclasses.replace(spec, sha256="1" * 64))
  carry.split_file(src, here, "tiny-other", max_bytes=500)
  assert carry.main(["install", "--model", "tiny-other", "--dir", str(here)]) == 2
  assert "is not the pinned sha256" in capsys.readouterr().err


# ----------------------------------------------------------------------------- assets


def test_gates_asset_round_trip_by_name(tmp_path):
  from jaxsys.serving.streaming import StreamingGates
  g = StreamingGates.from_alpha(np.array([[0.9, 0.1, 0.4], [0.0, 0.7, 0.2]]), sink=4, window=8,
                                sparsity=0.5, history=(1.0, 0.5))
  settings = {"model": "tiny", "tokens": 64, "steps": 2}
  A.write_json("gates", "tiny-8k", dataclasses.asdict(g), settings, root=tmp_path)
  assert A.names("gates", root=tmp_path) == ["tiny-8k"]
  assert StreamingGates.load(A.path("gates", "tiny-8k", root=tmp_path)) == g  # what the LServe path reads
  assert A.settings("gates", "tiny-8k", root=tmp_path) == settings
  with pytest.raises(FileNotFoundError, match=r"no gates asset 'other'.*known: \['tiny-8k'\]"):
    A.path("gates", "other", root=tmp_path)
  with pytest.raises(ValueError, match="asset kind='weights' must be one of"):
    A.path("weights", "x")
  with pytest.raises(ValueError, match="plain file stem"):
    A.path("gates", "../x")
  with pytest.raises(ValueError, match="stored as .npz"):
    A.write_json("drafters", "x", {}, {}, root=tmp_path)


def test_drafter_asset_round_trip(tmp_path):
  import jax
  from flax import nnx

  from experiments.accel_tlt import drafter_arrays, drafter_from_asset
  from jaxsys.models import DecoderConfig
  from jaxsys.models.llm.drafter import DrafterConfig, EagleDrafter
  cfg = DecoderConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2)
  d = EagleDrafter(DrafterConfig.for_target(cfg, draft_vocab=16), rngs=nnx.Rngs(3))
  d.set_draft_vocab(np.arange(16) * 5)
  A.write_arrays("drafters", "tiny", drafter_arrays(d), {"draft_vocab": 16}, root=tmp_path)
  back = drafter_from_asset(str(A.path("drafters", "tiny", root=tmp_path)), cfg)
  for a, b in zip(jax.tree.leaves(nnx.state(d)), jax.tree.leaves(nnx.state(back))):
    np.testing.assert_allclose(np.asarray(b, np.float32), np.asarray(a, np.float32), rtol=1e-3, atol=1e-4)
  wider = DecoderConfig(vocab_size=96, hidden_size=64, intermediate_size=64, num_layers=1, num_heads=2)
  with pytest.raises(ValueError, match="has shape"):
    drafter_from_asset(str(A.path("drafters", "tiny", root=tmp_path)), wider)


# ----------------------------------------------------------------------------- jobs


@pytest.fixture
def tokenizer(smollm2_tokenizer, monkeypatch):
  """The stand-in's tokenizer from the session fixture (skips without the SmolLM2 file)."""
  from experiments import accel
  monkeypatch.setattr(accel, "_tokenizer", lambda: smollm2_tokenizer)
  return smollm2_tokenizer


def test_gates_job_smoke_writes_an_asset_the_serving_path_reads(tmp_path, tokenizer):
  from experiments import accel_gates
  from jaxsys.serving.streaming import StreamingGates
  assert accel_gates.main(["--smoke", "--out", str(tmp_path), "--seconds", "600"]) == 0
  gates = StreamingGates.load(A.path("gates", accel_gates.DEFAULT_NAME, root=tmp_path))
  s = A.settings("gates", accel_gates.DEFAULT_NAME, root=tmp_path)
  assert s["steps"] == 3 and s["batch_size"] == 2 and s["backend"] == "cpu" and len(gates.history) == 3
  rows = json.loads((tmp_path / "accel_gates" / "result.json").read_text())["rows"]
  assert rows[0]["ours"] == 3 and "documents/step" in rows[0]["note"]
  assert accel_gates.attempts(4, "auto") == [(4, "auto"), (4, "xla"), (2, "xla"), (1, "xla")]


def test_tlt_job_drives_the_experiment_and_ships_its_drafter(tmp_path, tokenizer, monkeypatch):
  """``_tlt_smollm2.run`` itself (minutes of compiling on CPU) is replaced by a stand-in that checks
  what the job hands it and writes what the experiment writes; ``--smoke`` runs the real one."""
  from flax import nnx

  from experiments import _tlt_smollm2 as T
  from experiments import accel_tlt
  from jaxsys.core.results import Row, write_result
  from jaxsys.models.llm.drafter import DrafterConfig, EagleDrafter
  from jaxsys.speculative.online import load_drafter, save_drafter
  seen = []

  def fake_run(out_dir, parts=None, seed=0, dtype="float32"):
    import jaxsys.models
    cfg = T._config(seed)
    model, _ = jaxsys.models.load_pretrained("smollm2-135m-instruct")
    assert cfg["warm_steps"] == accel_tlt.SMOKE["warm_steps"] and model.config.hidden_size == 64
    seen.append((parts, os.environ.get("JAXSYS_TLT_DRAFTER")))
    dcfg = DrafterConfig.for_target(model.config, draft_vocab=cfg["draft_vocab"])
    if parts == ("speedup",):
      save_drafter(f"{out_dir}/tlt_speedup/drafter_ckpt/smollm2_1", EagleDrafter(dcfg, rngs=nnx.Rngs(0)))
    else:
      load_drafter(os.environ["JAXSYS_TLT_DRAFTER"], dcfg)
    write_result("generate" if parts == ("speedup",) else "tlt_grpo", [Row("m", "x", ours=1.0)],
                 config=dict(cfg, draft_coverage=0.5), out_dir=out_dir)

  monkeypatch.setattr(T, "run", fake_run)
  out, work = tmp_path / "out", tmp_path / "work"
  assert accel_tlt.main(["--smoke", "--out", str(out), "--work", str(work), "--grpo-min-seconds", "0"]) == 0
  assert seen[0] == (("speedup",), None) and seen[1][0] == ("grpo",)
  assert seen[1][1].endswith("smollm2_1")
  asset = out / "drafters" / f"{accel_tlt.DEFAULT_NAME}.npz"
  assert A.settings("drafters", accel_tlt.DEFAULT_NAME, root=out)["draft_vocab"] == 64
  assert (out / "tlt_speedup" / "result.json").is_file() and (out / "tlt_grpo" / "result.json").is_file()
  # --phases grpo: the drafter comes from the asset
  assert accel_tlt.main(["--smoke", "--out", str(out), "--work", str(work), "--phases", "grpo",
                         "--drafter", str(asset), "--grpo-min-seconds", "0"]) == 0
  assert seen[2][1] == str(work / "drafter_from_asset")
  assert "JAXSYS_TLT_DRAFTER" not in os.environ and T._config is not None


# ----------------------------------------------------------------------------- runner


def test_runner_shares_the_budget_and_stops_an_overrunning_job(tmp_path, monkeypatch):
  from experiments import accel
  (tmp_path / "quick_job.py").write_text(
      "import sys\nprint('quick job ran with', sys.argv[1:], flush=True)\n")
  (tmp_path / "slow_job.py").write_text("import time\nprint('slow job started', flush=True)\ntime.sleep(60)\n")
  monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
  monkeypatch.setattr(accel, "JOBS", {"quick": ("quick_job", 1.0), "slow": ("slow_job", 1.0)})
  monkeypatch.setattr(accel, "GRACE", 1)
  monkeypatch.setattr(accel, "MIN_SHARE", 0)
  out = tmp_path / "out"
  summary = accel.run_jobs(["quick", "slow"], 6, out, smoke=True, extra=["--x", "1"])
  assert summary["quick"]["rc"] == 0 and summary["quick"]["share"] == 3  # half: equal weights
  assert summary["slow"]["rc"] == "stopped past its share" and 2 <= summary["slow"]["share"] <= 6
  log = (out / "accel.log").read_text()
  assert "'--smoke', '--x', '1'" in log and "slow job started" in log
  assert json.loads((out / "accel.json").read_text()) == summary


def test_runner_refuses_unknown_jobs(capsys):
  from experiments import accel
  with pytest.raises(SystemExit):
    accel.main(["--jobs", "gates,nope"])
  assert "each job must be one of" in capsys.readouterr().err


def test_collect_checks_and_places_what_came_back(tmp_path):
  from experiments import accel
  from jaxsys.serving.streaming import StreamingGates
  src = tmp_path / "files"
  g = StreamingGates.from_alpha(np.ones((1, 2)), sink=4, window=8, sparsity=0.5)
  made = {"model": accel.MODEL, "steps": 1}
  A.write_json("gates", "g8k", dataclasses.asdict(g), made, root=src)
  A.write_arrays("drafters", "d", {"w": np.ones(3, np.float16)}, made, root=src)
  (src / "accel_gates").mkdir()
  (src / "accel_gates" / "result.json").write_text("{}")
  done = accel.collect(src, package=tmp_path / "pkg", runs=tmp_path / "runs")
  assert len(done) == 3
  assert (tmp_path / "pkg" / "gates" / "g8k.json").is_file() and (tmp_path / "pkg" / "drafters" / "d.npz").is_file()
  assert (tmp_path / "runs" / "accel_gates" / "result.json").is_file()
  A.write_json("gates", "smoke", dataclasses.asdict(g), {"model": "smoke stand-in"}, root=src)
  with pytest.raises(ValueError, match="a --smoke run"):
    accel.collect(src, package=tmp_path / "pkg", runs=tmp_path / "runs")
  (src / "gates" / "smoke.json").unlink()
  (src / "gates" / "bad.json").write_text("{}")
  with pytest.raises(InputError, match="not a gates JSON"):
    accel.collect(src, package=tmp_path / "pkg", runs=tmp_path / "runs")


def test_carry_cli_refuses_a_bad_command():
  with pytest.raises(SystemExit):
    carry.main(["merge"])
  assert sys.modules["experiments.carry"] is carry
