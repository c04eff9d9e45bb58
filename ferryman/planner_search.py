"""The choices the planner makes by splitting the budget again (planner_split.py): the step size,
the prefill mode (chunk- or layer-major) and, when asked, the concurrency.
"""

from __future__ import annotations

from dataclasses import replace

from ferryman.config import PREFILL_MODES, ModelConfig
from ferryman.errors import ConfigError
from ferryman.planner import DEFAULT_CHUNK, OFFLOAD_CHUNK, MemoryPlan, PlanRequest, round_up
from ferryman.planner_split import split_budget


def plan_memory(req: PlanRequest) -> MemoryPlan:
    """Split `req.budget`; ConfigError if it cannot hold the floor (the message says how much is missing).
    With max_num_batched_tokens None: DEFAULT_CHUNK, then OFFLOAD_CHUNK if the experts are offloaded
    and the longer chunk's activations still leave a plan. Then the prefill mode (`prefill_plan`)."""
    return prefill_plan(_plan_chunk(req))


def _plan_chunk(req: PlanRequest) -> MemoryPlan:
    if req.max_num_batched_tokens is not None:
        return split_budget(req)
    plan = split_budget(replace(req, max_num_batched_tokens=DEFAULT_CHUNK))
    if plan.strategy != "offload":
        return plan
    try:
        longer = split_budget(replace(req, max_num_batched_tokens=OFFLOAD_CHUNK))
    except ConfigError:
        return plan
    return longer if longer.strategy == "offload" else plan


def layer_major_applies(cfg: ModelConfig) -> bool:
    """Layer-major prefill keeps causal order within a layer through paged KV; a linear-attention
    layer's state and its prefix checkpoints (taken after a chunk's last layer) need chunk-major."""
    return not any(cfg.is_linear_layer(i) for i in range(cfg.num_layers))


def prefill_plan(plan: MemoryPlan) -> MemoryPlan:
    """How prompts longer than one step are computed.

    chunk-major (today's path): each chunk passes every layer, so an offloaded model streams about
    every uncached expert once per chunk. layer-major: a job of up to max_model_len tokens passes
    each layer in all its chunks while that layer's experts are pinned, so each crosses the link
    once per job. auto: layer-major for offloaded experts when the job's hidden states fit beside the
    plan (else chunk-major); resident experts never cross the link, so they keep chunk-major (smaller
    activations, decodes between whole chunks)."""
    req = plan.request
    if req.prefill_mode not in PREFILL_MODES:
        raise ConfigError(f"prefill_mode must be one of {', '.join(PREFILL_MODES)}, got {req.prefill_mode!r}")
    wanted = req.prefill_mode == "layer" or (req.prefill_mode == "auto" and plan.strategy == "offload")
    if not wanted or not layer_major_applies(req.cfg):
        return plan
    job = round_up(req.max_model_len, req.block_size)
    try:
        layered = split_budget(req, job)
    except ConfigError:
        if req.prefill_mode == "layer":
            raise
        return plan
    return layered if layered.strategy == plan.strategy else plan


# Concurrencies tried when max_num_seqs is left to the planner, largest first.
AUTO_NUM_SEQS = (32, 16, 8, 4, 2, 1)


def plan_auto_seqs(req: PlanRequest) -> MemoryPlan:
    """Plan with the largest concurrency whose KV floor fits the budget and leaves the experts at
    least half of what weights and activations leave (so KV never starves the expert cache, nor the
    cache KV). Without a budget, or when every expert stays resident, the largest is taken; when no
    concurrency keeps every expert resident, the largest offloaded one (its KV grows by need)."""
    last_error: ConfigError | None = None
    shared: MemoryPlan | None = None  # the first offloaded plan: its region reserves no KV per sequence
    for n in AUTO_NUM_SEQS:
        trial = replace(req, max_num_seqs=n)
        try:
            plan = plan_memory(trial)
        except ConfigError as e:
            last_error = e
            continue
        if req.budget is None or plan.strategy == "resident":
            return plan
        if plan.shared:  # a smaller concurrency may still make every expert resident
            shared = shared or plan
            continue
        free = req.budget - plan.weights_bytes - plan.activation_bytes
        if trial.kv_floor_tokens * req.kv_per_token + plan.request.window_kv_bytes <= free // 2 \
                or n == AUTO_NUM_SEQS[-1]:
            return plan
    if shared is not None:
        return shared
    assert last_error is not None  # every trial raised: report the smallest one's shortfall
    raise last_error
