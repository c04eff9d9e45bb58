"""Expert weight formats: how the routed experts of one MoE layer are laid out in *banks*.

A bank is one tensor whose leading dim is E (experts, or cache slots). Bank names are fixed across
formats (docs/interfaces.md, "Expert formats"): w13 (gate and up, logical [E, 2I, H]), w2 (down,
[E, H, I]), optional w13_bias [E, 2I] and w2_bias [E, H] in the model dtype. Formats are stateless
singletons in a registry keyed by name.
"""

from __future__ import annotations

import functools
import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import torch

Banks = dict[str, torch.Tensor]
PROJECTIONS = ("w13", "w2")


@functools.cache
def triton_available() -> bool:
    """Whether Triton imports here (the kernels of quant/ and layers/ need it on CUDA)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@dataclass(frozen=True)
class BankSpec:
    """Shape and dtype of one bank (leading dim = experts or slots)."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def empty(self, device: torch.device | str = "cpu") -> torch.Tensor:
        return torch.empty(self.shape, dtype=self.dtype, device=device)


def check_proj(proj: str) -> None:
    if proj not in PROJECTIONS:
        raise ValueError(f"proj must be one of {PROJECTIONS}, got {proj!r}")


class ExpertFormat(ABC):
    """Layout + reference dequantisation of the routed-expert banks of one layer."""

    name: str
    # The GPU decode kernel reads this format's uncached experts from pinned host memory about as
    # fast as a copy moves them (benchmarks/bench_host_reads.py; docs/benchmarks.md): the planner
    # lets offloaded decode steps read misses over the link (planner.plan_decode_misses) only then.
    link_reads: bool = True

    @abstractmethod
    def weight_specs(self, num_experts: int, hidden: int, inter: int, dtype: torch.dtype) -> dict[str, BankSpec]:
        """The weight banks of this format (dims > 0); `dtype` is the model (compute) dtype."""

    @abstractmethod
    def random_weights(self, num_experts: int, hidden: int, inter: int, dtype: torch.dtype,
                       generator: torch.Generator | None, device: torch.device | str) -> Banks:
        """Valid random weight banks: values with std ~ 1/sqrt(fan_in)."""

    @abstractmethod
    def dequant(self, banks: Banks, proj: str, idx: torch.Tensor | slice,
                dtype: torch.dtype | None = None) -> torch.Tensor:
        """Weights of experts `idx` ([n] ids, or a slice: views where the format stores weights as they
        are) for `proj` ("w13" | "w2") -> [n, out, in] in `dtype` (default: `model_dtype(banks)`).
        Only the n selected experts are materialised."""

    @abstractmethod
    def dims(self, banks: Banks) -> tuple[int, int, int]:
        """(num_experts_or_slots, hidden, inter) read from the bank shapes."""

    def bank_specs(self, num_experts: int, hidden: int, inter: int, bias: bool,
                   dtype: torch.dtype) -> dict[str, BankSpec]:
        """Every bank this format needs: its weights, and the optional biases in the model dtype."""
        if hidden <= 0 or inter <= 0:
            raise ValueError(f"expert dims must be positive, got hidden={hidden}, inter={inter}")
        specs = self.weight_specs(num_experts, hidden, inter, dtype)
        if bias:
            specs["w13_bias"] = BankSpec((num_experts, 2 * inter), dtype)
            specs["w2_bias"] = BankSpec((num_experts, hidden), dtype)
        return specs

    def random_banks(self, num_experts: int, hidden: int, inter: int, bias: bool, dtype: torch.dtype,
                     generator: torch.Generator | None = None, device: torch.device | str = "cpu") -> Banks:
        """Valid random banks (dummy weights, tests); biases with std 0.1."""
        specs = self.bank_specs(num_experts, hidden, inter, bias, dtype)  # checks the dims
        banks = self.random_weights(num_experts, hidden, inter, dtype, generator, device)
        gen_device = generator.device if generator is not None else torch.device(device)
        for name in ("w13_bias", "w2_bias") if bias else ():
            banks[name] = (torch.randn(specs[name].shape, generator=generator, device=gen_device) * 0.1).to(device, dtype)
        return banks

    def expert_bytes(self, hidden: int, inter: int, bias: bool, dtype: torch.dtype) -> int:
        """Bytes of one expert across all its banks."""
        return sum(s.nbytes for s in self.bank_specs(1, hidden, inter, bias, dtype).values())

    def bank(self, banks: Banks, name: str) -> torch.Tensor:
        """banks[name], or a ValueError naming the missing bank."""
        got = banks.get(name)
        if got is None:
            raise ValueError(f"{self.name} banks: missing {name!r} (have {sorted(banks)})")
        return got

    def has_bias(self, banks: Banks) -> bool:
        return "w13_bias" in banks and "w2_bias" in banks

    def check_banks(self, banks: Banks) -> None:
        """ValueError naming the first bank that is missing or has the wrong shape/dtype."""
        e, h, i = self.dims(banks)
        specs = self.bank_specs(e, h, i, self.has_bias(banks), self.model_dtype(banks))
        for name, spec in specs.items():
            got = self.bank(banks, name)
            if tuple(got.shape) != spec.shape or got.dtype != spec.dtype:
                raise ValueError(f"{self.name} bank {name!r}: expected {spec.shape} {spec.dtype}, "
                                 f"got {tuple(got.shape)} {got.dtype}")

    def model_dtype(self, banks: Banks) -> torch.dtype:
        """dtype of the float banks, the default compute dtype (bf16 when nothing says)."""
        bias = banks.get("w13_bias")
        return bias.dtype if bias is not None else torch.bfloat16


_FORMATS: dict[str, ExpertFormat] = {}
# parametrised formats ("family:params", e.g. a GGUF type pair or an int4 group size): the family's
# factory builds the instance for a full name the first time `get_format` meets it
_FAMILIES: dict[str, Callable[[str], ExpertFormat]] = {}


def register_format(fmt: ExpertFormat) -> ExpertFormat:
    """Add a format instance to the registry (its `name` is the key); returns it."""
    if fmt.name in _FORMATS and type(_FORMATS[fmt.name]) is not type(fmt):
        raise ValueError(f"expert format {fmt.name!r} is already registered")
    _FORMATS[fmt.name] = fmt
    return fmt


def register_family(family: str, factory: Callable[[str], ExpertFormat]) -> None:
    """Formats named "family:params" are built by `factory(name)` (ValueError for bad params) and
    registered when first asked for; the instance's `name` must be the full name."""
    if ":" in family:
        raise ValueError(f"format family names hold no ':', got {family!r}")
    _FAMILIES[family] = factory


def get_format(name: str) -> ExpertFormat:
    """The registered format called `name` (a family's member is built on first use); ValueError
    listing the known ones otherwise."""
    fmt = _FORMATS.get(name)
    family = name.split(":", 1)[0] if ":" in name else None
    if fmt is None and family in _FAMILIES:
        fmt = _FAMILIES[family](name)
        if fmt.name != name:
            raise ValueError(f"format family {family!r} built {fmt.name!r} for {name!r}")
        return register_format(fmt)
    if fmt is None:
        raise ValueError(f"unknown expert format {name!r}; known formats: {sorted(_FORMATS)}")
    return fmt


def known_formats() -> list[str]:
    """Registered format names, and each family as "family:..."."""
    return sorted(_FORMATS) + sorted(f"{f}:..." for f in _FAMILIES)
