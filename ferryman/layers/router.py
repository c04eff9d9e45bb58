"""The router of a MoE layer (its `gate`) and sigmoid routing with a score correction bias.

"sigmoid" routing (DeepSeek-V3, Kimi-K2, GLM-4.5), as transformers' DeepseekV3/Glm4Moe routers:
scores = sigmoid(logits) in fp32; the experts are chosen on scores + e_score_correction_bias,
restricted to the `topk_group` groups (of `n_group` equal groups) whose best two biased scores sum
highest; their weights are the unbiased scores, renormalised over the k when `norm_topk_prob`,
then multiplied by `routed_scaling_factor`. The bias steers the choice only, never the weights.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ferryman.config import ModelConfig


class Router(nn.Module):
    """x [T, H] -> router logits [T, E], like `nn.Linear(H, E)`. Sigmoid routers keep their weight
    and correction bias in fp32 and compute the logits in fp32 (the reference keeps `gate.weight`
    and `e_score_correction_bias` in fp32 whatever the model's dtype)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        H, E = cfg.hidden_size, cfg.num_experts
        self.fp32 = cfg.router_kind == "sigmoid"
        dtype = torch.float32 if self.fp32 else None
        self.weight = nn.Parameter(torch.empty(E, H, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(E, dtype=dtype)) if cfg.router_bias else None
        self.e_score_correction_bias = (
            nn.Parameter(torch.zeros(E, dtype=torch.float32), requires_grad=False) if self.fp32 else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, H] -> [T, E] (fp32 for a sigmoid router, else x's dtype)
        if self.fp32:
            return F.linear(x.float(), self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)

    def choice_scores(self, x: torch.Tensor) -> torch.Tensor:
        """[T, E] scores whose order is the experts' order of choice, groups aside (guesses)."""
        logits = self(x)
        if self.e_score_correction_bias is None:
            return logits  # softmax is monotone: the logits rank the experts
        return logits.sigmoid() + self.e_score_correction_bias


def route_sigmoid(logits: torch.Tensor, score_bias: torch.Tensor, top_k: int, n_group: int, topk_group: int,
                  renormalize: bool, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """logits: [T, E], score_bias: [E] -> (expert ids [T, K] int64, fp32 weights [T, K])."""
    scores = logits.float().sigmoid()  # [T, E]
    choice = scores + score_bias  # [T, E]: the bias steers the choice only
    if n_group > 1:
        choice = _mask_groups(choice, n_group, topk_group)
    ids = torch.topk(choice, top_k, dim=-1, sorted=False)[1]  # [T, K]
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return ids, weights * scaling


def _mask_groups(choice: torch.Tensor, n_group: int, topk_group: int) -> torch.Tensor:
    """choice [T, E] with the experts outside each token's topk_group best groups set to -inf; a
    group's score is the sum of its two highest choice scores."""
    T, E = choice.shape
    grouped = choice.view(T, n_group, E // n_group)  # [T, G, E/G]
    group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)  # [T, G]
    best = torch.topk(group_scores, topk_group, dim=-1, sorted=False)[1]  # [T, topk_group]
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)  # [T, G]
    return grouped.masked_fill(~keep[:, :, None], float("-inf")).view(T, E)
