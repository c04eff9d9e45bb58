"""`ferryman plan`'s report of a MemoryPlan: the split, the link bound of batch-1 decode, hints."""

from __future__ import annotations

from ferryman.config import GiB, MiB
from ferryman.kvcache.window_pool import num_window_layers
from ferryman.planner import MemoryPlan


def describe_plan(plan: MemoryPlan) -> str:
    r, cfg = plan.request, plan.request.cfg
    g = lambda n: f"{n / GiB:8.2f} GiB"  # noqa: E731
    kv = (f"{plan.kv_tokens} tokens (floor {r.kv_floor_tokens})" if plan.kv_tokens is not None
          else "sized by the engine (no budget)")
    if r.window_blocks:
        kv += (f"; {num_window_layers(cfg)} sliding-window layers keep their window only "
               f"({r.window_blocks * r.block_size} tokens, {r.window_kv_bytes / GiB:.2f} GiB)")
    if r.kv_dtype is not None and r.kv_dtype != r.dtype:
        kv += f", stored as {str(r.kv_dtype).removeprefix('torch.')}"
    rows = [
        ("model", f"{cfg.model_type}: {len(cfg.moe_layers)} MoE layers x {cfg.num_experts} experts, top-{cfg.top_k}, "
                  f"{cfg.expert_format}, {plan.slot_bytes / MiB:.2f} MiB per expert"),
        ("budget", g(r.budget) if r.budget is not None else "unlimited"),
        ("weights", f"{g(plan.weights_bytes)}  non-expert, {str(r.dtype).removeprefix('torch.')}"
                    + (f"; token embedding ({plan.host_embedding_bytes / GiB:.2f} GiB) in host RAM"
                       if plan.host_embedding else "")),
        ("kv cache", f"{g(plan.kv_bytes)}  {kv}; {r.max_num_seqs} seqs x {r.max_model_len} context"),
        *([("state", f"{g(plan.state_bytes)}  linear-attention state, {r.max_num_seqs} slots; prefix-cache "
                     f"checkpoints {plan.checkpoint_host_bytes / GiB:.2f} GiB in host RAM")] if plan.state_bytes else []),
        ("activations", f"{g(plan.activation_bytes)}  prefill chunk of {r.max_num_batched_tokens} tokens"
                        + (f"; layer-major prefill of up to {plan.prefill_job_tokens} tokens"
                           if plan.prefill_job_tokens else "; chunk-major prefill")),
        ("experts", f"{g(plan.expert_cache_bytes)}  {plan.expert_slots} of {r.total_experts} "
                    f"({plan.expert_slots / max(1, r.total_experts):.1%}) on the device"),
        ("strategy", plan.strategy),
    ]
    if plan.strategy == "offload":
        rows.append(("decode link", _link_estimate(plan)))
        if (hint := _fp8_kv_hint(plan)) is not None:
            rows.append(("hint", hint))
    if r.budget is not None:
        rows.append(("unused", g(r.budget - plan.total_bytes)))
    return "\n".join(f"{k:>12}: {v}" for k, v in rows)


def _fp8_kv_hint(plan: MemoryPlan) -> str | None:
    """What an fp8 KV cache would give an offloaded plan under a budget: the bytes it frees, as
    expert slots (None when the cache is fp8 already, or the plan has no budget)."""
    r = plan.request
    itemsize = (r.kv_dtype or r.dtype).itemsize
    if r.budget is None or itemsize <= 1 or not plan.kv_bytes:
        return None
    freed = plan.kv_bytes - plan.kv_bytes // itemsize
    return (f"--kv-cache-dtype fp8 would free {freed / GiB:.2f} GiB of KV cache: {freed // plan.slot_bytes} more "
            f"expert slots, fewer bytes over the link per token")


# host -> device links for the estimate in `describe_plan`: pinned copies, bytes/s, as such links
# deliver in practice (docs/benchmarks.md measures the H200 machine's)
REFERENCE_LINKS = (("PCIe 4.0", 25e9), ("PCIe 5.0", 55e9))


def _link_estimate(plan: MemoryPlan) -> str:
    """Batch-1 decode bound by the link if routing were uniform (no locality: a floor on hits)."""
    r = plan.request
    misses = len(r.cfg.moe_layers) * r.cfg.top_k * (1 - plan.expert_slots / max(1, r.total_experts))
    per_token = misses * plan.slot_bytes
    rates = ", ".join(f"{name} <= {bw / per_token:.0f} tok/s" for name, bw in REFERENCE_LINKS)
    return (f"~{misses:.0f} misses x {plan.slot_bytes / MiB:.1f} MiB = {per_token / GiB:.2f} GiB per token if routing "
            f"were uniform: {rates} (real routing hits more; `ferryman bench bw` measures your link)")
