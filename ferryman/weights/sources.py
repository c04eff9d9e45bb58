"""Where checkpoint tensors come from: memory-mapped safetensors files, or generated dummy weights.

A source answers `names()`, `shape(name)`, `file_of(name)` and `get(name)`; the loader never cares
which kind it talks to, so dummy weights go through the same name mapping and shape checks.
"""

from __future__ import annotations

import json
import math
import zlib
from pathlib import Path
from collections.abc import Callable
from typing import Any, Protocol

import torch
from safetensors import SafetensorError, safe_open

from ferryman.errors import ModelLoadError

Shape = tuple[int, ...]


class TensorSource(Protocol):
    def names(self) -> set[str]: ...
    def shape(self, name: str) -> Shape: ...
    def file_of(self, name: str) -> str: ...
    def get(self, name: str) -> torch.Tensor: ...


class SafetensorsSource:
    """Single-file or sharded (`model.safetensors.index.json`) checkpoints, memory-mapped."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        index = self.folder / "model.safetensors.index.json"
        if index.exists():
            weight_map = _weight_map(index)
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in self.folder.glob("*.safetensors"))
            weight_map = {}
        if not files:
            raise ModelLoadError(f"no *.safetensors files in {self.folder}")
        self._handles = {}
        self._where: dict[str, str] = {}
        for f in files:
            path = self.folder / f
            if not path.exists():
                raise ModelLoadError(f"{index.name} lists {f}, which is not in {self.folder}")
            h = _open(path)
            self._handles[f] = h
            for k in h.keys():
                self._where[k] = f
        # names the index promises but no file holds are reported by the loader as missing
        self._expected_file = weight_map

    def names(self) -> set[str]:
        return set(self._where)

    def shape(self, name: str) -> Shape:
        return tuple(self._handles[self._where[name]].get_slice(name).get_shape())

    def file_of(self, name: str) -> str:
        f = self._where.get(name) or self._expected_file.get(name)
        if f is None and len(self._handles) > 1:
            return f"any *.safetensors file of {self.folder}"
        return str(self.folder / (f or next(iter(self._handles))))

    def get(self, name: str) -> torch.Tensor:
        try:
            return self._handles[self._where[name]].get_tensor(name)
        except (SafetensorError, OSError) as e:
            raise ModelLoadError(f"cannot read tensor {name!r} from {self.folder / self._where[name]}: {e}") from None


def _weight_map(index: Path) -> dict[str, str]:
    """The index file's tensor -> shard file map."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (ValueError, KeyError, TypeError) as e:
        raise ModelLoadError(f"{index} is not a safetensors index (a JSON object with a 'weight_map'): {e}") from None
    if not isinstance(weight_map, dict):
        raise ModelLoadError(f"{index}: 'weight_map' must map tensor names to file names")
    return weight_map


def _open(path: Path) -> Any:
    """A safetensors handle; a truncated or corrupt file is a ModelLoadError naming it (the header
    states every tensor's byte range, so a file cut short fails here, before any tensor is read)."""
    try:
        return safe_open(str(path), framework="pt")
    except (SafetensorError, OSError) as e:
        raise ModelLoadError(f"{path} is not a readable safetensors file ({path.stat().st_size:,} bytes: "
                             f"{e}); it may be truncated or still downloading: fetch it again") from None


class DummySource:
    """Random tensors of the checkpoint's exact names, shapes and dtypes, generated on demand.

    Values are scaled so activations stay finite through many layers: matrices ~ N(0, 1/H),
    norms = 1, biases and sinks small, MXFP4 blocks uniform with scales chosen so the dequantised
    weights have std ~ 1/sqrt(K). Each tensor has its own generator seeded from (seed, name), so
    the result does not depend on load order.
    """

    def __init__(self, schema: dict[str, tuple[Shape, torch.dtype]], hidden: int, seed: int, device: torch.device,
                 parts: Callable[[str], torch.Tensor | None] | None = None) -> None:
        """parts: the values of a quantised Linear's part by name (None for other tensors)."""
        self.schema, self.hidden, self.seed, self.device = schema, hidden, seed, torch.device(device)
        self.parts = parts

    def names(self) -> set[str]:
        return set(self.schema)

    def shape(self, name: str) -> Shape:
        return tuple(self.schema[name][0])

    def file_of(self, name: str) -> str:
        return "<dummy weights>"

    def get(self, name: str) -> torch.Tensor:
        shape, dtype = self.schema[name]
        part = self.parts(name) if self.parts is not None else None
        if part is not None:
            return part
        g = torch.Generator(device=self.device)
        g.manual_seed(self.seed * 1_000_003 + zlib.crc32(name.encode()))
        kw = dict(generator=g, device=self.device)
        if name.endswith("_blocks"):
            return torch.randint(0, 256, shape, dtype=torch.uint8, **kw)
        if name.endswith("_scales"):
            # e2m1 values have RMS ~2.93; want std 1/sqrt(K) with K = 32 * shape[-1]
            k = 32 * shape[-1]
            center = 127 + round(math.log2(1.0 / (math.sqrt(k) * 2.93)))
            return torch.randint(center - 1, center + 2, shape, dtype=torch.uint8, **kw)
        if name.endswith("norm.weight"):
            return torch.ones(shape, dtype=dtype, device=self.device)
        if name.endswith("embed_tokens.weight"):
            return torch.randn(shape, dtype=torch.float32, **kw).to(dtype)
        if name.endswith(("bias", "sinks")) or len(shape) == 1:
            return (0.02 * torch.randn(shape, dtype=torch.float32, **kw)).to(dtype)
        std = 1.0 / math.sqrt(self.hidden)
        return (std * torch.randn(shape, dtype=torch.float32, **kw)).to(dtype)
