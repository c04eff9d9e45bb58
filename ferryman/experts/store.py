"""Expert banks: every routed expert of every MoE layer, in its checkpoint format.

Banks are `[E, ...]` tensors per layer, one per name of the format (`w13`, `w2`, `w13_blocks`, ...),
so expert e of layer l is `banks[l][name][e]` for every name. Resident mode keeps this store on the
device; offload mode uses `HostExpertStore` (experts/host_store.py): the same banks as views of
pinned host memory, each expert's banks contiguous, cached in GPU slots by experts/gpu_cache.py.
"""

from __future__ import annotations

from typing import Protocol

import torch

from ferryman.config import ModelConfig
from ferryman.errors import WeightError
from ferryman.quant.base import BankSpec, get_format
from ferryman.quant.intq import IntFormat
from ferryman.quant.intq_layouts import PackedInt


class BankTarget(Protocol):
    """Where a checkpoint tensor goes in the banks (models/base.py `Target` is one): bank `name` of
    `layer`, one `expert`'s slice (None: all experts), a destination `rows` range, `transpose`d."""

    @property
    def name(self) -> str: ...
    @property
    def layer(self) -> int: ...
    @property
    def expert(self) -> int | None: ...
    @property
    def rows(self) -> tuple[int, int] | None: ...
    @property
    def transpose(self) -> bool: ...


class ExpertStore:
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> None:
        self.cfg = cfg
        self.format = get_format(cfg.expert_format)
        # each MoE layer's format: one for all but GGUF files mixing block types (cfg.expert_formats)
        self.formats = {layer: get_format(cfg.expert_format_of(layer)) for layer in cfg.moe_layers}
        self.dtype = dtype
        self.device = torch.device(device)
        shape = (cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, cfg.expert_bias, dtype)
        specs = {name: get_format(name).bank_specs(*shape) for name in {f.name for f in self.formats.values()}}
        # banks[layer][name]: [E, ...]
        self.banks: dict[int, dict[str, torch.Tensor]] = {
            layer: self._allocate_layer(layer, specs[self.formats[layer].name]) for layer in cfg.moe_layers
        }

    def _allocate_layer(self, layer: int, specs: dict[str, BankSpec]) -> dict[str, torch.Tensor]:
        """The banks of one layer (experts/host_store.py lays them out expert-major instead)."""
        return {n: torch.empty(s.shape, dtype=s.dtype, device=self.device) for n, s in specs.items()}

    def write(self, target: BankTarget, tensor: torch.Tensor | PackedInt, source_name: str, file: str) -> None:
        """Copy one checkpoint tensor (or a packed integer linear) into the bank slice named by `target`."""
        if isinstance(tensor, PackedInt):
            self._write_packed(target, tensor, source_name, file)
            return
        banks = self.banks[target.layer]
        if target.name not in banks:  # e.g. a plain weight where the format keeps packed banks
            raise WeightError(source_name, file, reason=f"a plain tensor where the experts' format "
                              f"{self.formats[target.layer].name} keeps the banks {sorted(banks)} (is the "
                              f"checkpoint stored in the format its quantization_config says?)")
        bank = banks[target.name]
        dst = bank if target.expert is None else bank[target.expert]
        if target.rows is not None:
            dst = dst[:, target.rows[0] : target.rows[1]] if target.expert is None else dst[target.rows[0] : target.rows[1]]
        src = tensor.transpose(-1, -2) if target.transpose else tensor
        if tuple(src.shape) != tuple(dst.shape):
            raise WeightError(source_name, file, expected=dst.shape, actual=src.shape)
        src = src.to(dst.dtype) if dst.dtype != torch.uint8 else src
        if target.expert is None and not dst.is_contiguous() and dst[0].is_contiguous():
            # a whole bank into the expert-major host store: one contiguous copy per expert (a
            # device -> pinned copy then runs at link speed, not through a pageable temporary)
            for e in range(dst.shape[0]):
                dst[e].copy_(src[e])
            return
        dst.copy_(src)

    def _write_packed(self, target: BankTarget, packed: PackedInt, source_name: str, file: str) -> None:
        """One expert's linear in the canonical int layout (quant/intq.py) into its rows of the banks."""
        fmt = self.format
        if not isinstance(fmt, IntFormat) or packed.params != fmt.params:
            raise WeightError(source_name, file, reason=f"packed as {packed.params.name}, but the routed experts "
                                                        f"of this model are {fmt.name} (a layer holds one format)")
        banks = self.banks[target.layer]
        num, hidden, inter = fmt.dims(banks)
        stacked = packed.qweight.dim() == 3  # all experts at once (dummy weights of fused-expert models)
        if target.name not in ("w13", "w2") or (target.expert is None) != stacked or \
                (stacked and packed.qweight.shape[0] != num):
            raise WeightError(source_name, file, reason="packed integer weights are read per expert and projection")
        rows = target.rows or (0, hidden if target.name == "w2" else 2 * inter)
        want = (rows[1] - rows[0], hidden if target.name == "w13" else inter)
        if tuple(packed.shape) != want:
            raise WeightError(source_name, file, expected=want, actual=packed.shape)
        # a packed linear is always [out, K] (target.transpose describes the unquantised tensor)
        expert = slice(None) if target.expert is None else target.expert
        fmt.write_linear(banks, target.name, expert, target.rows, packed.qweight, packed.scales, packed.zeros,
                         packed.gidx)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for b in self.banks.values() for t in b.values())
