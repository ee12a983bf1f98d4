"""A lean GGUF reader: metadata as plain Python values, tensors read into memory that the caller owns.

Why not ``gguf.GGUFReader``: it memory-maps the whole file and builds a numpy array for every part of every metadata
value, so SmolLM2's 49,152 tokens and 48,900 merges become a few hundred thousand small arrays: ~160 MiB at its peak
for a 94 MiB file, freed into a fragmented heap the process keeps (the server read the file twice at start-up: the
tokenizer and the weights). Here the header is parsed with ``struct`` from one buffer, and each tensor's bytes are
read with ``readinto`` into an array of its own: nothing of the file stays mapped, and nothing but the returned
values outlives the call.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# GGUF value types (gguf.GGUFValueType) -> struct codes of the fixed-size ones.
_SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32, 7: np.bool_,
          10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9


class GGUFFormatError(ValueError):
    """The file is not a GGUF file this reader understands (the message says where it went wrong)."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # slowest-first (torch order; GGUF stores dims fastest-first)
    tensor_type: int  # ggml type id
    offset: int  # absolute byte offset in the file
    nbytes: int


@dataclass
class GGUFFile:
    path: Path
    metadata: dict[str, Any]
    tensors: dict[str, TensorInfo]

    def field(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def tensor(self, name: str) -> TensorInfo:
        info = self.tensors.get(name)
        if info is None:
            raise ValueError(f"GGUF file {self.path} lacks tensor {name}")
        return info

    def read(self, name: str, file=None) -> np.ndarray:
        """The tensor's raw bytes [rows, bytes a row] (uint8), in a new array: nothing of the file stays mapped.
        ``file``: an open binary handle of the same file (saves opening it per tensor)."""
        info = self.tensor(name)
        out = np.empty(info.nbytes, dtype=np.uint8)
        if file is None:
            with open(self.path, "rb") as f:
                _read_at(f, info.offset, out, self.path)
        else:
            _read_at(file, info.offset, out, self.path)
        rows = info.shape[0] if len(info.shape) > 1 else 1
        return out.reshape(rows, -1)


def _read_at(f, offset: int, out: np.ndarray, path: Path) -> None:
    f.seek(offset)
    got = f.readinto(out.data)  # memoryview(out) (numpy's stubs give ndarray a __buffer__ only from 3.12)
    if got != out.nbytes:
        raise GGUFFormatError(f"{path}: a tensor at byte {offset} runs past the end of the file")


class _Cursor:
    """Reads GGUF's little-endian values from a bytes buffer, reading more of the file when it runs out."""

    def __init__(self, f, path: Path) -> None:
        self.f, self.path = f, path
        self.buf = b""
        self.pos = 0  # in buf
        self.base = 0  # file offset of buf[0]

    def need(self, n: int) -> None:
        if self.pos + n > len(self.buf):
            more = self.f.read(max(n, 1 << 20))
            if self.pos + n > len(self.buf) + len(more):
                raise GGUFFormatError(f"{self.path}: truncated header (at byte {self.base + self.pos})")
            self.base += self.pos
            self.buf = self.buf[self.pos :] + more
            self.pos = 0

    def unpack(self, code: str) -> Any:
        size = struct.calcsize("<" + code)
        self.need(size)
        (value,) = struct.unpack_from("<" + code, self.buf, self.pos)
        self.pos += size
        return value

    def string(self) -> str:
        n = self.unpack("Q")
        self.need(n)
        text = self.buf[self.pos : self.pos + n].decode("utf-8")
        self.pos += n
        return text

    def value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            item_type, count = self.unpack("I"), self.unpack("Q")
            if item_type in _NUMPY:
                size = np.dtype(_NUMPY[item_type]).itemsize * count
                self.need(size)
                items = np.frombuffer(self.buf, dtype=_NUMPY[item_type], count=count, offset=self.pos).tolist()
                self.pos += size
                return items
            return [self.value(item_type) for _ in range(count)]
        code = _SCALAR.get(vtype)
        if code is None:
            raise GGUFFormatError(f"{self.path}: unknown value type {vtype} (at byte {self.base + self.pos})")
        return self.unpack(code)

    @property
    def offset(self) -> int:
        return self.base + self.pos


def tensor_nbytes(shape: tuple[int, ...], tensor_type: int) -> int:
    try:
        block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(tensor_type)]
    except (ValueError, KeyError):
        raise GGUFFormatError(f"unknown tensor type {tensor_type}") from None
    elements = int(np.prod(shape, dtype=np.int64)) if shape else 1
    if elements % block:
        raise GGUFFormatError(f"a tensor of {elements} values is not whole blocks of {block}")
    return elements // block * block_bytes


def read_gguf(path: str | Path) -> GGUFFile:
    """Parse a GGUF file's header: its metadata and where each tensor lies (the tensors are read on demand)."""
    path = Path(path)
    with open(path, "rb") as f:
        cur = _Cursor(f, path)
        cur.need(4)
        if cur.buf[:4] != GGUF_MAGIC:
            raise GGUFFormatError(f"{path} is not a GGUF file (no GGUF magic)")
        cur.pos = 4
        version = cur.unpack("I")
        if version not in (2, 3):
            raise GGUFFormatError(f"{path}: GGUF version {version} is not supported (2 and 3 are)")
        n_tensors, n_kv = cur.unpack("Q"), cur.unpack("Q")
        metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = cur.string()
            metadata[key] = cur.value(cur.unpack("I"))
        raw = []
        for _ in range(n_tensors):
            name = cur.string()
            dims = tuple(cur.unpack("Q") for _ in range(cur.unpack("I")))
            raw.append((name, tuple(int(d) for d in reversed(dims)), cur.unpack("I"), cur.unpack("Q")))
        alignment = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        data_start = -(-cur.offset // alignment) * alignment
        size = path.stat().st_size
    tensors = {}
    for name, shape, ttype, offset in raw:
        info = TensorInfo(name, shape, ttype, data_start + offset, tensor_nbytes(shape, ttype))
        if info.offset + info.nbytes > size:
            raise GGUFFormatError(f"{path}: tensor {name} runs past the end of the file")
        tensors[name] = info
    return GGUFFile(path, metadata, tensors)
