"""One split of a GPU budget for fixed choices (step size, concurrency, prefill job): weights,
activations, the KV floor, then the experts (resident, offloaded in slots, or computed on the CPU).
planner_search.py makes those choices by splitting again; planner.py holds the sizes and the plan.
"""

from __future__ import annotations

from ferryman.config import GiB, MiB, parse_strategy
from ferryman.errors import ConfigError
from ferryman.kvcache.shared_region import PageGeometry
from ferryman.prefill_steps import step_tokens
from ferryman.planner import (
    MemoryPlan,
    PlanRequest,
    activation_bytes,
    all_expert_bytes,
    expert_slots,
    host_embedding_bytes,
    non_expert_bytes,
    prefill_job_bytes,
    slot_bytes,
)


def split_budget(req: PlanRequest, job_tokens: int = 0) -> MemoryPlan:
    """The plan for `req` as it stands (max_num_batched_tokens set), with a layer-major job of
    `job_tokens` prompt tokens (0: chunk-major only); ConfigError when the budget cannot hold the floor."""
    assert req.max_num_batched_tokens is not None  # plan_memory resolves it
    parse_strategy(req.strategy)  # ConfigError naming the choices
    cfg, total = req.cfg, req.total_experts
    weights = non_expert_bytes(cfg, req.dtype)
    act = activation_bytes(cfg, req.dtype, step_tokens(req.max_num_batched_tokens), req.max_num_seqs, req.kernels)
    act += prefill_job_bytes(cfg, req.dtype, job_tokens)
    per_slot = slot_bytes(cfg, req.dtype) if total else 0
    if req.budget is None:
        return _unlimited_plan(req, weights, act, per_slot, job_tokens)
    per_token = req.kv_per_token
    floor_tokens = req.kv_floor_tokens
    rest = req.budget - weights - act - floor_tokens * per_token - req.window_kv_bytes - req.state_bytes
    everything = all_expert_bytes(cfg, req.dtype) if total else 0
    strategy = _strategy(req, all_fit=rest >= everything)
    host = host_embedding_bytes(cfg, req.dtype) if strategy == "offload" else 0
    weights, rest = weights - host, rest + host  # offloaded: the embedding table stays in host RAM
    if strategy == "offload" and parse_strategy(req.strategy)[0] not in ("cpu", "layers"):
        return _shared_plan(req, weights, act, per_slot, rest + floor_tokens * per_token, host, job_tokens)
    if strategy == "resident":
        slots = total
    elif req.expert_cache is not None:
        slots = expert_slots(req.expert_cache, total)
    else:
        slots = min(total, max(0, rest) // max(1, per_slot))
    slots, cpu_layers = cpu_split(req, slots)
    need_slots = total if strategy == "resident" else min(total, max(slots, cfg.top_k))
    if rest < (everything if strategy == "resident" else need_slots * per_slot):
        _refuse(req, weights, act, floor_tokens, per_token, need_slots, per_slot, rest)
    # what the experts leave grows the KV cache, in whole blocks, up to what the sequences can use
    wanted = req.kv_cache_tokens or req.max_num_seqs * req.max_model_len
    extra = min(wanted - floor_tokens, (rest - slots * per_slot) // per_token)
    kv_tokens = floor_tokens + max(0, extra - extra % req.block_size)
    kv_bytes = kv_tokens * per_token + req.window_kv_bytes
    return MemoryPlan(req, strategy, weights, kv_tokens, kv_bytes, act, per_slot, slots, host, req.state_bytes,
                      cpu_layers=cpu_layers, prefill_job_tokens=job_tokens)


def _shared_plan(req: PlanRequest, weights: int, act: int, per_slot: int, region: int, host: int,
                 job_tokens: int = 0) -> MemoryPlan:
    """Offload under a budget: `region` bytes (what weights, activations, the window and state pools
    leave) in pages; the KV cache starts at its floor (one max_model_len sequence), the experts take
    the other pages up to every expert, or `expert_cache`'s count."""
    geo = PageGeometry.of(req.block_size * req.kv_per_token, per_slot)
    pages = region // geo.page_bytes
    kv_floor = geo.pages_for_tokens(req.shared_floor_tokens, req.block_size)
    floor = max(req.slot_floor, expert_slots(req.expert_cache, req.total_experts) if req.expert_cache else 0)
    if pages < kv_floor + floor:
        need = (kv_floor + floor) * geo.page_bytes - region
        raise ConfigError(
            f"a GPU budget of {req.budget / GiB:.2f} GiB cannot hold the floor: weights {weights / GiB:.2f} GiB "
            f"+ activations {act / GiB:.2f} GiB + one sequence of {req.shared_floor_tokens} tokens of KV cache "
            f"and {floor} expert slots ({kv_floor} + {floor} pages of {geo.page_bytes / MiB:.1f} MiB)"
            f"{' + window and state pools' if req.window_kv_bytes or req.state_bytes else ''}; missing "
            f"{need / GiB:.2f} GiB. Raise gpu_memory, or lower max_model_len ({req.max_model_len}) or "
            f"max_num_batched_tokens ({req.max_num_batched_tokens})")
    slots = min(req.total_experts, pages - kv_floor) if req.expert_cache is None else floor
    # KV gets the other pages, up to what the sequences can use (more would stay idle)
    wanted = geo.pages_for_tokens(req.kv_cache_tokens or req.max_num_seqs * req.max_model_len, req.block_size)
    kv_pages = min(pages - slots, max(kv_floor, wanted))
    kv_tokens = kv_pages * geo.blocks_per_page * req.block_size
    kv_bytes = kv_pages * geo.page_bytes + req.window_kv_bytes
    return MemoryPlan(req, "offload", weights, kv_tokens, kv_bytes, act, per_slot, slots, host, req.state_bytes, geo,
                      prefill_job_tokens=job_tokens)


def _strategy(req: PlanRequest, all_fit: bool) -> str:
    """Where the experts' memory lives: resident, or offload (host RAM + device slots: every strategy
    but resident, and auto when an expert cache is asked for or not every expert fits)."""
    name = parse_strategy(req.strategy)[0]
    if name == "resident":
        return "resident"
    if name == "auto":
        return "offload" if req.expert_cache is not None or not all_fit else "resident"
    return "offload"


def cpu_split(req: PlanRequest, slots: int) -> tuple[int, int]:
    """(device slots, MoE layers computed on the CPU) for the strategies that compute whole layers
    on the CPU. cpu: every layer, the device keeps top_k slots (the kernel's floor). layers:N: the
    first N layers, the others' experts all in slots; layers: N fills what the plan gives the
    experts with whole layers (llama.cpp's --n-cpu-moe)."""
    name, n = parse_strategy(req.strategy)
    layers, per_layer = len(req.cfg.moe_layers), req.cfg.num_experts
    if name == "cpu":
        return min(slots, req.cfg.top_k) if slots else req.cfg.top_k, layers
    if name != "layers":
        return slots, 0
    if n is None:
        n = layers - min(layers, slots // max(1, per_layer))
    if n > layers:
        raise ConfigError(f"moe_strategy layers:{n}: the model has {layers} MoE layers")
    return max(req.cfg.top_k, (layers - n) * per_layer), n


def _unlimited_plan(req: PlanRequest, weights: int, act: int, per_slot: int, job_tokens: int = 0) -> MemoryPlan:
    strategy = _strategy(req, all_fit=True)
    name = parse_strategy(req.strategy)[0]
    if name in ("offload", "hybrid") and req.expert_cache is None:
        raise ConfigError(f"moe_strategy '{name}' without gpu_memory needs expert_cache (e.g. '10%' or a slot count)")
    if strategy == "resident":
        slots = req.total_experts
    else:
        slots = req.total_experts if req.expert_cache is None else expert_slots(req.expert_cache, req.total_experts)
    slots, cpu_layers = cpu_split(req, slots)
    host = host_embedding_bytes(req.cfg, req.dtype) if strategy == "offload" else 0
    # the shared region serves plans whose layers all use slots (cpu and layers keep a fixed split)
    geo = PageGeometry.of(req.block_size * req.kv_per_token, per_slot) if strategy == "offload" and not cpu_layers \
        else None
    return MemoryPlan(req, strategy, weights - host, None, 0, act, per_slot, slots, host, req.state_bytes, geo,
                      cpu_layers, prefill_job_tokens=job_tokens)


def _refuse(req: PlanRequest, weights: int, act: int, floor_tokens: int, per_token: int,
            slots: int, per_slot: int, rest: int) -> None:
    need = slots * per_slot - rest
    what = "every expert (resident)" if req.strategy == "resident" else f"{slots} expert slots"
    kv = floor_tokens * per_token + req.window_kv_bytes + req.state_bytes
    window = f" + a {req.window_blocks}-block window pool" if req.window_blocks else ""
    raise ConfigError(
        f"a GPU budget of {req.budget / GiB:.2f} GiB cannot hold the floor: weights {weights / GiB:.2f} GiB "
        f"+ KV cache {kv / GiB:.2f} GiB ({floor_tokens} tokens{window}) + activations "
        f"{act / GiB:.2f} GiB + {what} {slots * per_slot / GiB:.2f} GiB; missing {need / GiB:.2f} GiB. "
        f"Raise gpu_memory, or lower max_num_seqs ({req.max_num_seqs}), max_model_len ({req.max_model_len}) "
        f"or max_num_batched_tokens ({req.max_num_batched_tokens})"
    )
