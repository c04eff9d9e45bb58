"""MoE block: the router lives here, the expert weights do not. The block routes top-k and hands
(x, expert ids, weights) to an `ExpertBackend`, which owns the banks and maps expert ids to slots.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from ferryman.config import ModelConfig
from ferryman.layers.backend import use_triton
from ferryman.layers.router import Router, route_sigmoid

# decode-sized steps take the one-launch Triton router; prefill keeps torch's (same math)
ROUTE_TRITON_MAX_TOKENS = 256


class RoutingRecorder(Protocol):
    def record(self, layer: int, topk_ids: torch.Tensor) -> None:
        """topk_ids: [T, K] expert ids a layer routed to (tools/demo_model/trace.py's RoutingTrace)."""
        ...


class ExpertBackend(Protocol):
    def forward(self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_w: torch.Tensor) -> torch.Tensor:
        """x: [T, H], topk_ids: [T, K] expert ids, topk_w: [T, K] -> [T, H]."""
        ...


def route(logits: torch.Tensor, top_k: int, kind: str, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax router math of each family (see shared/notes/formats.md); "sigmoid" routing is
    layers/router.py's `route_sigmoid`. logits: [T, E] -> ids, weights [T, K]."""
    if use_triton(logits) and logits.shape[0] <= ROUTE_TRITON_MAX_TOKENS and logits.shape[1] <= 1024:
        from ferryman.layers.router_triton import route_triton

        return route_triton(logits, top_k, kind, renormalize)
    if kind == "topk_softmax":  # gpt-oss: top-k on raw logits, softmax over the k
        top_v, top_i = torch.topk(logits, top_k, dim=-1)
        return top_i, torch.softmax(top_v, dim=-1, dtype=top_v.dtype)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)  # [T, E]
    top_v, top_i = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        top_v = top_v / top_v.sum(dim=-1, keepdim=True)
    return top_i, top_v


class SparseMoE(nn.Module):
    """Routed experts (through the bound backend) plus, when the model has them, shared experts: an
    ordinary dense MLP of the module tree, resident, never in the expert cache."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.top_k = cfg.top_k
        self.kind = cfg.router_kind
        self.renormalize = cfg.norm_topk_prob
        self.n_group, self.topk_group, self.scaling = cfg.n_group, cfg.topk_group, cfg.routed_scaling_factor
        self.gate = Router(cfg)
        self.shared_experts = (
            DenseMLP(cfg.hidden_size, cfg.shared_intermediate_size) if cfg.shared_intermediate_size else None
        )
        self.experts: ExpertBackend | None = None  # bound by the model runner
        self.trace: RoutingRecorder | None = None  # records routing when set (measurements)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, H]
        topk_ids, topk_w = self.select(x)
        out = self.compute(x, topk_ids, topk_w)
        return out if self.shared_experts is None else out + self.shared_experts(x)

    def select(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The router: x [T, H] -> (expert ids, weights) [T, K]. No host sync (graph-capturable)."""
        logits = self.gate(x)  # [T, E]
        if self.kind == "sigmoid":
            assert self.gate.e_score_correction_bias is not None  # a sigmoid Router has one
            return route_sigmoid(logits, self.gate.e_score_correction_bias, self.top_k, self.n_group,
                                 self.topk_group, self.renormalize, self.scaling)
        return route(logits, self.top_k, self.kind, self.renormalize)

    def compute(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_w: torch.Tensor) -> torch.Tensor:
        """The experts of a routed batch through the bound backend: [T, H]."""
        if self.experts is None:
            raise RuntimeError(f"MoE layer {self.layer} has no expert backend bound")
        if self.trace is not None:
            self.trace.record(self.layer, topk_ids)
        return self.experts.forward(self.layer, x, topk_ids, topk_w)


class DenseMLP(nn.Module):
    """SwiGLU MLP for the dense layers of mixed models: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.inter = inter
        self.gate_up_proj = nn.Linear(hidden, 2 * inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.inter, dim=-1)
        return self.down_proj(F.silu(gate) * up)
