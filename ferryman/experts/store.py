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

    def write(self, target: BankTarget, tensor: torch.Tensor, source_name: str, file: str) -> None:
        """Copy one checkpoint tensor into the bank slice named by `target`."""
        bank = self.banks[target.layer][target.name]
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

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for b in self.banks.values() for t in b.values())
