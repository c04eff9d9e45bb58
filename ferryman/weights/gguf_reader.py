"""A GGUF file's metadata and tensor table, read from a memory map with `struct`.

gguf-py's `GGUFReader` makes a numpy view of every part of every metadata value: a 200k-token
vocabulary with its merges costs it millions of views (about 12 s on a 2-core machine) before any
tensor is read. This reader decodes the same format into plain Python values (string arrays in one
pass of `struct`, numeric arrays through `np.frombuffer`) and builds each tensor's memory-mapped
view exactly as gguf-py does (float types as their dtype, block types as uint8 rows of
`quant_shape_to_byte_shape`), so everything downstream is unchanged. tests/test_gguf_reader.py
checks it against gguf-py on every kind of file the tests write.

Invariants: nothing but the header, metadata and tensor table is read at open; a tensor's bytes are
read when its `data` is; a file cut short or with a bad magic raises ValueError naming what is wrong.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from os import PathLike
from typing import Any

import numpy as np

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
# GGUFValueType -> struct format of one scalar (8 STRING and 9 ARRAY are read apart)
_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_OWN_DTYPE = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8, "I16": np.int16,
                "I32": np.int32, "I64": np.int64}  # tensor types gguf-py views in their own dtype


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor's entry, as gguf-py's ReaderTensor names its fields."""

    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: np.ndarray  # [n_dims] uint64, ggml order (innermost first)
    n_elements: int
    n_bytes: int
    data_offset: int  # from the start of the file
    data: np.ndarray  # memory-mapped


class GGUFFile:
    """`fields`: metadata key -> value (str, int, float, bool, or a list of them); `tensors` in file
    order; `data`: the file's memory map."""

    def __init__(self, path: PathLike[str] | str) -> None:
        self.data = np.memmap(path, mode="r")
        self._buf = memoryview(self.data)
        if bytes(self._buf[:4]) != GGUF_MAGIC:
            raise ValueError("GGUF magic invalid")
        version, tensor_count, kv_count = self._unpack(4, "<IQQ")
        if version not in SUPPORTED_VERSIONS:
            raise ValueError(f"GGUF version {version} (big-endian or unknown); readable: {SUPPORTED_VERSIONS}")
        offs = 4 + struct.calcsize("<IQQ")
        self.fields: dict[str, Any] = {}
        for _ in range(kv_count):
            key, offs = self._string(offs)
            (kind,), offs = self._unpack(offs, "<I"), offs + 4
            self.fields[key], offs = self._value(offs, kind)
        infos = []
        for _ in range(tensor_count):
            name, offs = self._string(offs)
            (n_dims,) = self._unpack(offs, "<I")
            dims = np.frombuffer(self._bytes(offs + 4, 8 * n_dims), dtype="<u8").copy()
            raw_type, rel = self._unpack(offs + 4 + 8 * n_dims, "<IQ")
            offs += 4 + 8 * n_dims + 12
            infos.append((name, dims, raw_type, rel))
        align = int(self.fields.get("general.alignment", DEFAULT_ALIGNMENT))
        if align <= 0 or align & (align - 1):
            raise ValueError(f"invalid alignment {align}: must be a power of two")
        start = offs + (-offs % align)
        self.tensors = [self._tensor(start, *info) for info in infos]
        if len({t.name for t in self.tensors}) != len(self.tensors):
            raise ValueError("duplicated tensor names")

    def get_field(self, key: str) -> Any:
        """The metadata value of `key`, or None."""
        return self.fields.get(key)

    # ---- decoding ------------------------------------------------------------------------------
    def _bytes(self, offs: int, n: int) -> memoryview:
        if offs + n > len(self._buf):
            raise ValueError(f"the file ends at byte {len(self._buf):,}, inside a field at {offs:,} (cut short?)")
        return self._buf[offs : offs + n]

    def _unpack(self, offs: int, fmt: str) -> tuple[Any, ...]:
        return struct.unpack(fmt, self._bytes(offs, struct.calcsize(fmt)))

    def _string(self, offs: int) -> tuple[str, int]:
        (n,) = self._unpack(offs, "<Q")
        return str(self._bytes(offs + 8, n), "utf-8"), offs + 8 + n

    def _value(self, offs: int, kind: int) -> tuple[Any, int]:
        if kind == _STRING:
            return self._string(offs)
        if kind == _ARRAY:
            item, count = self._unpack(offs, "<IQ")
            return self._array(offs + 12, item, count)
        fmt = _SCALAR.get(kind)
        if fmt is None:
            raise ValueError(f"unknown metadata value type {kind} at byte {offs:,}")
        return self._unpack(offs, fmt)[0], offs + struct.calcsize(fmt)

    def _array(self, offs: int, item: int, count: int) -> tuple[list[Any], int]:
        fmt = _SCALAR.get(item)
        if fmt is not None:  # numbers: one view of the whole run
            n = struct.calcsize(fmt) * count
            return np.frombuffer(self._bytes(offs, n), dtype=np.dtype(fmt)).tolist(), offs + n
        if item == _STRING:
            out: list[Any] = []
            buf, end = self._buf, len(self._buf)
            for _ in range(count):
                if offs + 8 > end:
                    raise ValueError(f"the file ends at byte {end:,}, inside a string array (cut short?)")
                (n,) = struct.unpack_from("<Q", buf, offs)
                out.append(str(self._bytes(offs + 8, n), "utf-8"))
                offs += 8 + n
            return out, offs
        values = []
        for _ in range(count):  # arrays of arrays
            value, offs = self._value(offs, item)
            values.append(value)
        return values, offs

    def _tensor(self, start: int, name: str, dims: np.ndarray, raw_type: int, rel: int) -> GGUFTensor:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
        from gguf.quants import quant_shape_to_byte_shape

        kind = GGMLQuantizationType(raw_type)  # ValueError names an unknown type
        n_elems = int(np.prod(dims))
        block, size = GGML_QUANT_SIZES[kind]
        n_bytes = n_elems * size // block
        offs = start + rel
        shape = tuple(reversed(dims.tolist()))
        dtype = _OWN_DTYPE.get(kind.name)
        if dtype is None:
            dtype, shape = np.uint8, quant_shape_to_byte_shape(shape, kind)
        if offs + n_bytes > len(self.data):
            raise ValueError(f"tensor {name!r} ends at byte {offs + n_bytes:,}, past the file's end at "
                             f"{len(self.data):,} (cut short?)")
        data = self.data[offs : offs + n_bytes].view(dtype).reshape(shape)
        return GGUFTensor(name, kind, dims, n_elems, n_bytes, offs, data)
