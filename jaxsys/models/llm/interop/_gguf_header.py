"""A GGUF file's metadata and tensor table, read in one pass over the header.

``gguf.GGUFReader`` builds a numpy view for every part of every metadata value: for a 49K-token
vocabulary and its 49K merges that is ~1.2M small views, 3-4 s per open of SmolLM2's file, paid by
every model load. Loading needs the scalar metadata, the vocabulary's length and the tensor table;
this reads them with ``struct`` from a memory map (the token arrays are skipped, not decoded), in
~0.1 s, and gives each tensor the same ``data`` view ``GGUFReader`` gives (what
``gguf.quants.dequantize`` takes). Little-endian files, GGUF v2 and v3 (what llama.cpp writes);
others go through ``GGUFReader``. tests/models/test_gguf.py compares both readers on every field
and tensor of the shipped file.
"""

from __future__ import annotations

import dataclasses
import struct
from pathlib import Path
from typing import Any

import gguf as gg
import numpy as np

_VT = gg.GGUFValueType
_GT = gg.GGMLQuantizationType
_SCALARS = {_VT.UINT8: "B", _VT.INT8: "b", _VT.UINT16: "H", _VT.INT16: "h", _VT.UINT32: "I",
            _VT.INT32: "i", _VT.FLOAT32: "f", _VT.BOOL: "?", _VT.UINT64: "Q", _VT.INT64: "q",
            _VT.FLOAT64: "d"}
# element types whose tensor data GGUFReader views as that numpy type (others: bytes per row)
_PLAIN = {_GT.F16: np.float16, _GT.F32: np.float32, _GT.F64: np.float64, _GT.I8: np.int8,
          _GT.I16: np.int16, _GT.I32: np.int32, _GT.I64: np.int64}


@dataclasses.dataclass(frozen=True)
class Tensor:
  """One entry of the tensor table, with the fields of ``gguf.ReaderTensor`` that loading reads."""
  name: str
  tensor_type: Any          # gguf.GGMLQuantizationType
  shape: np.ndarray         # uint64 dims, ggml order (fastest first)
  n_elements: int
  n_bytes: int
  data_offset: int
  data: np.ndarray          # a view of the file (see the module docstring)


@dataclasses.dataclass(frozen=True)
class Header:
  """``meta``: every metadata value but ``skipped`` keys (arrays as lists), decoded as
  ``gguf.py``'s ``_value`` decodes them; ``lengths``: each array's length; ``tensors``: the table."""
  meta: dict[str, Any]
  lengths: dict[str, int]
  tensors: list[Tensor]


class _Cursor:
  def __init__(self, buf):
    self.buf, self.pos = buf, 0

  def take(self, fmt: str):
    out = struct.unpack_from("<" + fmt, self.buf, self.pos)
    self.pos += struct.calcsize("<" + fmt)
    return out[0] if len(out) == 1 else out

  def string(self) -> str:
    n = self.take("Q")
    s = bytes(self.buf[self.pos:self.pos + n]).decode("utf-8")
    if len(s.encode("utf-8")) != n:
      raise ValueError("string runs past the end of the file")
    self.pos += n
    return s

  def skip_strings(self, count: int) -> None:
    for _ in range(count):
      self.pos += 8 + struct.unpack_from("<Q", self.buf, self.pos)[0]


def to_python(v, vtype) -> Any:
  """A decoded non-string GGUF scalar ``v`` of type ``vtype`` as the Python value loading uses
  (both readers decode through this)."""
  if vtype == _VT.BOOL:
    return bool(v)
  if vtype == _VT.FLOAT32:  # the shortest decimal of the float32 (1e-05, not 9.99999974e-06)
    return float(str(np.float32(v)))
  return float(v) if vtype == _VT.FLOAT64 else int(v)


def _scalar(cur: _Cursor, vtype) -> Any:
  return cur.string() if vtype == _VT.STRING else to_python(cur.take(_SCALARS[vtype]), vtype)


def _value(cur: _Cursor, vtype, keep: bool = True):
  """The next value (arrays as lists); ``keep=False`` steps over an array without decoding it.
  Returns ``(value, length)``, ``length`` None for a scalar."""
  if vtype != _VT.ARRAY:
    return _scalar(cur, _VT(vtype)), None
  etype, count = _VT(cur.take("I")), cur.take("Q")
  if keep or etype == _VT.ARRAY:
    items = [_value(cur, etype)[0] for _ in range(count)]
    return (items if keep else None), count
  if etype == _VT.STRING:
    cur.skip_strings(count)
  else:
    cur.pos += count * struct.calcsize(_SCALARS[etype])
  return None, count


class TruncatedError(ValueError):
  """The tensor table points past the end of the file (a partial download)."""


def read_header(path: Path, skipped=()) -> Header | None:
  """The header of ``path`` (None for a file this reader leaves to ``GGUFReader``), ``skipped``
  arrays not decoded. Raises :class:`TruncatedError` when a tensor ends past the file, and
  ``ValueError`` / ``struct.error`` / ``KeyError`` on a malformed header."""
  buf = np.memmap(path, np.uint8, mode="r")
  cur = _Cursor(buf)
  magic, version, n_tensors, n_kv = cur.take("4sIQQ")
  if magic != b"GGUF" or version not in (2, 3):
    return None
  # the header's own counts, as GGUFReader lists them among the fields
  meta, lengths = {"GGUF.version": version, "GGUF.tensor_count": n_tensors, "GGUF.kv_count": n_kv}, {}
  for _ in range(n_kv):
    key, vtype = cur.string(), cur.take("I")
    value, length = _value(cur, vtype, keep=key not in skipped)
    if key not in skipped:
      meta[key] = value
    if length is not None:
      lengths[key] = length
  infos = []
  for _ in range(n_tensors):
    name, n_dims = cur.string(), cur.take("I")
    dims = np.array([cur.take("Q") for _ in range(n_dims)], np.uint64)
    infos.append((name, dims, _GT(cur.take("I")), cur.take("Q")))
  align = int(meta.get("general.alignment", 32))
  start = -(-cur.pos // align) * align
  tensors = []
  if len({name for name, *_ in infos}) != len(infos):
    raise ValueError("duplicated tensor names")
  for name, dims, qtype, offset in infos:
    n = int(np.prod(dims))
    block, type_size = gg.GGML_QUANT_SIZES[qtype]
    n_bytes, at = n * type_size // block, start + offset
    if at + n_bytes > buf.size:
      raise TruncatedError(f"tensor {name!r} ends at byte {at + n_bytes} but the file has {buf.size} bytes")
    shape = tuple(reversed(dims.tolist()))
    if qtype in _PLAIN:
      data = buf[at:at + n_bytes].view(_PLAIN[qtype]).reshape(shape)
    else:
      data = buf[at:at + n_bytes].reshape(gg.quant_shape_to_byte_shape(shape, qtype))
    tensors.append(Tensor(name, qtype, dims, n, n_bytes, at, data))
  return Header(meta, lengths, tensors)
