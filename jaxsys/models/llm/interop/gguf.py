"""GGUF interop for the decoder LM: read llama.cpp files into a :class:`Decoder`, write them back.

* :func:`from_gguf` reads a GGUF file (``llama`` or ``qwen2`` architecture) with the ``gguf``
  package and dequantizes every tensor to float (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0,
  the K-quants Q2_K..Q6_K, and whatever else :func:`gguf.quants.dequantize` implements).
* :func:`load_tokenizer` builds the tokenizer stored in the same file, chat template included
  (:class:`jaxsys.models.llm.interop.tokenizer.Tokenizer`: the ``tokenizers`` library and jinja2, no torch), and
  caches it under ``$JAXSYS_HOME/tokenizers``.
* :func:`save_gguf` writes a GGUF (``f32``, ``f16``, ``bf16``, ``q8_0``, ``q5_1``, ``q5_0``,
  ``q4_1``, ``q4_0``) that llama.cpp tools and
  ``transformers`` (``from_pretrained(dir, gguf_file=...)``) load, e.g. to serve a fine-tune;
  ``tokenizer=`` copies the tokenizer metadata of a source GGUF into it.

Usage::

  model = jaxsys.models.from_gguf("SmolLM2-135M-Instruct.Q4_1.gguf")          # float32
  tok = jaxsys.models.llm.interop.gguf.load_tokenizer("SmolLM2-135M-Instruct.Q4_1.gguf")
  jaxsys.models.save_gguf(model, "tuned.gguf", dtype="q8_0", tokenizer="SmolLM2-135M-Instruct.Q4_1.gguf")

Layout (llama.cpp conventions):

* Tensor names are llama.cpp's (``token_embd``, ``blk.N.attn_q``, ``blk.N.ffn_gate``, ...); each
  maps one to one onto a Hugging Face name, and the weights go through
  :func:`jaxsys.models.llm.interop.hf.load_state_dict`, so placement and shape checks are the HF path's.
* ggml lists dimensions fastest-first: a tensor of ggml shape ``[ne0=in, ne1=out]`` is the
  row-major ``[out, in]`` matrix of the HF checkpoint.
* For the ``llama`` architecture llama.cpp's converter permutes the rows of Q and K (and of their
  biases): within each head the rotary halves ``[x_0..x_{d/2-1} | x_{d/2}..x_{d-1}]`` of the
  "rotate half" layout are interleaved into pairs ``(x_0, x_{d/2}), (x_1, x_{d/2+1}), ...`` for
  its adjacent-pair RoPE. Reading undoes it, writing redoes it. ``qwen2`` files are not permuted.
* RoPE scaling: ``{arch}.rope.scaling.type`` linear / yarn, and Llama-3 frequency scaling stored
  as the ``rope_freqs.weight`` tensor of per-frequency divisors.

Bad files raise errors naming the file: missing or truncated (``InputError``), an architecture
or RoPE scaling the decoder does not implement (``ConfigError``), a tensor type the ``gguf``
package cannot dequantize (``InputError`` naming the tensor and type).
"""

from __future__ import annotations

import functools
import os
import re
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf as gg
import jax.numpy as jnp
import numpy as np

from jaxsys.core.errors import ConfigError, InputError
from jaxsys.models.llm._decoder_config import DecoderConfig
from jaxsys.models.llm.interop._gguf_header import Header, TruncatedError, read_header, to_python
from jaxsys.models.llm.interop._hf_config import ARCH_CLASSES, config_from_hf, config_to_hf
from jaxsys.models.llm.decoder import Decoder
from jaxsys.models.llm.interop.hf import _weight_map, _with_dtype, hf_state_dict, load_state_dict
from jaxsys.nn.rope import RopeConfig, inv_frequencies

__all__ = ["from_gguf", "save_gguf", "load_tokenizer", "config_from_gguf", "READ_ARCHS",
           "WRITE_DTYPES"]

#: GGUF architectures :func:`from_gguf` reads (``general.architecture``).
READ_ARCHS = ("llama", "qwen2")
_GT = gg.GGMLQuantizationType
_VT = gg.GGUFValueType

#: Matrix encodings :func:`save_gguf` writes: ``dtype -> (tensor type, llama.cpp file type)``
#: (the block types are the ones gguf-py can quantize).
_WRITE_TYPES = {
    "f32": (_GT.F32, gg.LlamaFileType.ALL_F32), "f16": (_GT.F16, gg.LlamaFileType.MOSTLY_F16),
    "bf16": (_GT.BF16, gg.LlamaFileType.MOSTLY_BF16), "q8_0": (_GT.Q8_0, gg.LlamaFileType.MOSTLY_Q8_0),
    "q5_1": (_GT.Q5_1, gg.LlamaFileType.MOSTLY_Q5_1), "q5_0": (_GT.Q5_0, gg.LlamaFileType.MOSTLY_Q5_0),
    "q4_1": (_GT.Q4_1, gg.LlamaFileType.MOSTLY_Q4_1), "q4_0": (_GT.Q4_0, gg.LlamaFileType.MOSTLY_Q4_0),
}
WRITE_DTYPES = tuple(_WRITE_TYPES)

_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight",
                 "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}
_BLOCK_NAMES = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
                "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
                "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
                "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_HF_BLOCK_RE = re.compile(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)")
_TO_GGUF_BLOCK = {v: k for k, v in _BLOCK_NAMES.items()}
_TO_GGUF_GLOBAL = {v: k for k, v in _GLOBAL_NAMES.items()}
_ROPE_FREQS = "rope_freqs.weight"

# Metadata holding the vocabulary: large arrays, never needed whole for the model config.
_TOKEN_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type",
                 "tokenizer.ggml.scores")
# rope.scaling.* keys understood by the reader (others would change the positions).
_ROPE_SCALING_KEYS = {"type", "factor", "original_context_length", "finetuned", "yarn_beta_fast",
                      "yarn_beta_slow", "attn_factor"}
# Llama-3.1+ frequency-scaling constants: GGUF keeps only the resulting per-frequency factors,
# which the reader matches against these (every Llama 3.x release uses them).
_LLAMA3_LOW, _LLAMA3_HIGH, _LLAMA3_ORIGINAL = 1.0, 4.0, 8192


def _hf_name(name: str) -> str:
  """The Hugging Face name of a llama.cpp tensor name (unknown names are returned unchanged,
  so the state-dict check reports them as unexpected weights)."""
  if name in _GLOBAL_NAMES:
    return _GLOBAL_NAMES[name]
  m = _BLOCK_RE.fullmatch(name)
  if m and m.group(2) in _BLOCK_NAMES:
    return f"model.layers.{m.group(1)}.{_BLOCK_NAMES[m.group(2)]}.{m.group(3)}"
  return name


def _gguf_name(hf_name: str) -> str:
  if hf_name in _TO_GGUF_GLOBAL:
    return _TO_GGUF_GLOBAL[hf_name]
  m = _HF_BLOCK_RE.fullmatch(hf_name)
  if not m or m.group(2) not in _TO_GGUF_BLOCK:
    raise ConfigError(f"weight {hf_name!r} has no llama.cpp tensor name")
  return f"blk.{m.group(1)}.{_TO_GGUF_BLOCK[m.group(2)]}.{m.group(3)}"


def _interleave_rows(w: np.ndarray, n_head: int) -> np.ndarray:
  """HF -> GGUF: per head, rows [half 0 | half 1] become pairs (h0[i], h1[i]). w [n_head*hd, ...]."""
  half = w.shape[0] // n_head // 2
  return w.reshape(n_head, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _deinterleave_rows(w: np.ndarray, n_head: int) -> np.ndarray:
  """GGUF -> HF: the inverse of :func:`_interleave_rows`."""
  half = w.shape[0] // n_head // 2
  return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _permuted_heads(arch: str, hf_name: str, config: DecoderConfig) -> int | None:
  """Heads whose rows llama.cpp interleaved in ``hf_name`` (None: not permuted)."""
  if arch != "llama":
    return None
  if ".self_attn.q_proj." in hf_name:
    return config.num_heads
  if ".self_attn.k_proj." in hf_name:
    return config.num_kv_heads
  return None


# ----------------------------------------------------------------------------- reading


def _open(path: str | os.PathLike):
  """A ``GGUFReader`` over ``path``; ``InputError`` naming the file if it is missing, not GGUF,
  or shorter than its tensor table says (a partial download)."""
  path = Path(path)
  if not path.is_file():
    raise InputError(f"{path} does not exist (expected a GGUF file)")
  try:
    reader = gg.GGUFReader(path)
  except (ValueError, IndexError, KeyError, OverflowError, UnicodeDecodeError, OSError) as e:
    raise InputError(f"{path} is not a readable GGUF file (truncated or corrupt): {e}") from e
  size = path.stat().st_size
  for t in reader.tensors:
    end = int(t.data_offset) + int(t.n_bytes)
    if end > size:
      raise InputError(f"{path} is truncated: tensor {t.name!r} ends at byte {end} but the file "
                       f"has {size} bytes")
  return reader


def _scalar(part: np.ndarray, vtype) -> Any:
  if vtype == _VT.STRING:
    return bytes(part).decode("utf-8")
  v = part.tolist()
  return to_python(v[0] if isinstance(v, list) else v, vtype)


def _value(field) -> Any:
  """A metadata field as a Python value (arrays as lists; nested arrays are not needed here)."""
  if field.types[0] == _VT.ARRAY:
    return [_scalar(field.parts[i], field.types[-1]) for i in field.data]
  return _scalar(field.parts[field.data[0]], field.types[0])


def _metadata(reader) -> dict[str, Any]:
  return {k: _value(f) for k, f in reader.fields.items() if k not in _TOKEN_ARRAYS}


def _header(path: str | os.PathLike) -> Header:
  """The metadata (token arrays skipped), array lengths and tensor table of ``path``: one pass
  over the header (``_gguf_header``), or ``GGUFReader`` for files that reader leaves to it.
  ``InputError`` naming the file as :func:`_open` raises it."""
  path = Path(path)
  if not path.is_file():
    raise InputError(f"{path} does not exist (expected a GGUF file)")
  try:
    header = read_header(path, skipped=_TOKEN_ARRAYS)
  except TruncatedError as e:
    raise InputError(f"{path} is truncated: {e}") from e
  except (ValueError, IndexError, KeyError, OverflowError, UnicodeDecodeError, OSError, struct.error) as e:
    raise InputError(f"{path} is not a readable GGUF file (truncated or corrupt): {e}") from e
  if header is not None:
    return header
  reader = _open(path)
  lengths = {k: len(f.data) for k, f in reader.fields.items() if f.types[0] == _VT.ARRAY}
  return Header(_metadata(reader), lengths, list(reader.tensors))


@functools.cache
def _can_dequantize(qtype) -> bool:
  if qtype in (_GT.F32, _GT.F16):
    return True
  _, type_size = gg.GGML_QUANT_SIZES[qtype]
  try:
    gg.quants.dequantize(np.zeros((1, type_size), np.uint8), qtype)
  except NotImplementedError:
    return False
  return True


def _supported_types() -> list[str]:
  return [t.name for t in _GT if t in gg.GGML_QUANT_SIZES and _can_dequantize(t)]


class _LazyTensor:
  """A GGUF tensor as ``load_state_dict`` takes it: HF shape known up front, data on ``load()``."""
  is_float = True

  def __init__(self, tensor, shape: tuple[int, ...], interleaved_heads: int | None,
               allow_nonfinite: bool = False):
    self._t, self.shape, self._heads = tensor, shape, interleaved_heads
    self._allow_nonfinite = allow_nonfinite

  def load(self) -> np.ndarray:
    w = np.asarray(gg.quants.dequantize(self._t.data, self._t.tensor_type), np.float32)
    w = w.reshape(self.shape)
    if not self._allow_nonfinite and not np.isfinite(w).all():
      bad = int(w.size - np.isfinite(w).sum())
      raise InputError(f"tensor {self._t.name!r} has {bad} non-finite values (NaN or inf); a model "
                       "that loads them answers garbage (from_gguf(..., allow_nonfinite=True) loads it anyway)")
    return w if self._heads is None else _deinterleave_rows(w, self._heads)


def _need(meta: dict[str, Any], key: str, path: Path):
  if key not in meta:
    raise InputError(f"{path} lacks the metadata key {key!r}")
  return meta[key]


def _rope_parameters(meta, arch, tensors, path: Path, head_dim: int) -> dict[str, Any]:
  p = f"{arch}.rope."
  params: dict[str, Any] = {"rope_type": "default",
                            "rope_theta": float(meta.get(p + "freq_base", 10000.0))}
  scaling = {k[len(p + "scaling."):]: v for k, v in meta.items() if k.startswith(p + "scaling.")}
  unknown = sorted(set(scaling) - _ROPE_SCALING_KEYS)
  if unknown:
    raise ConfigError(f"{path.name}: RoPE scaling keys {[p + 'scaling.' + k for k in unknown]} are "
                      "not supported; they would change the model's positions")
  if scaling.get("attn_factor", 1.0) != 1.0:
    raise ConfigError(f"{path.name}: {p}scaling.attn_factor={scaling['attn_factor']} is not supported "
                      "(only 1.0)")
  kind = scaling.get("type", "none")
  if p + "scale_linear" in meta:  # the older spelling of linear scaling
    kind, scaling["factor"] = "linear", meta[p + "scale_linear"]
  if kind == "linear":
    params.update(rope_type="linear", factor=float(_need(meta, p + "scaling.factor", path)))
  elif kind == "yarn":
    params.update(rope_type="yarn", factor=float(_need(meta, p + "scaling.factor", path)),
                  original_max_position_embeddings=int(
                      _need(meta, p + "scaling.original_context_length", path)))
    for key in ("beta_fast", "beta_slow"):
      if "yarn_" + key in scaling:
        params[key] = float(scaling["yarn_" + key])
  elif kind != "none":
    raise ConfigError(f"{path.name}: {p}scaling.type={kind!r} is not supported (none, linear, yarn)")
  if _ROPE_FREQS in tensors:
    if kind != "none":
      raise ConfigError(f"{path.name}: {_ROPE_FREQS} together with {p}scaling.type={kind!r} is not "
                        "supported")
    params.update(_llama3_from_factors(tensors[_ROPE_FREQS], params["rope_theta"], head_dim, path))
  return params


def _llama3_rope(theta: float, factor: float) -> RopeConfig:
  return RopeConfig(theta=theta, kind="llama3", factor=factor, low_freq_factor=_LLAMA3_LOW,
                    high_freq_factor=_LLAMA3_HIGH, original_max_position_embeddings=_LLAMA3_ORIGINAL)


def _rope_divisors(rope: RopeConfig, head_dim: int) -> np.ndarray:
  """llama.cpp's ``rope_freqs`` for ``rope``: unscaled / scaled inverse frequency, [head_dim/2]."""
  plain, _ = inv_frequencies(RopeConfig(theta=rope.theta), head_dim)
  scaled, _ = inv_frequencies(rope, head_dim)
  return (plain / scaled).astype(np.float32)


def _llama3_from_factors(tensor, theta: float, head_dim: int, path: Path) -> dict[str, Any]:
  factors = np.asarray(gg.quants.dequantize(tensor.data, tensor.tensor_type), np.float32).ravel()
  if factors.shape != (head_dim // 2,):
    raise InputError(f"{path.name}: {_ROPE_FREQS} has {factors.size} entries, expected "
                     f"head_dim/2={head_dim // 2}")
  rope = _llama3_rope(theta, float(factors.max()))
  if not np.allclose(factors, _rope_divisors(rope, head_dim), rtol=1e-4, atol=1e-5):
    raise ConfigError(f"{path.name}: {_ROPE_FREQS} is not Llama-3 frequency scaling (low_freq_factor="
                      f"{_LLAMA3_LOW}, high_freq_factor={_LLAMA3_HIGH}, original_max_position_embeddings"
                      f"={_LLAMA3_ORIGINAL}); other per-frequency RoPE factors are not supported")
  return {"rope_type": "llama3", "factor": rope.factor, "low_freq_factor": _LLAMA3_LOW,
          "high_freq_factor": _LLAMA3_HIGH, "original_max_position_embeddings": _LLAMA3_ORIGINAL}


def _config(header: Header, path: Path) -> DecoderConfig:
  meta = header.meta
  arch = meta.get("general.architecture")
  if arch not in READ_ARCHS:
    raise ConfigError(f"{path.name}: general.architecture={arch!r} is not supported; from_gguf reads "
                      f"{list(READ_ARCHS)}")
  tensors = {t.name: t for t in header.tensors}
  p = arch + "."
  hidden, heads, ffn, layers, eps = (_need(meta, p + k, path) for k in (
      "embedding_length", "attention.head_count", "feed_forward_length", "block_count",
      "attention.layer_norm_rms_epsilon"))
  kv = meta.get(p + "attention.head_count_kv", heads)
  if isinstance(kv, list):  # per-layer counts; one value is all the decoder supports
    if len(set(kv)) != 1:
      raise ConfigError(f"{path.name}: per-layer {p}attention.head_count_kv={kv} is not supported")
    kv = kv[0]
  for key, value in (("embedding_length", hidden), ("attention.head_count", heads),
                     ("feed_forward_length", ffn), ("block_count", layers),
                     ("attention.head_count_kv", kv)):
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
      raise InputError(f"{path.name}: metadata {p}{key}={value!r} must be a positive integer")
  head_dim = meta.get(p + "attention.key_length") or hidden // heads
  for key in ("attention.value_length", "rope.dimension_count"):
    if meta.get(p + key, head_dim) != head_dim:
      raise ConfigError(f"{path.name}: {p}{key}={meta[p + key]} differs from the head size {head_dim} "
                        "(partial rotary or a different value size is not supported)")
  vocab = meta.get(p + "vocab_size")
  if vocab is None:
    vocab = header.lengths.get("tokenizer.ggml.tokens")
  if vocab is None:
    raise InputError(f"{path} has neither {p}vocab_size nor tokenizer.ggml.tokens")
  d = {"model_type": arch, "architectures": [ARCH_CLASSES[arch]], "vocab_size": vocab,
       "hidden_size": hidden, "intermediate_size": ffn, "num_hidden_layers": layers,
       "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": head_dim,
       "rms_norm_eps": float(eps),
       "max_position_embeddings": meta.get(p + "context_length", 2048),
       "rope_parameters": _rope_parameters(meta, arch, tensors, path, head_dim),
       "tie_word_embeddings": "output.weight" not in tensors,
       "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
       "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
       "pad_token_id": meta.get("tokenizer.ggml.padding_token_id")}
  if arch == "llama":
    d["attention_bias"] = "blk.0.attn_q.bias" in tensors
  return config_from_hf(d)


def config_from_gguf(path: str | os.PathLike) -> DecoderConfig:
  """The :class:`DecoderConfig` described by a GGUF file's metadata (no tensor data is read)."""
  return _config(_header(path), Path(path))


def from_gguf(path: str | os.PathLike, dtype=jnp.float32, *, attention_fn: Callable | None = None,
              allow_nonfinite: bool = False, **config_changes) -> Decoder:
  """Loads a llama / qwen2 GGUF file into a :class:`Decoder`, dequantizing every tensor.

  ``dtype`` sets parameters and activations (float32, bfloat16, float16); ``config_changes``
  override DecoderConfig fields that do not change shapes (e.g. ``rope=``). The metadata's sizes
  must be positive integers and every weight finite (``InputError`` naming the key or tensor;
  ``allow_nonfinite=True`` loads NaN/inf weights anyway).
  """
  path = Path(path)
  header = _header(path)
  config = _with_dtype(_config(header, path), dtype)
  if config_changes:
    config = config.replace(**config_changes)
  tensors = {}
  for t in header.tensors:
    if t.name == _ROPE_FREQS:  # read into config.rope above
      continue
    if not _can_dequantize(t.tensor_type):
      raise InputError(f"{path.name}: tensor {t.name!r} has type {t.tensor_type.name}, which gguf "
                       f"cannot dequantize; supported: {_supported_types()}")
    name = _hf_name(t.name)
    shape = tuple(int(s) for s in reversed(t.shape.tolist()))  # ggml is fastest-dimension first
    tensors[name] = _LazyTensor(t, shape, _permuted_heads(config.arch, name, config), allow_nonfinite)
  expected = set(_weight_map(config))
  missing = sorted(_gguf_name(n) for n in expected - set(tensors))
  extra = sorted(t.name for t in header.tensors if t.name != _ROPE_FREQS and _hf_name(t.name) not in expected)
  # Unexpected names first: a fused or renamed tensor (e.g. attn_qkv) explains the missing ones.
  for what, names in (("has tensors the config does not use", extra), ("lacks the tensors", missing)):
    if names:
      raise InputError(f"{path.name} {what} {names[:8]}{' ...' if len(names) > 8 else ''}")
  return load_state_dict(config, tensors, attention_fn=attention_fn)


def load_tokenizer(path: str | os.PathLike, *, cache: bool = True):
  """The :class:`~jaxsys.models.llm.interop.tokenizer.Tokenizer` (with its chat template) stored in a GGUF file.

  Built from the ``tokenizer.*`` metadata with the ``tokenizers`` library; no torch, no
  ``transformers``. Parsing the metadata of a large vocabulary takes seconds, so with ``cache`` the
  built tokenizer is saved once under ``$JAXSYS_HOME/tokenizers/`` (``save_pretrained``'s files,
  keyed by the file's path, size and mtime and the ``tokenizers`` version; written to a temporary
  folder and renamed into place) and later loads read it back. A copy that does not load, or a
  cache that cannot be written, falls back to building from the file.
  """
  from jaxsys.models.llm.interop.tokenizer import Tokenizer  # noqa: PLC0415
  path = Path(path)
  folder = _tokenizer_cache_folder(path) if cache else None
  if folder is not None and (tok := _read_cached_tokenizer(folder)) is not None:
    return tok
  reader = _open(path)
  meta = {k: _value(f) for k, f in reader.fields.items() if k.startswith("tokenizer.")}
  try:
    tok = Tokenizer.from_gguf_metadata(meta)
  except (ConfigError, InputError) as e:
    raise type(e)(f"{path.name}: {e}") from e
  if folder is not None:
    _write_cached_tokenizer(folder, tok)
  return tok


# Bumped when the way a tokenizer is built from GGUF metadata changes (old cached copies are then unused).
_TOKENIZER_FORMAT = 2


def _tokenizer_cache_folder(path: Path) -> Path:
  import hashlib  # noqa: PLC0415
  import json  # noqa: PLC0415

  import tokenizers  # noqa: PLC0415

  from jaxsys.models.llm.interop.pretrained import cache_dir  # noqa: PLC0415  (pretrained imports this module)
  st = path.resolve().stat()
  key = json.dumps([str(path.resolve()), st.st_size, st.st_mtime_ns, tokenizers.__version__, _TOKENIZER_FORMAT])
  return cache_dir() / "tokenizers" / f"{path.stem}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def _read_cached_tokenizer(folder: Path):
  from jaxsys.models.llm.interop.tokenizer import Tokenizer  # noqa: PLC0415
  if not (folder / "tokenizer.json").is_file():
    return None
  try:
    return Tokenizer.from_folder(folder)
  except Exception:  # noqa: BLE001 - a damaged copy (any parse error of the Rust library): build again
    return None


def _write_cached_tokenizer(folder: Path, tok) -> None:
  import shutil  # noqa: PLC0415
  import tempfile  # noqa: PLC0415
  try:
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
  except OSError:  # a read-only cache: every load builds
    return
  try:
    tok.save_pretrained(tmp)
    if folder.exists():  # a damaged copy (the read above refused it)
      shutil.rmtree(folder, ignore_errors=True)
    os.replace(tmp, folder)
  except OSError:  # another process renamed its copy first, or the disk is full
    pass
  finally:
    shutil.rmtree(tmp, ignore_errors=True)


# ----------------------------------------------------------------------------- writing


def _gguf_arch(c: DecoderConfig) -> str:
  config_to_hf(c)  # the same representability checks as save_pretrained (bias layout, windows)
  if c.sliding_window is not None:  # llama.cpp's llama / qwen2 graphs attend to the full context
    raise ConfigError(f"sliding_window={c.sliding_window} cannot be written to GGUF (its llama and "
                      "qwen2 architectures have no sliding window)")
  return "qwen2" if c.arch == "qwen2" else "llama"  # llama.cpp runs Mistral as llama


def _encode(arr: np.ndarray, dtype: str):
  """``(data, raw_dtype)`` for ``GGUFWriter.add_tensor``. 1-D tensors (norms, biases) stay f32,
  as llama.cpp keeps them; a block type needs rows of whole blocks (32 values), else the matrix
  falls back to f16, as llama.cpp's converter does."""
  qtype = _WRITE_TYPES[dtype][0]
  if qtype == _GT.F32 or arr.ndim == 1:
    return arr.astype(np.float32), None
  if qtype == _GT.F16 or arr.shape[-1] % gg.GGML_QUANT_SIZES[qtype][0]:
    return arr.astype(np.float16), None
  return gg.quants.quantize(arr.astype(np.float32), qtype), qtype


def _add_rope(w, c: DecoderConfig) -> None:
  r = c.rope
  w.add_rope_freq_base(float(r.theta))
  if r.kind == "linear":
    w.add_rope_scaling_type(gg.RopeScalingType.LINEAR)
    w.add_rope_scaling_factor(float(r.factor))
  elif r.kind == "yarn":
    if r.attention_factor is not None or r.mscale is not None or r.mscale_all_dim is not None \
        or not r.truncate:
      raise ConfigError(f"yarn rope with attention_factor/mscale/truncate=False ({r}) has no GGUF "
                        "encoding")
    w.add_rope_scaling_type(gg.RopeScalingType.YARN)
    w.add_rope_scaling_factor(float(r.factor))
    w.add_rope_scaling_orig_ctx_len(int(r.original_max_position_embeddings))
    for key in ("beta_fast", "beta_slow"):  # spelled out: gguf < 0.17 has no helper for them
      w.add_float32(f"{w.arch}.rope.scaling.yarn_{key}", float(getattr(r, key)))
  elif r.kind == "llama3":
    if (r.low_freq_factor, r.high_freq_factor, r.original_max_position_embeddings) != \
        (_LLAMA3_LOW, _LLAMA3_HIGH, _LLAMA3_ORIGINAL):
      # Other constants would write fine, but from_gguf (like llama.cpp files in the wild) only
      # recognises the Llama 3.x ones in the factors.
      raise ConfigError(f"llama3 rope needs low_freq_factor={_LLAMA3_LOW}, high_freq_factor="
                        f"{_LLAMA3_HIGH}, original_max_position_embeddings={_LLAMA3_ORIGINAL} "
                        f"to round-trip through GGUF; got {r}")
    w.add_tensor(_ROPE_FREQS, _rope_divisors(r, c.head_dim))


def _copy_tokenizer(w, source: str | os.PathLike) -> None:
  """Copies every ``tokenizer.*`` metadata field of the GGUF ``source`` with its value types."""
  reader = _open(source)
  for key, field in reader.fields.items():
    if not key.startswith("tokenizer."):
      continue
    if field.types[0] == _VT.ARRAY:
      if len(field.types) != 2:
        raise InputError(f"{source}: nested array metadata {key!r} cannot be copied")
      # gguf infers the element type from the first element; the tokenizer arrays are
      # strings, int32 token types and float32 scores, exactly what it infers.
      w.add_key_value(key, _value(field), _VT.ARRAY)
    else:
      w.add_key_value(key, _value(field), field.types[0])


def save_gguf(model: Decoder, path: str | os.PathLike, dtype: str = "f32",
              tokenizer: str | os.PathLike | None = None, *, name: str = "jaxsys decoder") -> Path:
  """Writes ``model`` as a llama (or qwen2) GGUF file; the write is atomic (temp file + rename).

  ``dtype``: the matrices' encoding, one of :data:`WRITE_DTYPES` ("f32", "f16", "bf16", "q8_0",
  "q5_1", "q5_0", "q4_1", "q4_0"; norms and biases stay f32). ``tokenizer``:
  a GGUF file whose ``tokenizer.*`` metadata (vocabulary, merges, special ids, chat template)
  is copied, so that llama.cpp and transformers also find the tokenizer in the written file.
  """
  if dtype not in WRITE_DTYPES:
    raise ConfigError(f"{dtype=} must be one of {WRITE_DTYPES}")
  c = model.config
  arch = _gguf_arch(c)
  path = Path(path)
  tensors = hf_state_dict(model, np.float32)
  tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
  w = gg.GGUFWriter(tmp, arch)
  try:
    w.add_name(name)
    qtype, file_type = _WRITE_TYPES[dtype]
    w.add_file_type(file_type)
    if qtype not in (_GT.F32, _GT.F16, _GT.BF16):
      w.add_quantization_version(gg.GGML_QUANT_VERSION)
    w.add_vocab_size(c.vocab_size)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_block_count(c.num_layers)
    w.add_head_count(c.num_heads)
    w.add_head_count_kv(c.num_kv_heads)
    w.add_layer_norm_rms_eps(float(c.rms_norm_eps))
    w.add_rope_dimension_count(c.head_dim)
    if c.head_dim != c.hidden_size // c.num_heads:
      w.add_key_length(c.head_dim)
      w.add_value_length(c.head_dim)
    _add_rope(w, c)
    if tokenizer is not None:
      _copy_tokenizer(w, tokenizer)
    for hf_name, arr in tensors.items():
      heads = _permuted_heads(arch, hf_name, c)
      data, raw = _encode(arr if heads is None else _interleave_rows(arr, heads), dtype)
      w.add_tensor(_gguf_name(hf_name), data, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(tmp, path)
  except BaseException:
    w.close()
    tmp.unlink(missing_ok=True)
    raise
  return path
