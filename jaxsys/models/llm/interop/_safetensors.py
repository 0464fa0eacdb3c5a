"""Minimal safetensors reader/writer on numpy (bfloat16 through ml_dtypes; no torch needed).

Format: 8-byte little-endian header length N, N bytes of JSON ``{name: {"dtype", "shape",
"data_offsets": [begin, end]}, "__metadata__": {...}}``, then the raw little-endian data.
Reading is lazy: :func:`read_header` gives names, dtypes and shapes so callers can validate a
checkpoint before touching its data.

What the reader accepts is what the ``safetensors`` library itself accepts; anything else is an
``InputError`` naming the file (and the tensor, where one is at fault), before any tensor data
is read:

* N is at most 100 MB (safetensors' ``MAX_HEADER_SIZE``) and ``8 + N`` fits in the file;
* the header is UTF-8 JSON, an object, with no duplicate names; ``__metadata__`` (optional) maps
  strings to strings;
* every tensor has a known dtype code, a shape of non-negative ints and ``data_offsets``
  ``[begin, end]`` with ``end - begin == prod(shape) * itemsize``;
* sorted by offset, the tensors tile the data section exactly: the first starts at 0, each
  starts where the previous ended (no overlap, no gap) and the last ends at the end of the file
  (a truncated file names the tensor that runs past its end; trailing bytes are refused).

The writer produces exactly that layout (header padded with spaces to 8 bytes) and ``fsync``\\ s
the file before returning, so a file it wrote survives a crash of the process or the machine.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import struct

import ml_dtypes
import numpy as np

from jaxsys.core.errors import InputError

__all__ = ["MAX_HEADER_BYTES", "read_header", "TensorInfo", "write_file"]

_DTYPES = {
    "F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16), "I64": np.dtype("<i8"), "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"), "I8": np.dtype("i1"), "U64": np.dtype("<u8"), "U32": np.dtype("<u4"),
    "U16": np.dtype("<u2"), "U8": np.dtype("u1"), "BOOL": np.dtype("bool"),
    "C64": np.dtype("<c8"), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "F8_E4M3FNUZ": np.dtype(ml_dtypes.float8_e4m3fnuz),
    "F8_E5M2FNUZ": np.dtype(ml_dtypes.float8_e5m2fnuz),
}
_NAMES = {v: k for k, v in _DTYPES.items()}
MAX_HEADER_BYTES = 100_000_000  # safetensors' MAX_HEADER_SIZE


@dataclasses.dataclass(frozen=True)
class TensorInfo:
  file: str
  name: str
  dtype: str          # safetensors dtype code, e.g. "BF16"
  shape: tuple[int, ...]
  begin: int          # absolute byte offsets in the file
  end: int

  @property
  def is_float(self) -> bool:
    return self.dtype in ("F64", "F32", "F16", "BF16")

  def load(self) -> np.ndarray:
    # read_header checked dtype, byte length and bounds; the file may still have changed since.
    dt = _DTYPES[self.dtype]
    count = math.prod(self.shape)
    with open(self.file, "rb") as f:
      f.seek(self.begin)
      data = f.read(self.end - self.begin)
    if len(data) != self.end - self.begin:
      raise InputError(f"tensor {self.name!r} in {self.file}: file ends after {len(data)} of its "
                       f"{self.end - self.begin} bytes (truncated since its header was read?)")
    return np.frombuffer(data, dtype=dt, count=count).reshape(self.shape).copy()


def _unique_keys(pairs):
  out = {}
  for k, v in pairs:
    if k in out:
      raise InputError(f"duplicate key {k!r}")
    out[k] = v
  return out


def _is_count(x) -> bool:
  return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def read_header(path: str | os.PathLike) -> dict[str, TensorInfo]:
  """Names, dtypes, shapes and byte ranges of the tensors in ``path``, all checked (see module doc)."""
  path = os.fspath(path)
  try:
    size = os.path.getsize(path)
    with open(path, "rb") as f:
      raw = f.read(8)
      if len(raw) != 8:
        raise InputError(f"{path} is not a safetensors file: {size} bytes, fewer than the 8 of "
                         "the header length")
      (n,) = struct.unpack("<Q", raw)
      if n > MAX_HEADER_BYTES:
        raise InputError(f"{path} is not a safetensors file: header length {n} exceeds the "
                         f"{MAX_HEADER_BYTES}-byte limit")
      if 8 + n > size:
        raise InputError(f"{path}: header length {n} runs past the end of the {size}-byte file "
                         "(truncated, or not a safetensors file)")
      blob = f.read(n)
  except OSError as e:
    raise InputError(f"cannot read safetensors file {path}: {e}") from None
  try:
    header = json.loads(blob.decode("utf-8"), object_pairs_hook=_unique_keys)
  except (UnicodeDecodeError, json.JSONDecodeError, InputError) as e:
    raise InputError(f"{path}: the {n}-byte header is not valid safetensors JSON ({e})") from None
  if not isinstance(header, dict):
    raise InputError(f"{path}: the header is a JSON {type(header).__name__}, not an object")
  meta = header.pop("__metadata__", None)
  if meta is not None and not (isinstance(meta, dict) and all(
      isinstance(k, str) and isinstance(v, str) for k, v in meta.items())):
    raise InputError(f"{path}: __metadata__ must map strings to strings, got {meta!r:.200}")
  base, data_bytes = 8 + n, size - 8 - n
  out = {}
  for name, info in header.items():
    where = f"tensor {name!r} in {path}"
    if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
      raise InputError(f"{where}: header entry {info!r:.200} must have exactly dtype, shape and "
                       "data_offsets")
    dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if dtype not in _DTYPES:
      raise InputError(f"{where} has unsupported dtype {dtype!r} (known: {sorted(_DTYPES)})")
    if not isinstance(shape, list) or not all(_is_count(s) for s in shape):
      raise InputError(f"{where}: shape={shape!r} must be a list of non-negative ints")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_count(o) for o in offsets)
            and offsets[0] <= offsets[1]):
      raise InputError(f"{where}: data_offsets={offsets!r} must be [begin, end] with "
                       "0 <= begin <= end")
    b, e = offsets
    nbytes = math.prod(shape) * _DTYPES[dtype].itemsize
    if e - b != nbytes:
      raise InputError(f"{where}: data_offsets={offsets} hold {e - b} bytes but shape {tuple(shape)} "
                       f"of {dtype} needs {nbytes}")
    if e > data_bytes:
      raise InputError(f"{where}: data_offsets={offsets} run past the end of the file's "
                       f"{data_bytes}-byte data section (truncated file?)")
    out[name] = TensorInfo(path, name, dtype, tuple(shape), base + b, base + e)
  # The tensors must tile [0, data_bytes) exactly, as safetensors requires.
  pos = 0
  for t in sorted(out.values(), key=lambda t: (t.begin, t.end)):
    if t.begin - base != pos:
      what = "overlaps the previous tensor" if t.begin - base < pos else "leaves a gap before it"
      raise InputError(f"tensor {t.name!r} in {path}: data_offsets start at {t.begin - base}, "
                       f"which {what} (expected {pos})")
    pos = t.end - base
  if pos != data_bytes:
    raise InputError(f"{path}: tensors cover {pos} bytes of data but the file holds {data_bytes} "
                     "after the header (trailing bytes)")
  return out


def write_file(path: str | os.PathLike, tensors: dict[str, np.ndarray],
               metadata: dict[str, str] | None = None):
  """Writes ``tensors`` (numpy arrays, any supported dtype) to ``path`` and fsyncs it."""
  header: dict = {"__metadata__": dict(metadata or {"format": "pt"})}
  offset = 0
  arrays = []
  for name, arr in tensors.items():
    arr = np.ascontiguousarray(arr)
    if arr.dtype.newbyteorder("<") not in _NAMES:
      raise InputError(f"tensor {name!r} has dtype {arr.dtype} that safetensors cannot store")
    arr = arr.astype(arr.dtype.newbyteorder("<"), copy=False)
    nbytes = arr.nbytes
    header[name] = {"dtype": _NAMES[arr.dtype], "shape": list(arr.shape),
                    "data_offsets": [offset, offset + nbytes]}
    arrays.append(arr)
    offset += nbytes
  blob = json.dumps(header, separators=(",", ":")).encode()
  blob += b" " * (-len(blob) % 8)  # data starts 8-byte aligned
  with open(path, "wb") as f:
    f.write(struct.pack("<Q", len(blob)))
    f.write(blob)
    for arr in arrays:
      f.write(arr.tobytes())
    f.flush()
    os.fsync(f.fileno())
