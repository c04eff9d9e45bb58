"""Sigmoid routing with a correction bias and group limits (layers/router.py) against transformers'
own DeepseekV3 and Glm4Moe routers, on random logits whose choices have no ties."""

from __future__ import annotations

import pytest
import torch
from transformers import DeepseekV3Config, Glm4MoeConfig
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as dsv3
from transformers.models.glm4_moe import modeling_glm4_moe as glm

from ferryman.layers.router import route_sigmoid

DEVICES = [pytest.param("cpu"), pytest.param("cuda", marks=pytest.mark.gpu)]
# (experts, n_group, topk_group, top_k, norm_topk_prob, routed_scaling_factor)
CASES = [
    (256, 8, 4, 8, True, 2.5),  # DeepSeek-V3 / Kimi-K2 (Kimi: 384 experts, 1 group)
    (384, 1, 1, 8, True, 2.827),  # Kimi-K2
    (160, 1, 1, 8, True, 2.5),  # GLM-4.5
    (128, 1, 1, 8, True, 1.0),  # GLM-4.5-Air
    (8, 4, 2, 3, True, 2.5),  # the tiny glm4_moe of tiny_models.py
    (64, 8, 3, 6, False, 16.0),  # DeepSeek-V2-Lite-like, no renormalisation
    (16, 8, 1, 2, True, 1.0),  # one group of two: the group limit alone picks the pair
]


def reference(family: str, logits: torch.Tensor, bias: torch.Tensor, n_group: int, topk_group: int, top_k: int,
              renorm: bool, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' router on `logits`: a router over a hidden size of E whose weight is the
    identity computes exactly these logits. Returns (ids, weights) sorted by expert id."""
    T, E = logits.shape
    kw = dict(hidden_size=E, n_routed_experts=E, n_group=n_group, topk_group=topk_group, num_experts_per_tok=top_k,
              norm_topk_prob=renorm, routed_scaling_factor=scaling, num_hidden_layers=1, moe_intermediate_size=4,
              intermediate_size=4)
    config_cls, module = (DeepseekV3Config, dsv3) if family == "deepseek_v3" else (Glm4MoeConfig, glm)
    config = config_cls(**kw)
    router_cls = getattr(module, "DeepseekV3TopkRouter" if family == "deepseek_v3" else "Glm4MoeTopkRouter")
    router = router_cls(config).to(logits.device)
    with torch.no_grad():
        router.weight.copy_(torch.eye(E))
        router.e_score_correction_bias.copy_(bias)
        out = router(logits)
        if isinstance(out, torch.Tensor):  # a router that returns its logits: the MoE block routes
            moe_cls = getattr(module, "DeepseekV3MoE" if family == "deepseek_v3" else "Glm4MoeMoE")
            moe = moe_cls(config).to(logits.device)
            moe.gate = router
            out = moe.route_tokens_to_experts(out)
    ids, w = [t for t in out if t.dtype == torch.int64][-1], [t for t in out if t.dtype.is_floating_point][-1]
    return _by_id(ids, w)


def _by_id(ids: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    order = ids.argsort(dim=-1)
    return ids.gather(1, order), w.gather(1, order)


def untied(T: int, E: int, n_group: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random (logits [T, E], bias [E]) whose biased scores are all distinct, and whose group
    scores too: no choice depends on how a top-k breaks ties."""
    while True:
        logits = 2.0 * torch.randn(T, E, generator=gen)
        bias = 0.5 * torch.randn(E, generator=gen)
        choice = logits.sigmoid() + bias
        groups = choice.view(T, n_group, -1).topk(2, dim=-1)[0].sum(-1) if E // n_group >= 2 else choice
        if all(len(set(row.tolist())) == row.numel() for m in (choice, groups) for row in m):
            return logits, bias


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe"])
@pytest.mark.parametrize("case", CASES, ids=[f"E{c[0]}-g{c[1]}-tg{c[2]}-k{c[3]}" for c in CASES])
def test_sigmoid_routing_equals_transformers(family: str, case: tuple, device: str) -> None:
    E, n_group, topk_group, top_k, renorm, scaling = case
    logits, bias = untied(48, E, n_group, torch.Generator().manual_seed(E + top_k))
    logits, bias = logits.to(device), bias.to(device)
    want_i, want_w = reference(family, logits, bias, n_group, topk_group, top_k, renorm, scaling)
    got_i, got_w = _by_id(*route_sigmoid(logits, bias, top_k, n_group, topk_group, renorm, scaling))
    assert got_i.dtype == torch.int64 and got_w.dtype == torch.float32
    assert torch.equal(got_i, want_i), f"{family} {case}: chosen experts differ"
    assert torch.allclose(got_w, want_w, rtol=1e-6, atol=1e-7), f"{family} {case}: weights differ"


def test_group_limit_and_bias_roles() -> None:
    """Every token's experts lie in at most topk_group groups, and those are the groups whose best
    two biased scores sum highest; the weights are the unbiased scores of the chosen experts."""
    E, G, TG, K = 64, 8, 3, 6
    logits, bias = untied(32, E, G, torch.Generator().manual_seed(1))
    ids, w = route_sigmoid(logits, bias, K, G, TG, False, 1.0)
    choice = logits.sigmoid() + bias
    best_groups = choice.view(32, G, -1).topk(2, dim=-1)[0].sum(-1).topk(TG, dim=-1)[1]  # [T, TG]
    for t in range(32):
        groups = set((ids[t] // (E // G)).tolist())
        assert groups <= set(best_groups[t].tolist()) and len(groups) <= TG
        allowed = [e for e in range(E) if e // (E // G) in set(best_groups[t].tolist())]
        top = sorted(allowed, key=lambda e: -choice[t, e].item())[:K]
        assert sorted(ids[t].tolist()) == sorted(top)
    assert torch.allclose(w, logits.sigmoid().gather(1, ids))
    # without the group limit some token picks an expert outside its best groups: the limit acts
    free, _ = route_sigmoid(logits, bias, K, 1, 1, False, 1.0)
    assert not torch.equal(free.sort(-1)[0], ids.sort(-1)[0])


def test_bias_steers_choice_not_weights() -> None:
    """A large bias on one expert makes every token choose it, with its unbiased score as weight."""
    logits = torch.randn(16, 32, generator=torch.Generator().manual_seed(2))
    bias = torch.zeros(32)
    bias[5] = 10.0
    ids, w = route_sigmoid(logits, bias, 4, 1, 1, False, 2.0)
    assert (ids == 5).any(dim=-1).all()
    pos = (ids == 5).int().argmax(dim=-1)
    assert torch.allclose(w.gather(1, pos[:, None])[:, 0], 2.0 * logits[:, 5].sigmoid())


def test_guess_scores_rank_like_the_router() -> None:
    """The next-layer guesser ranks on Router.choice_scores: without groups, its top-k is the
    sigmoid router's choice (the correction bias included); a softmax router's are its logits."""
    from ferryman.config import ModelConfig
    from ferryman.layers.router import Router

    base = dict(model_type="t", vocab_size=8, hidden_size=16, num_layers=1, num_heads=1, num_kv_heads=1,
                head_dim=16, num_experts=32, top_k=4, moe_intermediate_size=8, norm_topk_prob=True)
    gen = torch.Generator().manual_seed(3)
    router = Router(ModelConfig(**base, router_kind="sigmoid"))
    with torch.no_grad():
        router.weight.copy_(torch.randn(32, 16, generator=gen))
        router.e_score_correction_bias.copy_(0.5 * torch.randn(32, generator=gen))
    x = torch.randn(20, 16, generator=gen)
    ids, _ = route_sigmoid(router(x), router.e_score_correction_bias, 4, 1, 1, True, 1.0)
    guessed = torch.topk(router.choice_scores(x), 4, dim=-1).indices
    assert torch.equal(guessed.sort(-1)[0], ids.sort(-1)[0])
    assert not torch.equal(torch.topk(router(x), 4, dim=-1).indices.sort(-1)[0], ids.sort(-1)[0])  # the bias counts
    softmax = Router(ModelConfig(**base))
    assert softmax.e_score_correction_bias is None and softmax.weight.dtype == torch.get_default_dtype()
