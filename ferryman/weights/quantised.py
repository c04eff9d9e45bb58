"""Checkpoints whose Linear layers are quantised (`QuantConfig.linear`): the schema of their parts,
and how each weight is read.

Every 2-D `<module>.weight` of a Linear (not the embedding, lm_head, norms or routers) that the
ignore list does not name is stored as its layout's parts (quant/linear_layouts.py). A routed
expert's parts fill its format's banks, packed; any other Linear is dequantised at load to the model
dtype. A layer's routed experts share one format: an expert the ignore list names, or stored in
another dtype, is an error naming the tensor.
"""

from __future__ import annotations

import zlib
from dataclasses import replace

import torch

from ferryman.config import ModelConfig
from ferryman.errors import WeightError
from ferryman.models.base import Architecture, Target, TensorSpec
from ferryman.quant.hf_quant import is_ignored
from ferryman.quant.linear_layouts import LinearLayout, is_linear_weight, linear_layout
from ferryman.weights.sources import TensorSource

class QuantisedLinears:
    """The quantised schema of one checkpoint and the reading of its Linears."""

    def __init__(self, arch: Architecture, cfg: ModelConfig, schema: dict[str, TensorSpec],
                 available: set[str] | None = None) -> None:
        """available: the checkpoint's tensor names. A Linear other than a routed expert is then
        quantised where the files hold its scales (releases leave layers out by `targets`, `ignore`
        or exclude lists in dialects of their own); without them (dummy weights): unless ignored."""
        assert cfg.quant is not None and cfg.quant.linear
        self.arch, self.cfg = arch, cfg
        self.layout: LinearLayout = linear_layout(cfg.quant.linear)
        self.schema: dict[str, TensorSpec] = {}
        self.parts: dict[str, dict[str, str]] = {}  # weight name -> suffix -> part name
        self.weight_of: dict[str, str] = {}  # part name -> weight name
        self.logical: dict[str, TensorSpec] = {}  # weight name -> its [out, k] and model dtype
        for name, (shape, dt) in schema.items():
            module = name[: -len("weight")]  # "...gate_proj."
            if not is_linear_weight(name, shape) or self._ignored(name) or not self._stored_quantised(
                    name, module, shape, available):
                self.schema[name] = (shape, dt)
                continue
            self.logical[name] = (shape, dt)
            self.parts[name] = {}
            for suffix, spec in self.layout.parts(*shape).items():
                self.schema[module + suffix] = spec
                self.parts[name][suffix] = module + suffix
                self.weight_of[module + suffix] = name

    def _ignored(self, name: str) -> bool:
        module = name.removesuffix(".weight")
        if not is_ignored(module, self.cfg.quant.ignore if self.cfg.quant else ()):
            return False
        target = self.arch.map_name(self.cfg, name)
        if target is not None and target.kind == "expert":
            raise WeightError(name, "quantization_config", reason=f"the ignore list leaves this routed expert "
                              f"unquantised while its layer's experts are {self.layout.expert_format}: a layer "
                              f"holds one expert format")
        return True

    def _stored_quantised(self, name: str, module: str, shape: tuple[int, ...], available: set[str] | None) -> bool:
        if available is None:
            return True
        scales = [module + s for s in self.layout.parts(*shape) if s != "weight"]
        if all(s in available for s in scales):
            return True
        target = self.arch.map_name(self.cfg, name)
        if target is not None and target.kind == "expert" and name in available:
            raise WeightError(name, "the checkpoint", reason=f"stored without {scales[0].rsplit('.', 1)[1]} while "
                              f"the experts are {self.layout.expert_format}: a layer holds one expert format")
        # a routed expert's missing parts are reported missing; any other Linear is a plain weight
        return target is not None and target.kind == "expert"

    def first_part(self, name: str) -> bool:
        """Whether `name` is the first part of its weight (where the loader reads the whole weight)."""
        weight = self.weight_of[name]
        return next(iter(self.parts[weight].values())) == name

    def read(self, weight: str, source: TensorSource) -> dict[str, torch.Tensor]:
        """The parts of `weight` as stored, each checked against the layout (WeightError naming it)."""
        out: dict[str, torch.Tensor] = {}
        for suffix, name in self.parts[weight].items():
            shape, dtype = self.layout.parts(*self.logical[weight][0])[suffix]
            actual = tuple(source.shape(name))
            if not self.layout.shape_ok(suffix, shape, actual):
                raise WeightError(name, source.file_of(name), expected=shape, actual=actual)
            t = source.get(name)
            exact = not dtype.is_floating_point or dtype == torch.float8_e4m3fn  # codes; float scales may be any float
            if (exact and t.dtype != dtype) or (not exact and (not t.is_floating_point() or t.dtype.itemsize < 2)):
                raise WeightError(name, source.file_of(name), reason=f"dtype {t.dtype}, expected {dtype} "
                                  f"({self.layout.key}; a layer's experts share one format)")
            out[suffix] = t
        return out

    def dequant(self, weight: str, parts: dict[str, torch.Tensor], dtype: torch.dtype, file: str) -> torch.Tensor:
        try:
            return self.layout.dequant(parts, dtype)
        except ValueError as e:
            raise WeightError(weight, file, reason=str(e)) from None

    def expert_writes(self, weight: str, target: Target,
                      parts: dict[str, torch.Tensor]) -> list[tuple[Target, str, torch.Tensor]]:
        """(bank target, part name, tensor) for each part of a routed expert's weight."""
        out_rows = self.logical[weight][0][0]
        writes = []
        for suffix, t in parts.items():
            bp = self.layout.expert_part(suffix, t, target.rows, out_rows)
            bank = replace(target, name=target.name + bp.suffix, rows=bp.rows)
            writes.append((bank, self.parts[weight][suffix], bp.tensor))
        return writes

    def random(self, name: str, seed: int, device: torch.device) -> torch.Tensor:
        """Dummy values of part `name` (seeded from the name, as DummySource does)."""
        weight = self.weight_of[name]
        suffix = name[len(weight) - len("weight"):]
        shape = self.schema[name][0]
        g = torch.Generator(device=device)
        g.manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        return self.layout.random_part(suffix, shape, self.logical[weight][0][1], g, device)


def quantised_linears(arch: Architecture, cfg: ModelConfig, schema: dict[str, TensorSpec],
                      available: set[str] | None = None) -> QuantisedLinears | None:
    """The checkpoint's quantised Linears, or None when it stores none (unquantised, or mxfp4)."""
    if cfg.quant is None or not cfg.quant.linear or cfg.quant.linear.startswith("int:"):
        return None  # integer checkpoints are read through weights/int_source.py
    return QuantisedLinears(arch, cfg, schema, available)
