"""A GGUF model on disk: one file, a split set (`NAME-00001-of-0000N.gguf`), or a folder holding one
of those. Opened by weights/gguf_reader.py (memory-mapped: nothing is read until a tensor is).

`GGUFModel` answers metadata look-ups (`get`, `require`) and holds every tensor of every split by
name. A file that is not GGUF, is cut short, or holds a tensor of a type ferryman does not run
raises a one-line `ModelLoadError` naming the file (and the tensor).
"""

from __future__ import annotations

import mmap
import re
import struct
from pathlib import Path
from typing import Any

import numpy as np

from ferryman.errors import ModelLoadError
from ferryman.weights.gguf_reader import GGUFFile, GGUFTensor

_SPLIT = re.compile(r"^(?P<stem>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")
# tensor types ferryman loads (dense ones dequantised, experts kept in their blocks)
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K",
                   "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS", "MXFP4")


def is_gguf_path(model: str | Path) -> bool:
    """A .gguf file, or a folder that holds GGUF files and no config.json (a Hugging Face folder)."""
    path = Path(model).expanduser()
    if path.is_dir():
        return not (path / "config.json").exists() and any(path.glob("*.gguf"))
    return path.suffix == ".gguf"


def gguf_files(model: str | Path) -> list[Path]:
    """The files of one GGUF model, in split order: `model` is a .gguf file (the first of a split
    set finds the others) or a folder holding exactly one model."""
    path = Path(model).expanduser()
    if path.is_dir():
        found = sorted(path.glob("*.gguf"))
        firsts = [p for p in found if (m := _SPLIT.match(p.name)) is None or int(m["no"]) == 1]
        if len(firsts) != 1:
            names = ", ".join(p.name for p in firsts) or "none"
            raise ModelLoadError(f"{path} must hold exactly one GGUF model (one file or one split set); found {names}: "
                                 f"pass the .gguf file itself")
        path = firsts[0]
    if not path.exists():
        raise ModelLoadError(f"GGUF file {path} does not exist")
    m = _SPLIT.match(path.name)
    if m is None:
        return [path]
    if int(m["no"]) != 1:
        raise ModelLoadError(f"{path.name} is part {int(m['no'])} of a split GGUF model; pass the first part, "
                             f"{m['stem']}-00001-of-{m['count']}.gguf")
    count = int(m["count"])
    parts = [path.with_name(f"{m['stem']}-{i:05d}-of-{m['count']}.gguf") for i in range(1, count + 1)]
    missing = [p.name for p in parts if not p.exists()]
    if missing:
        raise ModelLoadError(f"split GGUF model {path.name}: part {missing[0]} is missing from {path.parent} "
                             f"({len(missing)} of {count} parts missing)")
    return parts


def open_reader(path: Path) -> GGUFFile:
    """The metadata and tensor table of `path` (weights/gguf_reader.py); a bad or cut-short file is a
    ModelLoadError naming it."""
    try:
        return GGUFFile(path)
    except ValueError as e:
        if "magic" in str(e).lower():
            raise ModelLoadError(f"{path} is not a GGUF file (its first bytes are not 'GGUF')") from None
        if "GGMLQuantizationType" in str(e):
            raise ModelLoadError(f"{path} holds a tensor of a type gguf-py does not know ({e}); supported: "
                                 f"{', '.join(SUPPORTED_TYPES)}") from None
        raise ModelLoadError(f"{path} is not a readable GGUF file ({path.stat().st_size:,} bytes: {e}); "
                             f"it may be truncated or still downloading: fetch it again") from None
    except (IndexError, OSError, KeyError, UnicodeDecodeError, struct.error) as e:
        raise ModelLoadError(f"{path} is not a readable GGUF file ({path.stat().st_size:,} bytes: "
                             f"{type(e).__name__}: {e}); it may be truncated: fetch it again") from None


class GGUFModel:
    """Every split of one GGUF model: metadata from the first, tensors from all."""

    def __init__(self, model: str | Path) -> None:
        self.files = gguf_files(model)
        self.path = self.files[0]
        self.readers = [open_reader(f) for f in self.files]
        self.tensors: dict[str, GGUFTensor] = {}
        self.file_of_tensor: dict[str, Path] = {}
        self.reader_of: dict[str, GGUFFile] = {}
        for f, reader in zip(self.files, self.readers):
            for t in reader.tensors:
                self.tensors[t.name] = t
                self.file_of_tensor[t.name] = f
                self.reader_of[t.name] = reader
        self.arch = str(self.require("general.architecture"))

    # ---- metadata ----------------------------------------------------------------------------
    def get(self, key: str, default: Any = None) -> Any:
        """A metadata value (`{arch}` in `key` is the file's architecture), or `default`."""
        key = key.replace("{arch}", getattr(self, "arch", ""))
        value = self.readers[0].get_field(key)
        return default if value is None else value

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise ModelLoadError(f"{self.path}: metadata key {key.replace('{arch}', getattr(self, 'arch', ''))!r} "
                                 f"is missing")
        return value

    # ---- tensors -----------------------------------------------------------------------------
    def has(self, name: str) -> bool:
        return name in self.tensors

    def type_name(self, name: str) -> str:
        return self.tensors[name].tensor_type.name

    def shape(self, name: str) -> tuple[int, ...]:
        """The tensor's logical shape in torch order (outermost first), e.g. [E, I, H] for ffn_gate_exps."""
        return tuple(int(d) for d in reversed(self.tensors[name].shape.tolist()))

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as stored (memory-mapped): float types as floats, block types as
        uint8 rows `[..., rows, row_bytes]`."""
        return self.tensors[name].data

    def file_of(self, name: str) -> str:
        return str(self.file_of_tensor.get(name, self.path))

    def release(self, name: str) -> None:
        """Drop the tensor's pages from this process's mapping (it has been copied): the process then
        holds one copy of the model, not the copy plus the file's pages (the kernel's page cache
        keeps them; a later read faults them back in)."""
        t = self.tensors[name]
        mapping = getattr(self.reader_of[name].data, "_mmap", None)
        if mapping is None or not hasattr(mmap, "MADV_DONTNEED"):
            return
        start = int(t.data_offset) // mmap.PAGESIZE * mmap.PAGESIZE
        length = int(t.data_offset) + int(t.n_bytes) - start
        try:
            mapping.madvise(mmap.MADV_DONTNEED, start, length)
        except (OSError, ValueError):  # not supported here: the pages stay until the mapping closes
            pass

    def check_types(self) -> None:
        """ModelLoadError naming the first tensor of a type ferryman does not load."""
        for name, t in self.tensors.items():
            if t.tensor_type.name not in SUPPORTED_TYPES:
                raise ModelLoadError(f"{self.file_of(name)}: tensor {name!r} has type {t.tensor_type.name}, which "
                                     f"ferryman does not load (supported: {', '.join(SUPPORTED_TYPES)})")
