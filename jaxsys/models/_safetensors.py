"""Minimal safetensors reader/writer on numpy (bfloat16 through ml_dtypes; no torch needed).

Format: 8-byte little-endian header length N, N bytes of JSON ``{name: {"dtype", "shape",
"data_offsets": [begin, end]}, "__metadata__": {...}}``, then the raw little-endian data.
Reading is lazy: :func:`read_header` gives names, dtypes and shapes so callers can validate a
checkpoint before touching its data.
"""

from __future__ import annotations

import dataclasses
import json
import os
import struct

import ml_dtypes
import numpy as np

from jaxsys.core.errors import InputError

_DTYPES = {
    "F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16), "I64": np.dtype("<i8"), "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"), "I8": np.dtype("i1"), "U8": np.dtype("u1"), "BOOL": np.dtype("bool"),
}
_NAMES = {v: k for k, v in _DTYPES.items()}


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
    if self.dtype not in _DTYPES:
      raise InputError(f"tensor {self.name!r} in {self.file} has unsupported dtype {self.dtype}")
    dt = _DTYPES[self.dtype]
    count = int(np.prod(self.shape)) if self.shape else 1
    if self.end - self.begin != count * dt.itemsize:
      raise InputError(f"tensor {self.name!r} in {self.file}: byte range does not match "
                       f"shape {self.shape} and dtype {self.dtype}")
    with open(self.file, "rb") as f:
      f.seek(self.begin)
      data = f.read(self.end - self.begin)
    return np.frombuffer(data, dtype=dt, count=count).reshape(self.shape).copy()


def read_header(path: str | os.PathLike) -> dict[str, TensorInfo]:
  path = os.fspath(path)
  with open(path, "rb") as f:
    raw = f.read(8)
    if len(raw) != 8:
      raise InputError(f"{path} is not a safetensors file (too short)")
    (n,) = struct.unpack("<Q", raw)
    header = json.loads(f.read(n))
  base = 8 + n
  out = {}
  for name, meta in header.items():
    if name == "__metadata__":
      continue
    b, e = meta["data_offsets"]
    out[name] = TensorInfo(path, name, meta["dtype"], tuple(meta["shape"]), base + b, base + e)
  return out


def write_file(path: str | os.PathLike, tensors: dict[str, np.ndarray],
               metadata: dict[str, str] | None = None):
  """Writes ``tensors`` (numpy arrays, any supported dtype) to ``path``."""
  header: dict = {"__metadata__": dict(metadata or {"format": "pt"})}
  offset = 0
  arrays = []
  for name, arr in tensors.items():
    arr = np.ascontiguousarray(arr)
    if arr.dtype not in _NAMES:
      raise InputError(f"tensor {name!r} has dtype {arr.dtype} that safetensors cannot store")
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
      f.write(arr.astype(arr.dtype.newbyteorder("<"), copy=False).tobytes())
