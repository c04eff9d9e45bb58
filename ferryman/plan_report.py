"""`ferryman plan`'s report of a MemoryPlan: the split, the link bound of batch-1 decode, hints, and
the predicted decode tokens/s and time to first token (`predict`)."""

from __future__ import annotations

from dataclasses import dataclass

from ferryman.config import GiB, MiB, ModelConfig
from ferryman.kvcache.window_pool import num_window_layers
from ferryman.planner import MemoryPlan, non_expert_params


def describe_plan(plan: MemoryPlan) -> str:
    r, cfg = plan.request, plan.request.cfg
    g = lambda n: f"{n / GiB:8.2f} GiB"  # noqa: E731
    floor = r.shared_floor_tokens if plan.shared else r.kv_floor_tokens
    kv = (f"{plan.kv_tokens} tokens at start (floor {floor})" if plan.kv_tokens is not None
          else "sized by the engine (no budget)")
    if plan.pages is not None:
        kv += (f"; shares pages of {plan.pages.page_bytes / MiB:.1f} MiB with the experts (a page = 1 slot or "
               f"{plan.pages.blocks_per_page} blocks): KV grows by need, max_num_seqs reserves nothing")
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
        ("strategy", plan.strategy + (f"; the first {plan.cpu_layers} of {len(r.cfg.moe_layers)} MoE layers' experts "
                                      "computed on the CPU" if plan.cpu_layers else "")
                     + (f" ({r.strategy})" if r.strategy not in ("auto", plan.strategy) else "")),
    ]
    if plan.strategy == "offload" and not plan.cpu_layers:  # cpu, layers: no miss crosses the link
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
    per_token = max(misses * plan.slot_bytes, 1.0)
    rates = ", ".join(f"{name} <= {bw / per_token:.0f} tok/s" for name, bw in REFERENCE_LINKS)
    return (f"~{misses:.0f} misses x {plan.slot_bytes / MiB:.1f} MiB = {per_token / GiB:.2f} GiB per token if routing "
            f"were uniform: {rates} (real routing hits more; `ferryman bench bw` measures your link)")


# ---- predictions: decode tokens/s and time to first token ------------------------------------
#
# A stated model, checked by benchmarks/bench_offload.py --predict and tools/gpu_suite.sh's split
# stage, for an offloaded plan on the H200 machine's class of GPU:
#   - routing is uniform (dummy weights; real text hits more): a step of B sequences uses
#     U = E (1 - (1 - k/E)^B) experts per MoE layer, of which the share cached is h = slots / (L E);
#   - the slots are the plan's less the pages the B sequences' KV takes (a shared region), down to
#     the engine's minimum (min_expert_slots, by default two layers' experts);
#   - misses are copied over the link at the calibrated rate and not overlapped with compute;
#   - a layer's compute is LAYER_S (host sync, attention, router, launches) plus its experts'
#     bytes read at HBM_BPS; a prefill chunk adds 2 x active parameters x tokens at FLOPS;
#   - users' prompts arrive together and are prefilled first come first served, in chunks.
LAYER_S = 0.35e-3  # seconds per offloaded layer step besides its expert bytes
HBM_BPS = 3.0e12  # device memory bytes/s a decode kernel reads at
FLOPS = 4.0e14  # dense bf16 flop/s of a prefill chunk's GEMMs
ASSUMED_LINK = REFERENCE_LINKS[1]  # without a calibration of this machine


@dataclass(frozen=True)
class Prediction:
    users: int
    hit_rate: float  # expected share of expert uses served from slots
    slots: int  # expert slots left once the users' KV took its pages
    decode_tok_s: float  # output tokens/s of all users together
    ttft_s: float  # the median user's, all users' prompts arriving together
    link_gbps: float
    link_source: str


def used_experts(num_experts: int, top_k: int, tokens: int) -> float:
    """Distinct experts a layer uses for `tokens` tokens routed uniformly, top_k each."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** max(tokens, 0))


def predict(plan: MemoryPlan, link_bps: float, link_source: str, users: int = 1,
            prompt_tokens: int = 1024, output_tokens: int = 128) -> Prediction:
    r, cfg = plan.request, plan.request.cfg
    layers, experts, k = len(cfg.moe_layers), cfg.num_experts, cfg.top_k
    slots = plan.expert_slots
    if plan.pages is not None:  # the users' KV takes pages from the experts, down to top_k slots
        extra = (users * (prompt_tokens + output_tokens) - (plan.kv_tokens or 0)) * r.kv_per_token
        least = min(slots, r.min_expert_slots or max(r.slot_floor, 2 * experts))  # the engine's default bound
        slots = max(least, slots - -(-max(0, extra) // plan.pages.page_bytes))
    hit = min(1.0, slots / max(1, layers * experts))
    row = plan.slot_bytes

    def step_s(tokens: int, flops_tokens: int) -> float:
        used = used_experts(experts, k, tokens)
        link = layers * used * (1.0 - hit) * row / link_bps
        compute = layers * (LAYER_S + used * row / HBM_BPS)
        return link + compute + 2.0 * active_params(cfg) * flops_tokens / FLOPS

    decode = users / step_s(users, 0) if plan.strategy == "offload" else 0.0
    # the median user's first token waits for the prompts admitted with and before it (FCFS chunks)
    tokens = (users // 2 + 1) * prompt_tokens
    chunk = r.max_num_batched_tokens or tokens
    ttft = -(-tokens // chunk) * step_s(min(chunk, tokens), 0) + 2.0 * active_params(cfg) * tokens / FLOPS
    return Prediction(users, hit, slots, decode, ttft, link_bps / 1e9, link_source)


def active_params(cfg: ModelConfig) -> int:
    """Parameters one token computes with: the non-expert ones but the embedding, and top_k experts."""
    expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size
    return non_expert_params(cfg) - cfg.vocab_size * cfg.hidden_size + len(cfg.moe_layers) * cfg.top_k * expert


def describe_predictions(preds: list[Prediction], prompt_tokens: int, output_tokens: int) -> str:
    p0 = preds[0]
    head = (f"predicted ({prompt_tokens} in / {output_tokens} out, uniform routing, link {p0.link_gbps:.1f} GB/s "
            f"{p0.link_source}):")
    rows = [f"{p.users:>4} users: decode {p.decode_tok_s:7.1f} tok/s, hit rate {p.hit_rate:5.1%} "
            f"({p.slots} slots), TTFT {p.ttft_s * 1e3:6.0f} ms" for p in preds]
    return "\n".join([head, *rows])
