"""A GGUF file's header read in one pass: its metadata as Python values and its tensors as
views of the file's read-only map.

gguf-py's GGUFReader builds a numpy view for every part of every field, so a tokenizer's
vocabulary costs it a few numpy views a string: 3.6-4.5 s for SmolLM2's 49,152 tokens and
17.4-18.4 s for Gemma 3's 262,144, on every load and on `serve`'s check before it, where this
reader takes 0.13-0.15 s and 0.28-0.32 s (AMD EPYC Zen 3, 2026-12-07; a warm load of Gemma
3 270M went from 23.0 s to 5.0 s). It reads the same bytes to the same values
(tests/model/test_gguf_file.py holds the two to each other field by field and tensor by
tensor); gguf-py stays what writes GGUFs, names the tensor types and dequantizes.

The layout (GGUF v2 and v3, little-endian): "GGUF", a uint32 version, the tensor and
key-value counts (uint64), the key-values (a string key, a uint32 type, the value; an array
is an element type, a uint64 count and the elements), the tensors' infos (name, dimension
count, dimensions innermost first, type, offset in the data), then the data from the next
multiple of `general.alignment` (32 by default).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from gguf.quants import quant_shape_to_byte_shape

_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_SCALARS = {
    GGUFValueType.UINT8: "<u1", GGUFValueType.INT8: "<i1", GGUFValueType.UINT16: "<u2",
    GGUFValueType.INT16: "<i2", GGUFValueType.UINT32: "<u4", GGUFValueType.INT32: "<i4",
    GGUFValueType.FLOAT32: "<f4", GGUFValueType.BOOL: "?", GGUFValueType.UINT64: "<u8",
    GGUFValueType.INT64: "<i8", GGUFValueType.FLOAT64: "<f8",
}
# Tensor types whose data is a typed array (the rest, blocks, are bytes), as gguf-py views them.
_TYPED = {
    GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}
_DEFAULT_ALIGNMENT = 32


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # innermost first, as the file lists it
    n_bytes: int
    data_offset: int  # from the file's start
    # [*outer dims, row] of the type's values, or of bytes for a block format: gguf-py's
    # layout, a view of the map (np.array(...) copies it out)
    data: np.ndarray


@dataclass(frozen=True)
class GGUFFile:
    metadata: dict[str, Any]  # scalars as Python values, arrays as lists
    # each key's type, and an array's element type (None for a scalar)
    types: dict[str, tuple[GGUFValueType, GGUFValueType | None]]
    tensors: list[GGUFTensor]


def read_gguf(path: Path | str) -> GGUFFile:
    """The file's header; a ValueError if it is not a whole GGUF."""
    mm = np.memmap(path, mode="r")
    return _Parser(mm).file()


class _Parser:
    def __init__(self, mm: np.memmap) -> None:
        self.mm, self.view = mm, mm.data  # a memoryview of the map
        self.size, self.at = len(mm), 0

    def file(self) -> GGUFFile:
        if bytes(self.view[:4]) != b"GGUF":
            raise ValueError("GGUF magic invalid")
        self.at = 4
        version = self.u32()
        if version & 0xFFFF == 0:
            raise ValueError("a big-endian GGUF, which this reader does not take")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version}; this reader takes 2 and 3")
        n_tensors, n_kv = self.u64(), self.u64()
        metadata: dict[str, Any] = {}
        types: dict[str, tuple[GGUFValueType, GGUFValueType | None]] = {}
        for _ in range(n_kv):
            key = self.string()
            vtype = GGUFValueType(self.u32())
            if vtype == GGUFValueType.ARRAY:
                sub, metadata[key] = self.array()
                types[key] = (vtype, sub)
            else:
                metadata[key], types[key] = self.scalar(vtype), (vtype, None)
        infos = [self.tensor_info() for _ in range(n_tensors)]
        names = [info[0] for info in infos]
        if len(set(names)) != len(names):
            raise ValueError(f"tensor {next(n for n in names if names.count(n) > 1)} twice")
        align = metadata.get("general.alignment", _DEFAULT_ALIGNMENT)
        if "general.alignment" in types and types["general.alignment"][0] != GGUFValueType.UINT32:
            raise ValueError("general.alignment is not a uint32")
        if align <= 0 or align & (align - 1):
            raise ValueError(f"general.alignment {align} is not a power of two")
        start = -(-self.at // align) * align
        return GGUFFile(metadata, types,
                        [self.tensor(start, *info) for info in infos])

    def take(self, n: int) -> int:
        at, self.at = self.at, self.at + n
        if self.at > self.size:
            raise ValueError(f"the header runs past the file's end ({self.size} bytes)")
        return at

    def u32(self) -> int:
        return int(_U32.unpack_from(self.view, self.take(4))[0])

    def u64(self) -> int:
        return int(_U64.unpack_from(self.view, self.take(8))[0])

    def string(self) -> str:
        n = self.u64()
        at = self.take(n)
        return str(self.view[at:at + n], "utf-8")

    def scalar(self, vtype: GGUFValueType) -> Any:
        if vtype == GGUFValueType.STRING:
            return self.string()
        dtype = np.dtype(_SCALARS[vtype])
        return np.frombuffer(self.view, dtype, 1, self.take(dtype.itemsize)).item()

    def array(self) -> tuple[GGUFValueType, list[Any]]:
        """The element type and the elements."""
        vtype = GGUFValueType(self.u32())
        n = self.u64()
        if vtype == GGUFValueType.STRING:  # the vocabulary: the one long loop, kept plain
            view, unpack, out = self.view, _U64.unpack_from, []
            for _ in range(n):
                (k,) = unpack(view, self.take(8))
                at = self.take(k)
                out.append(str(view[at:at + k], "utf-8"))
            return vtype, out
        if vtype == GGUFValueType.ARRAY:
            return vtype, [self.array()[1] for _ in range(n)]
        dtype = np.dtype(_SCALARS[vtype])
        return vtype, np.frombuffer(self.view, dtype, n, self.take(n * dtype.itemsize)).tolist()

    def tensor_info(self) -> tuple[str, tuple[int, ...], GGMLQuantizationType, int]:
        name = self.string()
        dims = tuple(self.u64() for _ in range(self.u32()))
        return name, dims, GGMLQuantizationType(self.u32()), self.u64()

    def tensor(self, start: int, name: str, dims: tuple[int, ...],
               ttype: GGMLQuantizationType, offset: int) -> GGUFTensor:
        block, block_bytes = GGML_QUANT_SIZES[ttype]
        count = int(np.prod(dims, dtype=np.int64))
        n_bytes = count * block_bytes // block
        at = start + offset
        if at + n_bytes > self.size:
            raise ValueError(f"truncated: tensor {name} ends at byte {at + n_bytes}, the file "
                             f"has {self.size}")
        shape = tuple(reversed(dims))
        raw = self.mm[at:at + n_bytes]
        data = (raw.view(_TYPED[ttype]).reshape(shape) if ttype in _TYPED
                else raw.reshape(quant_shape_to_byte_shape(shape, ttype)))
        return GGUFTensor(name, ttype, dims, n_bytes, at, data)
