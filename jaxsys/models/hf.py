"""Hugging Face interop for the decoder LM: load, convert and save ``transformers`` checkpoints.

* :func:`from_pretrained` reads a local directory (``config.json`` + ``model.safetensors`` or a
  sharded ``model.safetensors.index.json``) with numpy only: no torch, no network.
* :func:`from_hf_model` converts an in-memory ``transformers`` model (torch).
* :func:`save_pretrained` writes a directory that ``transformers.AutoModelForCausalLM`` loads.
* :func:`random_model` builds a model with random weights from a ``transformers`` config (or a
  ``DecoderConfig``), for tests that must not download anything.

Any mismatch is an error naming the key: unsupported config fields (``ConfigError``), missing
or unexpected weights, shapes or dtypes (``InputError`` / ``ShapeError``).

Usage::

  model = jaxsys.models.from_pretrained("path/to/hf_dir", dtype="float32")
  jaxsys.models.save_pretrained(model, "out_dir")
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxsys.core.errors import InputError, ShapeError
from jaxsys.models import _safetensors as st
from jaxsys.models._decoder_config import DecoderConfig
from jaxsys.models._hf_config import config_from_hf, config_to_hf
from jaxsys.models.decoder import Decoder

__all__ = ["from_pretrained", "from_hf_model", "save_pretrained", "random_model",
           "config_from_hf", "config_to_hf", "hf_state_dict", "load_state_dict"]

# Buffers some transformers versions store that carry no learned state.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


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
  m: dict[str, tuple] = {"model.embed_tokens.weight": (("embed_tokens", "weight"), (v, d), *same),
                         "model.norm.weight": (("final_norm", "weight"), (d,), *same)}
  if not c.tie_embeddings:
    m["lm_head.weight"] = (("lm_head",), (v, d), *transpose)
  for i in range(c.num_layers):
    p = f"model.layers.{i}."
    lp = ("layers", i)
    m[p + "input_layernorm.weight"] = (lp + ("attn_norm", "weight"), (d,), *same)
    m[p + "post_attention_layernorm.weight"] = (lp + ("mlp_norm", "weight"), (d,), *same)
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
  return config_from_hf(json.loads(cfg_path.read_text()), strict=strict)


def _checkpoint_tensors(path: Path) -> dict[str, st.TensorInfo]:
  index = path / "model.safetensors.index.json"
  single = path / "model.safetensors"
  if index.exists():
    weight_map = json.loads(index.read_text())["weight_map"]
    headers = {f: st.read_header(path / f) for f in sorted(set(weight_map.values()))}
    tensors = {}
    for name, f in weight_map.items():
      if name not in headers[f]:
        raise InputError(f"index lists weight {name!r} in {f} but that file does not contain it")
      tensors[name] = headers[f][name]
    return tensors
  if single.exists():
    return st.read_header(single)
  raise InputError(f"{path} has neither model.safetensors nor model.safetensors.index.json "
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


def save_pretrained(model: Decoder, path: str | os.PathLike, *, dtype=None,
                    max_shard_bytes: int | None = None) -> Path:
  """Writes ``config.json`` + safetensors (sharded above ``max_shard_bytes``) for transformers."""
  path = Path(path)
  path.mkdir(parents=True, exist_ok=True)
  out_dtype = jnp.dtype(dtype or model.config.param_dtype)
  config = config_to_hf(model.config, torch_dtype=out_dtype.name)
  tensors = hf_state_dict(model, out_dtype)
  (path / "config.json").write_text(json.dumps(config, indent=2))
  if max_shard_bytes is None or sum(t.nbytes for t in tensors.values()) <= max_shard_bytes:
    st.write_file(path / "model.safetensors", tensors)
    return path
  shards: list[dict[str, np.ndarray]] = [{}]
  size = 0
  for name, t in tensors.items():
    if shards[-1] and size + t.nbytes > max_shard_bytes:
      shards.append({})
      size = 0
    shards[-1][name] = t
    size += t.nbytes
  weight_map = {}
  for i, shard in enumerate(shards):
    fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
    st.write_file(path / fname, shard)
    weight_map.update({k: fname for k in shard})
  index = {"metadata": {"total_size": int(sum(t.nbytes for t in tensors.values()))},
           "weight_map": weight_map}
  (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
  return path


def random_model(config, seed: int = 0, dtype=None, *, attention_fn: Callable | None = None,
                 strict: bool = True) -> Decoder:
  """A randomly initialised :class:`Decoder` from a ``DecoderConfig``, a ``transformers``
  config object or a config dict (nothing is downloaded)."""
  if not isinstance(config, DecoderConfig):
    d = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    config = config_from_hf(d, strict=strict)
  config = _with_dtype(config, dtype)
  return Decoder(config, rngs=nnx.Rngs(seed), attention_fn=attention_fn)

