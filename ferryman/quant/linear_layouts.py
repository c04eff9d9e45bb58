"""How one quantised Linear's tensors look in a checkpoint, and where each goes.

A layout replaces a Linear's `<module>.weight` [out, k] by its parts (`weight`, `weight_scale_inv`,
`weight_packed`, ...). `parts(out, k)` lists them as the files hold them (the loader checks
shapes and dtypes against it); `dequant(parts, dtype)` is the [out, k] weight for the layers loaded
in the model dtype (attention, dense MLPs, shared experts); `expert_part` says which bank of the
routed experts' format a part fills, and its rows there; `random_part` gives valid dummy values.
Layouts are named "kind:params" (`QuantConfig.linear`); `register_linear(kind, factory)` adds a kind.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ferryman.quant.fp8 import FP8, Block, dequant_fp8, scale_grid
from ferryman.quant.nvfp4 import GROUP, dequant_nvfp4

Shape = tuple[int, ...]
PartSpec = tuple[Shape, torch.dtype]
Rows = tuple[int, int] | None


NOT_LINEAR = frozenset({"embed_tokens", "lm_head", "gate", "router", "shared_expert_gate"})


def is_linear_weight(name: str, shape: Shape) -> bool:
    """A Linear's 2-D `.weight` that quantised checkpoints store in parts: not the embedding,
    lm_head, a norm or a router (those stay in the model dtype in every release)."""
    if len(shape) != 2 or not name.endswith(".weight"):
        return False
    leaf = name.rsplit(".", 2)[-2]
    return leaf not in NOT_LINEAR and "norm" not in leaf


@dataclass(frozen=True)
class BankPart:
    """Where a part of a routed expert's weight goes: bank `<proj><suffix>`, `rows` of the expert."""

    suffix: str  # appended to "w13" / "w2": "" (the weights), "_scale", "_packed", "_gscale"
    tensor: torch.Tensor
    rows: Rows


class LinearLayout(ABC):
    key: str
    expert_format: str  # the ExpertFormat the routed experts are kept in

    @abstractmethod
    def parts(self, out: int, k: int) -> dict[str, PartSpec]:
        """Suffix (replacing "weight") -> (shape, dtype) of each tensor of one [out, k] Linear."""

    @abstractmethod
    def dequant(self, parts: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """The Linear's [out, k] weight in `dtype`, by the layout's reference formula."""

    @abstractmethod
    def expert_part(self, suffix: str, t: torch.Tensor, rows: Rows, out: int) -> BankPart:
        """Part `suffix` of an expert weight of `out` rows that fills `rows` of its w13/w2 (None: all)."""

    @abstractmethod
    def random_part(self, suffix: str, shape: Shape, k: int, gen: torch.Generator, device: torch.device) -> torch.Tensor:
        """Valid random values for dummy weights: the Linear's values with std ~ 1/sqrt(k)."""

    def shape_ok(self, suffix: str, expected: Shape, actual: Shape) -> bool:
        """Whether a part's shape fits (a per-tensor scale may be stored as [] or [1])."""
        return tuple(expected) == tuple(actual)


class Fp8Linear(LinearLayout):
    """FP8 e4m3 `weight` times fp32 scales named `scale_name`: per [bn, bk] block, per output row
    ([out, 1]) or per tensor ([] or [1])."""

    def __init__(self, strategy: str, block: Block, scale_name: str) -> None:
        self.strategy, self.block, self.scale_name = strategy, block, scale_name
        grid = f"block-{block[0]}x{block[1]}" if block else strategy
        self.key = f"fp8:{grid}:{scale_name}"
        self.expert_format = f"fp8:{block[0]}x{block[1]}" if block else "fp8:channel"

    def _scale_shape(self, out: int, k: int) -> Shape:
        return {"block": scale_grid(out, k, self.block), "channel": (out, 1), "tensor": (1,)}[self.strategy]

    def parts(self, out: int, k: int) -> dict[str, PartSpec]:
        return {"weight": ((out, k), FP8), self.scale_name: (self._scale_shape(out, k), torch.float32)}

    def shape_ok(self, suffix: str, expected: Shape, actual: Shape) -> bool:
        if suffix == self.scale_name and self.strategy == "tensor":
            return math.prod(actual) == 1 and len(actual) <= 1
        return tuple(expected) == tuple(actual)

    def _row_scales(self, s: torch.Tensor, out: int) -> torch.Tensor:
        """channel / tensor scales -> [out] fp32."""
        return s.float().reshape(-1).expand(out) if s.numel() == 1 else s.float().reshape(out)

    def dequant(self, parts: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        w, s = parts["weight"], parts[self.scale_name]
        if self.block is None:
            return dequant_fp8(w, self._row_scales(s, w.shape[0]), None, dtype)
        return dequant_fp8(w, s, self.block, dtype)

    def expert_part(self, suffix: str, t: torch.Tensor, rows: Rows, out: int) -> BankPart:
        if suffix == "weight":
            return BankPart("", t, rows)
        if self.block is None:
            return BankPart("_scale", self._row_scales(t, out), rows)
        bn = self.block[0]
        if rows is not None and (rows[0] % bn or rows[1] % bn):
            raise ValueError(f"rows {rows} of a stacked expert weight do not start on {bn}-row scale blocks")
        return BankPart("_scale", t, None if rows is None else (rows[0] // bn, rows[1] // bn))

    def random_part(self, suffix: str, shape: Shape, k: int, gen: torch.Generator, device: torch.device) -> torch.Tensor:
        if suffix == "weight":
            return (torch.randn(shape, generator=gen, device=device) * 32.0).to(FP8)
        return torch.full(shape, 1.0 / (32.0 * math.sqrt(k)), dtype=torch.float32, device=device)


class Nvfp4Linear(LinearLayout):
    """modelopt: `weight` (e2m1 pairs), `weight_scale` (e4m3 per 16), times `weight_scale_2`;
    compressed-tensors: `weight_packed`, `weight_scale`, divided by `weight_global_scale`."""

    def __init__(self, dialect: str) -> None:
        if dialect not in ("modelopt", "ct"):
            raise ValueError(f"nvfp4 layout {dialect!r}: expected nvfp4:modelopt or nvfp4:ct")
        self.key, self.divide = f"nvfp4:{dialect}", dialect == "ct"
        self.expert_format = "nvfp4-ct" if self.divide else "nvfp4"
        self.packed_name = "weight_packed" if self.divide else "weight"
        self.global_name = "weight_global_scale" if self.divide else "weight_scale_2"

    def parts(self, out: int, k: int) -> dict[str, PartSpec]:
        return {self.packed_name: ((out, k // 2), torch.uint8), "weight_scale": ((out, k // GROUP), FP8),
                self.global_name: ((1,), torch.float32)}

    def shape_ok(self, suffix: str, expected: Shape, actual: Shape) -> bool:
        if suffix == self.global_name:
            return math.prod(actual) == 1 and len(actual) <= 1
        return tuple(expected) == tuple(actual)

    def dequant(self, parts: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        g = parts[self.global_name].float().reshape(1)
        return dequant_nvfp4(parts[self.packed_name], parts["weight_scale"], g, self.divide, dtype)

    def expert_part(self, suffix: str, t: torch.Tensor, rows: Rows, out: int) -> BankPart:
        if suffix == self.global_name:  # column p of [parts]: gate 0, up 1 (w13); down 0 (w2)
            p = 0 if rows is None else rows[0] // out
            return BankPart("_gscale", t.float().reshape(1), (p, p + 1))
        return BankPart("_packed" if suffix == self.packed_name else "_scale", t, rows)

    def random_part(self, suffix: str, shape: Shape, k: int, gen: torch.Generator, device: torch.device) -> torch.Tensor:
        if suffix == self.packed_name:
            return torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8, device=device)
        if suffix == "weight_scale":
            return torch.exp2(torch.randint(-1, 2, shape, generator=gen, device=device).float()).to(FP8)
        g = 1.0 / (2.93 * 1.08 * math.sqrt(k))  # e2m1 codes' rms 2.93, group scales' 1.08
        return torch.full(shape, 1.0 / g if self.divide else g, dtype=torch.float32, device=device)


def _fp8(params: str) -> LinearLayout:
    try:
        grid, scale_name = params.split(":")
    except ValueError:
        raise ValueError(f"fp8 layout {params!r}: expected <block-RxC|channel|tensor>:<scale name>") from None
    if grid.startswith("block-"):
        bn, bk = (int(v) for v in grid.removeprefix("block-").split("x"))
        return Fp8Linear("block", (bn, bk), scale_name)
    if grid not in ("channel", "tensor"):
        raise ValueError(f"fp8 layout {params!r}: unknown scale grid {grid!r}")
    return Fp8Linear(grid, None, scale_name)


_KINDS: dict[str, Callable[[str], LinearLayout]] = {"fp8": _fp8, "nvfp4": Nvfp4Linear}


def register_linear(kind: str, factory: Callable[[str], LinearLayout]) -> None:
    """Layouts "kind:params" are built by factory(params)."""
    _KINDS[kind] = factory


def linear_layout(key: str) -> LinearLayout:
    """The layout named `key` ("fp8:block-128x128:weight_scale_inv", "nvfp4:ct", ...)."""
    kind, _, params = key.partition(":")
    if kind not in _KINDS:
        raise ValueError(f"unknown quantised Linear layout {key!r}; known kinds: {sorted(_KINDS)}")
    return _KINDS[kind](params)
