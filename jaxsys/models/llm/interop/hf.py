"""Hugging Face interop for the decoder LM: load, convert and save ``transformers`` checkpoints.

* :func:`from_pretrained` reads a local directory (``config.json`` + ``model.safetensors`` or a
  sharded ``model.safetensors.index.json``) with numpy only: no torch, no network.
* :func:`from_hf_model` converts an in-memory ``transformers`` model (torch).
* :func:`save_pretrained` writes a directory that ``transformers.AutoModelForCausalLM`` loads,
  atomically: a crash at any moment leaves either the previous model or the new one at ``path``.
* :func:`random_model` builds a model with random weights from a ``transformers`` config (or a
  ``DecoderConfig``), for tests that must not download anything.

Any mismatch is an error naming the key: unsupported config fields (``ConfigError``), missing
or unexpected weights, shapes or dtypes (``InputError`` / ``ShapeError``).

What is checked on load, before any weight data is read: ``config.json`` and the shard index are
valid JSON objects; every config field is understood (``_hf_config``); every safetensors file
has a sane header whose tensors tile its data exactly (``_safetensors``: what the safetensors
library accepts); the weight names, shapes and float dtypes match the config. Not checked: the
values themselves (a NaN or a flipped bit inside a tensor loads as is; safetensors has no
checksum).

Usage::

  model = jaxsys.models.from_pretrained("path/to/hf_dir", dtype="float32")
  jaxsys.models.save_pretrained(model, "out_dir")
"""

from __future__ import annotations

import ctypes
import errno
import functools
import hashlib
import json
import os
import re
import secrets
import shutil
import socket
import stat
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxsys.core.errors import ConfigError, InputError, ShapeError
from jaxsys.models.llm.interop import _safetensors as st
from jaxsys.models.llm._decoder_config import DTYPES, DecoderConfig
from jaxsys.models.llm.interop._hf_config import config_from_hf, config_to_hf
from jaxsys.models.llm.decoder import Decoder

__all__ = ["from_pretrained", "from_hf_model", "save_pretrained", "random_model",
           "config_from_hf", "config_to_hf", "hf_state_dict", "load_state_dict", "lora_state_dict",
           "save_lora_adapters"]

# Buffers some transformers versions store that carry no learned state.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
# Weight files (any format, sharded or not, and their indexes) of a previous save into the same
# directory: a new save replaces them all, so no stale weights can be loaded afterwards.
_WEIGHT_FILE = re.compile(r"(model|pytorch_model|tf_model|flax_model)(-\d{5}-of-\d{5})?"
                          r"\.(safetensors|bin|h5|msgpack)(\.index\.json)?")


def _weight_map(c: DecoderConfig):
  """``hf_name -> (jax path, hf shape, to_jax, to_hf)`` for every parameter of ``c``."""
  d, f, v = c.hidden_size, c.intermediate_size, c.vocab_size
  h, kv, hd = c.num_heads, c.num_kv_heads, c.head_dim
  same = (lambda x: x, lambda x: x)
  transpose = (lambda x: x.T, lambda x: x.T)

  def heads_in(n):  # [n*hd, d] <-> [d, n, hd]
    return (lambda x: x.T.reshape(d, n, hd), lambda x: x.reshape(d, n * hd).T)

  def bias(n):  # [n*hd] <-> [n, hd]
    return (lambda x: x.reshape(n, hd), lambda x: x.reshape(n * hd))

  out_proj = (lambda x: x.T.reshape(h, hd, d), lambda x: x.reshape(h * hd, d).T)
  m: dict[str, tuple] = {"model.embed_tokens.weight": (("embed_tokens", "embedding"), (v, d), *same),
                         "model.norm.weight": (("final_norm", "scale"), (d,), *same)}
  if not c.tie_embeddings:
    m["lm_head.weight"] = (("lm_head",), (v, d), *transpose)
  for i in range(c.num_layers):
    p = f"model.layers.{i}."
    lp = ("layers", i)
    m[p + "input_layernorm.weight"] = (lp + ("attn_norm", "scale"), (d,), *same)
    m[p + "post_attention_layernorm.weight"] = (lp + ("mlp_norm", "scale"), (d,), *same)
    m[p + "self_attn.q_proj.weight"] = (lp + ("attn", "wq"), (h * hd, d), *heads_in(h))
    m[p + "self_attn.k_proj.weight"] = (lp + ("attn", "wk"), (kv * hd, d), *heads_in(kv))
    m[p + "self_attn.v_proj.weight"] = (lp + ("attn", "wv"), (kv * hd, d), *heads_in(kv))
    m[p + "self_attn.o_proj.weight"] = (lp + ("attn", "wo"), (d, h * hd), *out_proj)
    if c.qkv_bias:
      m[p + "self_attn.q_proj.bias"] = (lp + ("attn", "bq"), (h * hd,), *bias(h))
      m[p + "self_attn.k_proj.bias"] = (lp + ("attn", "bk"), (kv * hd,), *bias(kv))
      m[p + "self_attn.v_proj.bias"] = (lp + ("attn", "bv"), (kv * hd,), *bias(kv))
    if c.o_bias:
      m[p + "self_attn.o_proj.bias"] = (lp + ("attn", "bo"), (d,), *same)
    m[p + "mlp.gate_proj.weight"] = (lp + ("mlp", "gate"), (f, d), *transpose)
    m[p + "mlp.up_proj.weight"] = (lp + ("mlp", "up"), (f, d), *transpose)
    m[p + "mlp.down_proj.weight"] = (lp + ("mlp", "down"), (d, f), *transpose)
  return m


def _get_var(model, path):
  obj = model
  for p in path:
    obj = obj[p] if isinstance(p, int) else getattr(obj, p)
  return obj


def _check_keys(expected: set[str], present: dict[str, Any], tied_ok: Callable[[], bool]):
  present_keys = {k for k in present if not k.endswith(_IGNORED_SUFFIXES)}
  missing = sorted(expected - present_keys)
  extra = sorted(present_keys - expected)
  if "lm_head.weight" in extra and "model.embed_tokens.weight" in expected and tied_ok():
    extra.remove("lm_head.weight")  # a tied head stored explicitly, equal to the embedding
  if missing:
    raise InputError(f"checkpoint is missing weights {missing[:8]}{' ...' if len(missing) > 8 else ''}")
  if extra:
    raise InputError(f"checkpoint has unexpected weights {extra[:8]}{' ...' if len(extra) > 8 else ''} "
                     "that the config does not use")


def load_state_dict(config: DecoderConfig, tensors: dict[str, Any], *,
                    attention_fn: Callable | None = None) -> Decoder:
  """Builds a model from HF-named tensors; each value is an array or a zero-argument loader.

  ``tensors`` values may be ``np.ndarray`` or objects with ``shape``, ``is_float`` and
  ``load()`` (lazy safetensors entries). Shapes and dtypes are checked before any data is read.
  """
  wmap = _weight_map(config)
  pdt = config.jnp_param_dtype

  def tied_ok():
    if "lm_head.weight" not in tensors:
      return False
    return np.array_equal(_load(tensors["lm_head.weight"]), _load(tensors["model.embed_tokens.weight"]))

  _check_keys(set(wmap), tensors, tied_ok)
  for name, (_, shape, _, _) in wmap.items():
    t = tensors[name]
    got = tuple(t.shape)
    if got != shape:
      raise ShapeError(f"weight {name!r} has shape {got}, expected {shape} for this config")
    is_float = t.is_float if hasattr(t, "is_float") else np.issubdtype(np.asarray(t).dtype, np.floating) \
        or str(np.asarray(t).dtype) == "bfloat16"
    if not is_float:
      raise ShapeError(f"weight {name!r} has non-floating dtype "
                       f"{getattr(t, 'dtype', None)}; expected a float tensor")
  model = nnx.eval_shape(lambda: Decoder(config, rngs=nnx.Rngs(0), attention_fn=attention_fn))
  for name, (path, _, to_jax, _) in wmap.items():
    arr = to_jax(_load(tensors[name]).astype(np.float32))
    _get_var(model, path).set_value(jnp.asarray(arr, dtype=pdt))
  return model


def _load(t) -> np.ndarray:
  return t.load() if hasattr(t, "load") else np.asarray(t)


def hf_state_dict(model: Decoder, dtype=None) -> dict[str, np.ndarray]:
  """The model's weights under Hugging Face names and layouts (numpy)."""
  out = {}
  for name, (path, shape, _, to_hf) in _weight_map(model.config).items():
    arr = np.asarray(_get_var(model, path)[...])
    arr = np.ascontiguousarray(to_hf(arr))
    if dtype is not None:
      arr = arr.astype(jnp.dtype(dtype))
    assert arr.shape == shape, (name, arr.shape, shape)
    out[name] = arr
  return out


def _with_dtype(config: DecoderConfig, dtype) -> DecoderConfig:
  if dtype is None:
    return config
  name = jnp.dtype(dtype).name
  return config.replace(dtype=name, param_dtype=name)


def read_config(path: str | os.PathLike, *, strict: bool = True) -> DecoderConfig:
  cfg_path = Path(path) / "config.json"
  if not cfg_path.exists():
    raise InputError(f"{cfg_path} does not exist: from_pretrained needs a local Hugging Face "
                     "directory with config.json")
  return config_from_hf(_read_json(cfg_path), strict=strict)


def _read_json(path: Path) -> dict:
  try:
    d = json.loads(path.read_text(encoding="utf-8"))
  except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
    raise InputError(f"{path} is not valid JSON: {e}") from None
  if not isinstance(d, dict):
    raise InputError(f"{path} holds a JSON {type(d).__name__}, expected an object")
  return d


def _checkpoint_tensors(path: Path) -> dict[str, st.TensorInfo]:
  index = path / INDEX_NAME
  single = path / WEIGHTS_NAME
  if index.exists():
    weight_map = _read_json(index).get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
      raise InputError(f"{index}: weight_map must be an object mapping weight names to file names")
    headers = {f: st.read_header(path / f) for f in sorted(set(weight_map.values()))}
    tensors = {}
    for name, f in weight_map.items():
      if name not in headers[f]:
        raise InputError(f"index lists weight {name!r} in {f} but that file does not contain it")
      tensors[name] = headers[f][name]
    return tensors
  if single.exists():
    return st.read_header(single)
  raise InputError(f"{path} has neither {WEIGHTS_NAME} nor {INDEX_NAME} "
                   "(pytorch_model.bin is not read: convert it with from_hf_model)")


def from_pretrained(path: str | os.PathLike, dtype=None, *, strict: bool = True,
                    attention_fn: Callable | None = None, **config_changes) -> Decoder:
  """Loads a local Hugging Face Llama / Qwen2 / Mistral directory into a :class:`Decoder`.

  ``dtype`` (e.g. "float32", "bfloat16"; default float32) sets parameters and activations.
  ``config_changes`` override DecoderConfig fields that do not change shapes (e.g. ``rope=``).
  """
  path = Path(path)
  config = _with_dtype(read_config(path, strict=strict), dtype)
  if config_changes:
    config = config.replace(**config_changes)
  return load_state_dict(config, _checkpoint_tensors(path), attention_fn=attention_fn)


def from_hf_model(torch_model, dtype=None, *, strict: bool = True,
                  attention_fn: Callable | None = None) -> Decoder:
  """Converts an in-memory ``transformers`` causal LM (torch) to a :class:`Decoder`."""
  import torch  # noqa: PLC0415  (optional dependency, only for this entry point)
  config = _with_dtype(config_from_hf(torch_model.config.to_dict(), strict=strict), dtype)
  tensors = {k: v.detach().to(torch.float32).cpu().numpy()
             for k, v in torch_model.state_dict().items()}
  return load_state_dict(config, tensors, attention_fn=attention_fn)


def _save_dtype(dtype, default: str) -> np.dtype:
  try:
    out = jnp.dtype(dtype if dtype is not None else default)
  except TypeError:
    raise ConfigError(f"{dtype=} is not a dtype; save_pretrained writes one of {DTYPES}") from None
  if out.name not in DTYPES:
    raise ConfigError(f"dtype={out.name!r} cannot be saved: weights are written as one of {DTYPES} "
                      "(a cast to an integer or quantized dtype would destroy them)")
  return out


def save_pretrained(model: Decoder, path: str | os.PathLike, *, dtype=None,
                    max_shard_bytes: int | None = None, tokenizer=None) -> Path:
  """Writes ``config.json`` + safetensors (sharded above ``max_shard_bytes``) for transformers.

  ``dtype`` (default: the model's ``param_dtype``) is one of float32 / bfloat16 / float16.
  ``tokenizer`` (e.g. the :class:`~jaxsys.models.llm.interop.tokenizer.Tokenizer` of ``load_pretrained``): its
  ``save_pretrained`` writes ``tokenizer.json``, ``tokenizer_config.json`` (with the chat template)
  and ``special_tokens_map.json`` into the same folder, so ``AutoTokenizer`` loads it too.
  The save is atomic: everything is written (and fsynced) into a hidden sibling directory that
  then takes the place of ``path`` in one rename, so at every instant ``path`` holds either the
  previous model or the new one, complete; a save killed at any point leaves the previous model
  loadable, and its temporary directory is removed by the next save to that path. The new
  directory holds only this save's config and weights, plus the files of the previous ``path``
  that are neither (tokenizer, generation config, ...), which are kept.
  """
  out_dtype = _save_dtype(dtype, model.config.param_dtype)
  config = config_to_hf(model.config, torch_dtype=out_dtype.name)
  tensors = hf_state_dict(model, out_dtype)
  total = sum(t.nbytes for t in tensors.values())
  shards: list[dict[str, np.ndarray]] = [{}]
  size = 0
  for name, t in tensors.items():
    if max_shard_bytes is not None and shards[-1] and size + t.nbytes > max_shard_bytes:
      shards.append({})
      size = 0
    shards[-1][name] = t
    size += t.nbytes

  if tokenizer is not None and not callable(getattr(tokenizer, "save_pretrained", None)):
    raise ConfigError(f"tokenizer must have a save_pretrained(folder) method, got {type(tokenizer).__name__}")

  def write(tmp: Path):
    _write_json(tmp / CONFIG_NAME, config)
    if tokenizer is not None:
      tokenizer.save_pretrained(tmp)
    if len(shards) == 1:
      st.write_file(tmp / WEIGHTS_NAME, tensors)
      return
    weight_map = {}
    for i, shard in enumerate(shards):
      fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
      st.write_file(tmp / fname, shard)
      weight_map.update({k: fname for k in shard})
    _write_json(tmp / INDEX_NAME, {"metadata": {"total_size": int(total)}, "weight_map": weight_map})

  _replace_dir(Path(path), write, keep=lambda name: not _WEIGHT_FILE.fullmatch(name)
               and name != CONFIG_NAME)
  return Path(path)


ADAPTER_WEIGHTS_NAME = "adapter_model.safetensors"
ADAPTER_CONFIG_NAME = "adapter_config.json"


def lora_state_dict(model: Decoder) -> tuple[dict[str, np.ndarray], dict]:
  """The model's LoRA adapters (``jaxsys.nn.lora``) in PEFT's layout: ``(tensors, adapter_config)``.

  jaxsys keeps ``A [fan_in, r]``, ``B [r, fan_out]`` with ``W' = W + (alpha/r) (A @ B)`` in its
  ``[in..., out...]`` weight layout; Hugging Face weights are ``[out, in]``, so PEFT's
  ``lora_A.weight [r, in] = A.T`` and ``lora_B.weight [out, r] = B.T`` give the same
  ``W'_hf = W_hf + (alpha/r) lora_B @ lora_A`` (Hu et al., 2021, eq. 3)."""
  from jaxsys.nn.lora import LoRAWeight
  tensors, targets, settings = {}, set(), set()
  for name, (path, *_rest) in _weight_map(model.config).items():
    w = _get_var(model, path)
    if not isinstance(w, LoRAWeight):
      continue
    module = name[:-len(".weight")]                   # model.layers.0.self_attn.q_proj
    tensors[f"base_model.model.{module}.lora_A.weight"] = np.ascontiguousarray(np.asarray(w.lora_a[...]).T)
    tensors[f"base_model.model.{module}.lora_B.weight"] = np.ascontiguousarray(np.asarray(w.lora_b[...]).T)
    targets.add(module.rsplit(".", 1)[1])
    settings.add((w.rank, w.scale * w.rank))
  if not tensors:
    raise ConfigError("the model has no LoRA adapters (jaxsys.nn.lora.apply_lora)")
  if len(settings) > 1:
    raise ConfigError(f"PEFT's adapter config holds one rank and alpha; the adapters have {sorted(settings)}")
  (rank, alpha), = settings
  config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha,
            "target_modules": sorted(targets), "lora_dropout": 0.0, "bias": "none",
            "fan_in_fan_out": False, "inference_mode": True, "base_model_name_or_path": None}
  return tensors, config


def save_lora_adapters(model: Decoder, path: str | os.PathLike, *, base_model: str | None = None) -> Path:
  """Writes the adapters alone as a PEFT folder (``adapter_model.safetensors`` +
  ``adapter_config.json``; :func:`lora_state_dict`), atomically like :func:`save_pretrained`.
  ``base_model``: recorded as ``base_model_name_or_path`` (e.g. the merged-free base's folder)."""
  tensors, config = lora_state_dict(model)
  config["base_model_name_or_path"] = base_model

  def write(tmp: Path):
    _write_json(tmp / ADAPTER_CONFIG_NAME, config)
    st.write_file(tmp / ADAPTER_WEIGHTS_NAME, tensors)

  _replace_dir(Path(path), write, keep=lambda name: name not in (ADAPTER_CONFIG_NAME, ADAPTER_WEIGHTS_NAME))
  return Path(path)


def _write_json(path: Path, obj):
  with open(path, "w", encoding="utf-8") as f:
    f.write(json.dumps(obj, indent=2))
    f.flush()
    os.fsync(f.fileno())


# --- atomic directory replacement --------------------------------------------------------------
# The new directory is written beside the target, under a hidden name that records the writer's
# host and pid (".{name}.tmp-{host}-{pid}-{token}"), then swapped with the target in one atomic
# rename: renameat2(RENAME_EXCHANGE) on Linux, renamex_np(RENAME_SWAP) on macOS. Where neither
# exists (or the filesystem refuses it) two renames are used instead: target -> ".{name}.old-...",
# then tmp -> target; a crash between them leaves the previous model under the .old name, and the
# next save moves it back before it starts. Leftovers of dead writers on this host are removed by
# the next save; those of live writers are left alone, so concurrent saves do not collide.

_HOST = hashlib.sha1(socket.gethostname().encode()).hexdigest()[:8]


def _side_stem(target: Path) -> str:
  name = target.name
  return name if len(name) <= 96 else hashlib.sha1(name.encode()).hexdigest()[:16]


def _side_path(target: Path, kind: str) -> Path:
  return target.parent / f".{_side_stem(target)}.{kind}-{_HOST}-{os.getpid()}-{secrets.token_hex(4)}"


def _alive(pid: int) -> bool:
  if os.name == "nt" or pid == os.getpid():  # (on Windows, os.kill(pid, 0) is not a probe)
    return True
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except OSError:  # EPERM: alive, owned by someone else
    return True
  return True


def _clean_leftovers(target: Path):
  pattern = re.compile(rf"\.{re.escape(_side_stem(target))}\.(tmp|old)-([0-9a-f]{{8}})-(\d+)-[0-9a-f]+")
  for entry in os.scandir(target.parent):
    m = pattern.fullmatch(entry.name)
    if m is None or m[2] != _HOST or _alive(int(m[3])):
      continue
    if m[1] == "old" and not os.path.lexists(target):  # killed between the two fallback renames
      os.rename(entry.path, target)
    else:
      shutil.rmtree(entry.path, ignore_errors=True)


@functools.lru_cache(maxsize=1)
def _exchange_fn():
  """(c function, flag, takes dir fds) swapping two paths atomically, or None."""
  try:
    libc = ctypes.CDLL(None, use_errno=True)
  except OSError:
    return None
  if sys.platform.startswith("linux") and hasattr(libc, "renameat2"):
    fn = libc.renameat2
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    return fn, 2, True        # RENAME_EXCHANGE
  if sys.platform == "darwin" and hasattr(libc, "renamex_np"):
    fn = libc.renamex_np
    fn.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_uint]
    return fn, 2, False       # RENAME_SWAP
  return None


def _exchange(a: Path, b: Path) -> bool:
  """Atomically swaps the directory entries ``a`` and ``b``; False where the OS cannot."""
  found = _exchange_fn()
  if found is None:
    return False
  fn, flag, at = found
  args = (-100, os.fsencode(a), -100, os.fsencode(b), flag) if at else \
      (os.fsencode(a), os.fsencode(b), flag)  # -100: AT_FDCWD
  if fn(*args) == 0:
    return True
  err = ctypes.get_errno()
  if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP):
    return False
  raise OSError(err, os.strerror(err), os.fspath(a), None, os.fspath(b))


def _fsync_dir(path: Path):
  if os.name == "nt":
    return
  fd = os.open(path, os.O_RDONLY)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)


def _link_or_copy(src: str, dst: str):
  if os.path.islink(src):
    os.symlink(os.readlink(src), dst)
    return
  try:
    os.link(src, dst)
  except OSError:
    if not stat.S_ISREG(os.lstat(src).st_mode):
      raise InputError(f"{src} is not a regular file; save_pretrained cannot keep it") from None
    shutil.copy2(src, dst)


def _carry_over(src: Path, dst: Path, keep: Callable[[str], bool]):
  for entry in os.scandir(src):
    if not keep(entry.name):
      continue
    s, d = entry.path, os.path.join(dst, entry.name)
    if entry.is_dir(follow_symlinks=False):
      shutil.copytree(s, d, symlinks=True, copy_function=_link_or_copy)
    else:
      _link_or_copy(s, d)


def _replace_dir(path: Path, write: Callable[[Path], None], keep: Callable[[str], bool]):
  """Puts at ``path`` a directory made by ``write(tmp)``, plus the entries of the previous
  ``path`` whose names pass ``keep``, in one atomic step (see the comment above)."""
  target = Path(os.path.realpath(path))  # a symlinked target: replace what it points to
  if os.path.lexists(target) and not target.is_dir():
    raise InputError(f"{path} exists and is not a directory")
  target.parent.mkdir(parents=True, exist_ok=True)
  _clean_leftovers(target)
  tmp = _side_path(target, "tmp")
  os.mkdir(tmp)
  try:
    if target.is_dir():
      shutil.copymode(target, tmp)
      _carry_over(target, tmp, keep)
    write(tmp)
    _fsync_dir(tmp)
    if not target.exists():
      os.rename(tmp, target)
    elif not _exchange(tmp, target):
      old = _side_path(target, "old")
      os.rename(target, old)
      try:
        os.rename(tmp, target)
      except BaseException:
        os.rename(old, target)
        raise
      tmp = old
    # Now tmp holds the previous model (or nothing); the new one is at target.
    _fsync_dir(target.parent)
  finally:
    shutil.rmtree(tmp, ignore_errors=True)


def random_model(config, seed: int = 0, dtype=None, *, attention_fn: Callable | None = None,
                 strict: bool = True) -> Decoder:
  """A randomly initialised :class:`Decoder` from a ``DecoderConfig``, a ``transformers``
  config object or a config dict (nothing is downloaded)."""
  if not isinstance(config, DecoderConfig):
    d = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    config = config_from_hf(d, strict=strict)
  config = _with_dtype(config, dtype)
  return Decoder(config, rngs=nnx.Rngs(seed), attention_fn=attention_fn)

