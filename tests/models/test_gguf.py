"""GGUF reader/writer on tiny random decoders: round trips, parity with transformers' GGUF
loader, RoPE scaling metadata, tokenizer metadata copy, and bad files."""

import os

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxsys.models as M
from jaxsys.core.errors import ConfigError, InputError
from jaxsys.models.llm.interop import gguf as G
from jaxsys.nn.rope import RopeConfig

TOKENS = np.random.default_rng(0).integers(0, 96, (2, 11))


def _tiny(arch="llama", seed=0, **changes):
  """A random 2-layer decoder whose every parameter (norms and biases too) is non-trivial.

  Weights are drawn with numpy into an abstract model: no JAX kernels run, nothing compiles."""
  kw = dict(vocab_size=96, hidden_size=64, intermediate_size=80, num_layers=2, num_heads=4,
            num_kv_heads=2, rms_norm_eps=1e-5, max_position_embeddings=128, arch=arch,
            qkv_bias=arch == "qwen2")
  kw.update(changes)
  config = M.DecoderConfig(**kw)
  graphdef, state = nnx.split(nnx.eval_shape(lambda: M.Decoder(config, rngs=nnx.Rngs(0))))
  rng = np.random.default_rng(seed)

  def draw(path, s):
    base = 1.0 if any("norm" in str(p) for p in path) else 0.0
    return jnp.asarray(base + 0.2 * rng.standard_normal(s.shape), s.dtype)

  return nnx.merge(graphdef, jax.tree_util.tree_map_with_path(draw, state))


def _params(model):
  return {"/".join(map(str, k)): np.asarray(v) for k, v in
          nnx.to_flat_state(nnx.state(model, nnx.Param))}


def _logits(model):
  return np.asarray(model(jnp.asarray(TOKENS)))


def test_f32_round_trip_is_exact(tmp_path):
  # GQA, attention bias on q/k/v/o (permuted q/k biases), explicit head_dim != hidden/heads,
  # linear RoPE, untied head.
  model = _tiny(num_heads=4, num_kv_heads=2, head_dim=8, qkv_bias=True, o_bias=True,
                rope=RopeConfig(theta=500.0, kind="linear", factor=2.0), bos_token_id=1,
                eos_token_id=2)
  path = M.save_gguf(model, tmp_path / "m.gguf")
  back = M.from_gguf(path)
  # Token ids come from tokenizer metadata, which this file has none of.
  assert back.config == model.config.replace(bos_token_id=None, eos_token_id=None)
  want, got = _params(model), _params(back)
  assert want.keys() == got.keys()
  for k in want:  # equal config and weights: the same function
    np.testing.assert_array_equal(got[k], want[k], err_msg=k)


# (dtype, max error per matrix relative to its largest magnitude). down has rows of 80 values,
# not whole 32-blocks, so the block types write it f16 (as llama.cpp does).
QUANT_BOUNDS = {"f16": 1e-3, "bf16": 8e-3, "q8_0": 1 / 127, "q5_1": 1 / 31, "q5_0": 1 / 15,
                "q4_1": 1 / 15, "q4_0": 1 / 7}


@pytest.mark.parametrize("dtype", list(QUANT_BOUNDS))
def test_quantized_round_trip(dtype, tmp_path):
  model = _tiny("qwen2", tie_embeddings=True)
  path = M.save_gguf(model, tmp_path / f"m-{dtype}.gguf", dtype=dtype)
  types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
  want_type = "F16" if dtype == "f16" else dtype.upper()
  assert types["blk.0.attn_q.weight"] == want_type and types["token_embd.weight"] == want_type
  assert types["blk.0.ffn_down.weight"] == ("BF16" if dtype == "bf16" else "F16")
  assert types["blk.0.attn_norm.weight"] == types["blk.0.attn_q.bias"] == "F32"
  back = M.from_gguf(path)
  assert back.config == model.config
  want, got = _params(model), _params(back)
  for k in want:
    if want[k].ndim == 1:
      np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    else:
      err = np.abs(got[k] - want[k]).max() / np.abs(want[k]).max()
      assert err <= QUANT_BOUNDS[dtype], (k, err)


@pytest.mark.parametrize("rope", [
    RopeConfig(theta=1e4),
    RopeConfig(theta=1e4, kind="linear", factor=4.0),
    RopeConfig(theta=1e4, kind="yarn", factor=4.0, original_max_position_embeddings=32,
               beta_fast=16.0),
    RopeConfig(theta=5e5, kind="llama3", factor=8.0, original_max_position_embeddings=8192,
               low_freq_factor=1.0, high_freq_factor=4.0),
], ids=["default", "linear", "yarn", "llama3"])
def test_rope_scaling_round_trip(rope, tmp_path):
  model = _tiny(num_layers=1, head_dim=32, rope=rope, max_position_embeddings=4 * 8192)
  path = M.save_gguf(model, tmp_path / "m.gguf")
  assert M.config_from_gguf(path).rope == rope
  # llama3 factors live in a tensor that is config, not a weight of the model.
  names = {t.name for t in gguf.GGUFReader(path).tensors}
  assert ("rope_freqs.weight" in names) == (rope.kind == "llama3")
  assert M.from_gguf(path).config == model.config


@pytest.mark.parametrize("arch,changes", [
    ("llama", dict()),                                   # GQA, untied head
    ("llama", dict(head_dim=8, tie_embeddings=True)),    # head_dim != hidden / heads
    ("qwen2", dict(tie_embeddings=True, num_kv_heads=1)),  # qkv bias, not permuted
], ids=["llama_gqa", "llama_headdim_tied", "qwen2"])
def test_written_file_loads_in_transformers(arch, changes, tmp_path):
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  pytest.importorskip("accelerate")
  model = _tiny(arch, **changes)
  M.save_gguf(model, tmp_path / "m.gguf")
  hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="m.gguf",
                                                         dtype=torch.float32)
  hf.eval()
  assert hf.config.model_type == arch
  with torch.no_grad():
    ref = hf(torch.as_tensor(TOKENS)).logits.numpy()
  np.testing.assert_allclose(ref, _logits(model), atol=1e-4, rtol=0)


def _tokenizer_source(path):
  w = gguf.GGUFWriter(path, "llama")
  w.add_tokenizer_model("gpt2")
  w.add_tokenizer_pre("default")
  w.add_token_list([f"t{i}" for i in range(96)])
  w.add_token_types([1] * 96)
  w.add_token_merges(["t 1", "t 2"])
  w.add_bos_token_id(1)
  w.add_eos_token_id(2)
  w.add_pad_token_id(0)
  w.add_add_bos_token(False)
  w.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")
  _finish(w)
  return path


def _finish(w):
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()


def test_tokenizer_metadata_is_copied(tmp_path):
  src = _tokenizer_source(tmp_path / "src.gguf")
  path = M.save_gguf(_tiny(), tmp_path / "m.gguf", tokenizer=src)

  def tok_fields(p):
    r = gguf.GGUFReader(p)
    return {k: (f.types, G._value(f)) for k, f in r.fields.items() if k.startswith("tokenizer.")}

  want = tok_fields(src)
  assert len(want) == 10 and tok_fields(path) == want
  c = M.config_from_gguf(path)
  assert (c.bos_token_id, c.eos_token_id, c.pad_token_id) == (1, 2, 0)


def test_write_is_atomic(tmp_path, monkeypatch):
  path = tmp_path / "m.gguf"
  path.write_bytes(b"previous")

  def boom(self, *a, **k):
    raise OSError("disk full")

  monkeypatch.setattr(gguf.GGUFWriter, "write_tensors_to_file", boom)
  with pytest.raises(OSError, match="disk full"):
    M.save_gguf(_tiny(), path)
  assert path.read_bytes() == b"previous"
  assert os.listdir(tmp_path) == ["m.gguf"]


# ----------------------------------------------------------------------------- bad input


def _minimal(path, arch="llama", extra=None, tensors=()):
  """A GGUF with a 1-layer decoder's metadata and the given raw tensors."""
  w = gguf.GGUFWriter(path, arch)
  w.add_block_count(1)
  w.add_embedding_length(32)
  w.add_feed_forward_length(64)
  w.add_head_count(2)
  w.add_head_count_kv(2)
  w.add_layer_norm_rms_eps(1e-5)
  w.add_context_length(64)
  w.add_vocab_size(16)
  if extra is not None:
    extra(w)
  for name, data, raw in tensors:
    w.add_tensor(name, data, raw_dtype=raw)
  _finish(w)
  return path


def test_truncated_file(tmp_path):
  full = M.save_gguf(_tiny(), tmp_path / "full.gguf").read_bytes()
  for n, what in [(len(full) // 2, "truncated"), (40, "not a readable GGUF")]:
    cut = tmp_path / f"cut{n}.gguf"
    cut.write_bytes(full[:n])
    with pytest.raises(InputError, match=f"{cut.name}.*{what}"):
      M.from_gguf(cut)
  (tmp_path / "junk.gguf").write_bytes(b"not gguf at all" * 10)
  with pytest.raises(InputError, match="junk.gguf"):
    M.from_gguf(tmp_path / "junk.gguf")
  with pytest.raises(InputError, match="missing.gguf does not exist"):
    M.from_gguf(tmp_path / "missing.gguf")


def test_unsupported_tensor_type(tmp_path):
  block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q8_1]
  raw = np.zeros((16, 32 // block * size), np.uint8)
  path = _minimal(tmp_path / "q81.gguf",
                  tensors=[("token_embd.weight", raw, gguf.GGMLQuantizationType.Q8_1)])
  with pytest.raises(InputError, match="q81.gguf.*'token_embd.weight'.*Q8_1"):
    M.from_gguf(path)
  ints = _minimal(tmp_path / "i32.gguf", tensors=[("token_embd.weight", np.zeros((16, 32), np.int32),
                                                   None)])
  with pytest.raises(InputError, match="I32"):
    M.from_gguf(ints)


def test_unsupported_architecture_and_rope(tmp_path):
  with pytest.raises(ConfigError, match="general.architecture='gpt2' is not supported"):
    M.from_gguf(_minimal(tmp_path / "gpt2.gguf", arch="gpt2"))
  weird = _minimal(tmp_path / "rope.gguf",
                   extra=lambda w: w.add_string("llama.rope.scaling.type", "longrope"))
  with pytest.raises(ConfigError, match="scaling.type='longrope'"):
    M.from_gguf(weird)
  unknown = _minimal(tmp_path / "rope2.gguf",
                     extra=lambda w: w.add_float32("llama.rope.scaling.short_factor", 2.0))
  with pytest.raises(ConfigError, match="short_factor"):
    M.from_gguf(unknown)
  partial = _minimal(tmp_path / "rot.gguf", extra=lambda w: w.add_rope_dimension_count(8))
  with pytest.raises(ConfigError, match="rope.dimension_count=8"):
    M.from_gguf(partial)
  with pytest.raises(InputError, match="lacks the metadata key 'llama.feed_forward_length'"):
    w = gguf.GGUFWriter(tmp_path / "bare.gguf", "llama")
    w.add_embedding_length(32)
    w.add_head_count(2)
    _finish(w)
    M.from_gguf(tmp_path / "bare.gguf")


def test_missing_weight_is_named(tmp_path):
  path = _minimal(tmp_path / "partial.gguf",
                  tensors=[("token_embd.weight", np.zeros((16, 32), np.float32), None)])
  with pytest.raises(InputError, match=r"partial.gguf lacks the tensors \['blk.0.attn_k.weight'"):
    M.from_gguf(path)
  extra = _minimal(tmp_path / "extra.gguf", tensors=[
      ("blk.0.attn_qkv.weight", np.zeros((96, 32), np.float32), None)])
  with pytest.raises(InputError, match=r"does not use \['blk.0.attn_qkv.weight'\]"):
    M.from_gguf(extra)


def test_unwritable_configs(tmp_path):
  with pytest.raises(ConfigError, match="dtype='q3_k' must be one of"):
    M.save_gguf(_tiny(), tmp_path / "m.gguf", dtype="q3_k")
  with pytest.raises(ConfigError, match="sliding_window=8"):
    M.save_gguf(_tiny("mistral", sliding_window=8), tmp_path / "m.gguf")
  odd_llama3 = RopeConfig(theta=1e4, kind="llama3", factor=8.0, original_max_position_embeddings=64)
  with pytest.raises(ConfigError, match="llama3 rope needs"):
    M.save_gguf(_tiny(head_dim=16, rope=odd_llama3), tmp_path / "m.gguf")
  assert not list(tmp_path.iterdir())


def test_bad_head_count_and_non_finite_weights(tmp_path):
  """``head_count=0`` was a ZeroDivisionError (also through ``jaxsys serve --model``); NaN
  weights loaded silently. Both are ``InputError`` naming the key or tensor now."""
  w = gguf.GGUFWriter(tmp_path / "zero.gguf", "llama")
  for add, v in ((w.add_block_count, 1), (w.add_embedding_length, 32), (w.add_feed_forward_length, 64),
                 (w.add_head_count, 0), (w.add_head_count_kv, 0), (w.add_layer_norm_rms_eps, 1e-5),
                 (w.add_context_length, 64), (w.add_vocab_size, 16)):
    add(v)
  _finish(w)
  with pytest.raises(InputError, match="head_count=0 must be a positive integer"):
    M.from_gguf(tmp_path / "zero.gguf")
  path = M.save_gguf(_tiny(), tmp_path / "m.gguf")
  t = next(t for t in gguf.GGUFReader(path).tensors if t.name == "blk.1.ffn_up.weight")
  raw = bytearray(path.read_bytes())
  raw[t.data_offset:t.data_offset + 4] = np.float32(np.nan).tobytes()
  path.write_bytes(bytes(raw))
  with pytest.raises(InputError, match="blk.1.ffn_up.weight.*1 non-finite"):
    M.from_gguf(path)
  loaded = _params(M.from_gguf(path, allow_nonfinite=True))  # the documented escape hatch
  assert sum(int((~np.isfinite(v)).sum()) for v in loaded.values()) == 1


def _byte_level_gguf(path, pre):
  """Tokenizer metadata only: the 256-byte alphabet, a few merges, two CONTROL tokens and one
  USER_DEFINED token, split rule ``pre``."""
  from jaxsys.models.llm.interop.tokenizer import bytes_to_unicode
  alphabet = list(bytes_to_unicode().values())
  merges = ["Ġ t", "h e", "Ġt he", "1 2", "12 3", "Ġ Ġ", "ĠĠ Ġ", "' s"]
  tokens = alphabet + [m.replace(" ", "") for m in merges] + ["<|endoftext|>", "<|im_end|>", "<think>"]
  w = gguf.GGUFWriter(path, "llama")
  w.add_tokenizer_model("gpt2")
  w.add_tokenizer_pre(pre)
  w.add_token_list(tokens)
  w.add_token_types([1] * (len(tokens) - 3) + [3, 3, 4])
  w.add_token_merges(merges)
  w.add_bos_token_id(len(tokens) - 3)
  w.add_eos_token_id(len(tokens) - 2)
  w.add_add_bos_token(False)
  _finish(w)
  return path


@pytest.mark.parametrize("pre", ["default", "llama-bpe", "qwen2"])
def test_byte_level_tokenizers_match_transformers(pre, tmp_path):
  """The torch-free tokenizer gives transformers' ids for each split rule it knows (digit runs, contractions,
  whitespace runs, non-ASCII, special and user-defined tokens tell the rules apart)."""
  pytest.importorskip("torch")  # transformers reads GGUF tokenizers only with torch
  from transformers import AutoTokenizer
  path = _byte_level_gguf(tmp_path / f"{pre}.gguf", pre)
  ours = G.load_tokenizer(path, cache=False)
  ref = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
  texts = ["the 1234567 theme's 12 3", "  the\n\n\t  the   ", "Café naïve 日本 😀", "x<|im_end|>y<think>z",
           "it's THE end.\r\n"]
  for text in texts:
    assert ours(text)["input_ids"] == ref(text)["input_ids"], (pre, text)
    ids = ref(text)["input_ids"]
    assert ours.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True)
  assert (len(ours), ours.eos_token_id, ours.bos_token_id) == (len(ref), ref.eos_token_id, ref.bos_token_id)


def test_unsupported_tokenizers_are_named(tmp_path):
  path = _byte_level_gguf(tmp_path / "odd.gguf", "some-new-pre")
  with pytest.raises(ConfigError, match="tokenizer.ggml.pre='some-new-pre' is not supported"):
    G.load_tokenizer(path, cache=False)
  w = gguf.GGUFWriter(tmp_path / "t5.gguf", "llama")
  w.add_tokenizer_model("t5")
  w.add_token_list(["<unk>", "a"])
  _finish(w)
  with pytest.raises(ConfigError, match="tokenizer.ggml.model='t5' is not supported"):
    G.load_tokenizer(tmp_path / "t5.gguf", cache=False)


def _sentencepiece_gguf(path, with_merges: bool):
  """A sentencepiece (``llama``) vocabulary: UNKNOWN/CONTROL tokens, the 256 byte tokens, word pieces
  with scores (merges recovered from them unless the file lists its own)."""
  pieces = ["▁", "t", "h", "e", "a", "c", "1", "2", "he", "▁t", "▁the", "▁c", "at", "▁cat", "12", "▁a"]
  tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
  types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
  scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))]
  w = gguf.GGUFWriter(path, "llama")
  w.add_tokenizer_model("llama")
  w.add_token_list(tokens)
  w.add_token_types(types)
  w.add_token_scores(scores)
  if with_merges:
    w.add_token_merges(["h e", "▁ t", "▁t he", "▁ c", "a t", "▁c at", "1 2", "▁ a"])
  w.add_bos_token_id(1)
  w.add_eos_token_id(2)
  w.add_unk_token_id(0)
  _finish(w)
  return path


@pytest.mark.parametrize("with_merges", [False, True])
def test_sentencepiece_tokenizer_matches_transformers(with_merges, tmp_path):
  pytest.importorskip("torch")
  from transformers import AutoTokenizer
  path = _sentencepiece_gguf(tmp_path / "spm.gguf", with_merges)
  ours = G.load_tokenizer(path, cache=False)
  ref = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
  for text in ["the cat", " the  cat", "a12\ncat", "日本 é", "<s>the</s> cat", ""]:
    ids = ref(text)["input_ids"]
    assert ours(text)["input_ids"] == ids, text
    for skip in (False, True):
      assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip), text
  assert (len(ours), ours.bos_token_id, ours.eos_token_id, ours.unk_token_id) == \
      (len(ref), ref.bos_token_id, ref.eos_token_id, ref.unk_token_id)


def _same_header(path):
  """The one-pass header reader against gguf's GGUFReader: every field, array length and tensor."""
  from jaxsys.models.llm.interop import _gguf_header as H
  header, reader = H.read_header(path, skipped=G._TOKEN_ARRAYS), gguf.GGUFReader(path)
  assert header.meta == G._metadata(reader)
  assert header.lengths == {k: len(f.data) for k, f in reader.fields.items()
                            if f.types[0] == gguf.GGUFValueType.ARRAY}
  assert [t.name for t in header.tensors] == [t.name for t in reader.tensors]
  for ours, ref in zip(header.tensors, reader.tensors):
    assert (ours.tensor_type, ours.n_elements, ours.n_bytes, ours.data_offset) == (
        ref.tensor_type, ref.n_elements, ref.n_bytes, ref.data_offset), ref.name
    np.testing.assert_array_equal(ours.shape, ref.shape)
    assert ours.data.dtype == ref.data.dtype and ours.data.shape == ref.data.shape, ref.name
    np.testing.assert_array_equal(ours.data, ref.data)


@pytest.mark.parametrize("dtype", ["f32", "bf16", "q8_0"])
def test_header_reader_matches_gguf_on_written_files(dtype, tmp_path):
  model = _tiny(rope=RopeConfig(theta=500.0, kind="linear", factor=2.0), bos_token_id=1)
  _same_header(M.save_gguf(model, tmp_path / "m.gguf", dtype=dtype))


def test_header_reader_matches_gguf_on_the_shipped_model(smollm2_path):
  _same_header(smollm2_path)  # 49K tokens and merges skipped, Q4_1 / F32 tensors
