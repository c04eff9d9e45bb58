"""`ferryman plan`'s report of a MemoryPlan: the split, the link bound of batch-1 decode, hints, and
the predicted output tokens/s and time to first token of a served load (`predict`)."""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Callable
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


# ---- predictions: `ferryman bench serve`'s output tokens/s and time to first token ---------------
#
# A stated model of what the engine does, replayed step by step for a load of `users` workers that
# send prompts of P tokens back to back (O output tokens each), as `ferryman bench serve` does:
#   - the scheduler (engine/scheduler.py, prefill_job.py): running sequences first (a decode takes
#     one token, a prompt its next chunk), then the waiting prompts FCFS within max_num_batched_tokens
#     (C) and max_num_seqs; a head prompt longer than C starts a layer-major job instead, with the
#     prompts behind it up to prefill_job_tokens: all its layers in one step when nothing decodes,
#     else layers_per_step of them beside each decode step (no admission beside a job);
#   - routing is uniform (dummy weights): T tokens use U(T) = E (1 - (1 - k/E)^T) experts of a MoE
#     layer, each cached with probability h = slots / (L E);
#   - slots: the shared region's pages less the KV pages of the tokens held and the reserve of one
#     step's tokens, between the engine's least (2 E) and every expert (engine/memory_split.py: idle
#     pages, the KV floor's too, serve as slots);
#   - a decode-only step: per MoE layer its misses over the link, then LAYER_S and its experts' bytes
#     at HBM_BPS (the copies wait on the layer's routing, nothing hides them);
#   - a step with prompt tokens (a chunk, or a job's layers): per MoE layer its misses over the link,
#     its compute and LAYER_S, one after another; compute = the MoE kernel for the step's T tokens
#     (one per chunk of a job) and 2 x the other parameters x T + attention (4 x query-key pairs x
#     heads x head_dim) flops at the GEMM rate. The next layer's copies are issued beside a prefill
#     kernel, but they are not hidden in practice: bench_offload's 4k TTFT of gpt-oss-20b at 8 GiB
#     (docs/benchmarks.md) is about the sum of the link's and the kernels' times, not the larger;
#   - requests sent together reach the engine before its next step starts; a request sent when the
#     client's previous one finished (CLIENT_S later) misses the step that started meanwhile.
# Rates: link and compute from this machine's calibration (`ferryman bench bw`, calibrate/device.py);
# without one, the assumed figures below, and the report says so.
LAYER_S = 0.35e-3  # seconds per offloaded layer step besides its expert bytes (host sync, launches)
HBM_BPS = 3.0e12  # device memory bytes/s a decode kernel reads at
FLOPS = 4.0e14  # assumed flop/s of a prefill's GEMMs without a calibration of this device
ASSUMED_LINK = REFERENCE_LINKS[1]  # without a calibration of this machine
CLIENT_S = 1e-3  # a client's next request after its last token: longer than the engine's gap between steps


@dataclass(frozen=True)
class Rates:
    link_bps: float  # host -> device bytes/s of expert rows
    link_source: str
    moe_seconds: Callable[[int], float] | None = None  # one MoE layer's routed experts for T tokens
    matmul_flops: float | None = None  # flop/s of a large GEMM in the model's dtype
    compute_source: str = "assumed"


@dataclass(frozen=True)
class Load:
    users: int
    prompt_tokens: int = 1024
    output_tokens: int = 128
    requests: int | None = None  # None: bench serve's default, max(8, 2 x users); 0: one per user

    @property
    def total_requests(self) -> int:
        return max(8, 2 * self.users) if self.requests is None else (self.requests or self.users)


@dataclass(frozen=True)
class Prediction:
    users: int
    hit_rate: float  # expected share of expert uses served from slots, steady decode of `users`
    slots: int  # expert slots then
    decode_tok_s: float  # steady decode of `users` sequences together
    output_tok_s: float  # bench serve's figure: the load's output tokens / its wall time
    ttft_s: float  # the requests' median
    link_gbps: float
    link_source: str
    compute_source: str


def used_experts(num_experts: int, top_k: int, tokens: int) -> float:
    """Distinct experts a layer uses for `tokens` tokens routed uniformly, top_k each."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** max(tokens, 0))


class StepCosts:
    """Seconds of one engine step of an offloaded plan, and the slots its KV leaves."""

    def __init__(self, plan: MemoryPlan, rates: Rates) -> None:
        r, cfg = plan.request, plan.request.cfg
        self.plan, self.rates, self.cfg = plan, rates, cfg
        self.moe_layers, self.experts, self.k = len(cfg.moe_layers), cfg.num_experts, cfg.top_k
        self.row, self.flops = plan.slot_bytes, rates.matmul_flops or FLOPS
        self.most = plan.expert_slots if r.expert_cache is not None else r.total_experts
        self.least = min(self.most, plan.expert_slots, r.min_expert_slots or max(r.slot_floor, 2 * cfg.num_experts))
        self.reserve_blocks = -(-(r.max_num_batched_tokens or 0) // r.block_size)
        windows = [cfg.window_of(i) for i in range(cfg.num_layers) if not cfg.is_linear_layer(i)]
        self.full_layers = sum(w is None for w in windows)
        self.window_layers = [w for w in windows if w is not None]
        # per token: every parameter but the routed experts, the embedding and the lm_head (sampled rows only)
        embed = cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_word_embeddings else 2)
        self.dense_flops = 2.0 * max(0, non_expert_params(cfg) - embed)

    def slots(self, kv_blocks: int) -> int:
        """Expert slots while the sequences hold `kv_blocks` KV blocks."""
        geo = self.plan.pages
        if geo is None:
            return self.plan.expert_slots
        kv_pages = -(-(kv_blocks + self.reserve_blocks) // geo.blocks_per_page)
        return max(self.least, min(self.most, self.plan.region_pages - kv_pages))

    def hit(self, slots: int) -> float:
        return min(1.0, slots / max(1, self.moe_layers * self.experts))

    def misses_s(self, tokens: int, hit: float) -> float:
        """One MoE layer's link seconds for `tokens` tokens."""
        return used_experts(self.experts, self.k, tokens) * (1.0 - hit) * self.row / self.rates.link_bps

    def decode_s(self, seqs: int, hit: float) -> float:
        used = used_experts(self.experts, self.k, seqs)
        return self.moe_layers * (self.misses_s(seqs, hit) + LAYER_S + used * self.row / HBM_BPS)

    def moe_s(self, tokens: int) -> float:
        if self.rates.moe_seconds is not None:
            return self.rates.moe_seconds(tokens)
        pairs = tokens * self.k  # assumed: the GEMMs' flops and the used experts' bytes
        used = used_experts(self.experts, self.k, tokens)
        return 6.0 * pairs * self.cfg.hidden_size * self.cfg.moe_intermediate_size / FLOPS + used * self.row / HBM_BPS

    def prompt_s(self, tokens: int, pieces: list[tuple[int, int]], hit: float, chunk: int | None = None) -> float:
        """A step (or a job's every layer) computing `tokens` tokens, of which `pieces` are prompt
        pieces (first position, tokens), one MoE kernel per `chunk` tokens (a job's chunks; None: one):
        its layers' copies, kernels and fixed costs add up."""
        cfg = self.cfg
        attn = self.full_layers * sum(n * (start + n / 2) for start, n in pieces)
        attn += sum(n * min(start + n / 2, w) for w in self.window_layers for start, n in pieces)
        attn_s = 4.0 * attn * cfg.num_heads * cfg.head_dim / self.flops
        other_s = self.dense_flops * tokens / self.flops + attn_s  # every layer's, together
        chunk = chunk or tokens
        moe = tokens // chunk * self.moe_s(chunk) + (self.moe_s(tokens % chunk) if tokens % chunk else 0.0)
        return self.moe_layers * (self.misses_s(tokens, hit) + moe + LAYER_S) + other_s


@dataclass
class _Request:
    arrival: float
    computed: int = 0  # prompt tokens computed
    generated: int = 0  # output tokens sampled
    first: float | None = None  # when its first token was sampled


@dataclass
class _Job:
    members: list[_Request]
    per_step: int  # layers beside a decode step (prefill_job.layers_per_step)
    done: int = 0


def simulate(costs: StepCosts, load: Load) -> tuple[list[float], float, int]:
    """Replay `load` through the engine's scheduling: (TTFT of each request, wall seconds, steps)."""
    r, plan = costs.plan.request, costs.plan
    P, O, C, S = load.prompt_tokens, load.output_tokens, r.max_num_batched_tokens or P, r.max_num_seqs
    L, J, bs = costs.cfg.num_layers, plan.prefill_job_tokens, r.block_size
    arrivals = [0.0] * min(load.users, load.total_requests)
    sent, ttfts, t, steps = len(arrivals), [], 0.0, 0
    waiting: deque[_Request] = deque()
    running: list[_Request] = []
    job: _Job | None = None
    while len(ttfts) < load.total_requests or running:
        waiting.extend(_Request(a) for a in arrivals if a <= t)
        arrivals = [a for a in arrivals if a > t]
        if not running and job is None and not waiting:
            t = min(arrivals)
            continue
        budget, scheduled = C, []
        for req in running:
            if budget == 0:
                break
            n = 1 if req.computed >= P else min(P - req.computed, budget)
            scheduled.append((req, n))
            budget -= n
        if job is None and J and waiting and P > C:  # a layer-major job: the head and those behind it
            members = []
            while waiting and len(running) + len(members) < S and (len(members) + 1) * P <= J:
                members.append(waiting.popleft())
            job = _Job(members, max(1, L * C // max(1, len(members) * P))) if members else None
        if job is None:
            while waiting and budget > 0 and len(running) < S:
                req = waiting.popleft()
                running.append(req)
                scheduled.append((req, min(P, budget)))
                budget -= scheduled[-1][1]
        layers = 0 if job is None else (min(L - job.done, job.per_step) if scheduled else L - job.done)
        now = {id(q): n for q, n in scheduled}  # blocks are allocated before the step runs
        held = sum(-(-(q.computed + q.generated + now.get(id(q), 0)) // bs) for q in running)
        held += 0 if job is None else len(job.members) * -(-P // bs)
        hit = costs.hit(costs.slots(held))
        pieces = [(q.computed, n) for q, n in scheduled if q.computed < P]
        tokens = sum(n for _, n in scheduled)
        if pieces:
            t += costs.prompt_s(tokens, pieces, hit)
        elif scheduled:
            t += costs.decode_s(tokens, hit)
        if layers:
            assert job is not None
            t += costs.prompt_s(len(job.members) * P, [(0, P)] * len(job.members), hit, C) * layers / L
            job.done += layers
        steps += 1
        sampled = [q for q, n in scheduled if (q.computed >= P) or (q.computed + n >= P)]
        for q, n in scheduled:
            q.computed = min(P, q.computed + n)
        if job is not None and job.done == L:
            running.extend(job.members)
            sampled += job.members
            for q in job.members:
                q.computed = P
            job = None
        for q in sampled:
            q.generated += 1
            if q.first is None:
                q.first = t
                ttfts.append(t - q.arrival)
            if q.generated >= O:
                running.remove(q)
                if sent < load.total_requests:
                    arrivals.append(t + CLIENT_S)
                    sent += 1
    return ttfts, t, steps


def predict(plan: MemoryPlan, rates: Rates, load: Load) -> Prediction:
    costs = StepCosts(plan, rates)
    steady = costs.slots(load.users * -(-(load.prompt_tokens + load.output_tokens) // plan.request.block_size))
    decode = load.users / costs.decode_s(load.users, costs.hit(steady))
    ttfts, wall, _ = simulate(costs, load)
    return Prediction(load.users, costs.hit(steady), steady, decode,
                      load.total_requests * load.output_tokens / wall, statistics.median(ttfts),
                      rates.link_bps / 1e9, rates.link_source, rates.compute_source)


def active_params(cfg: ModelConfig) -> int:
    """Parameters one token computes with: the non-expert ones but the embedding, and top_k experts."""
    expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size
    return non_expert_params(cfg) - cfg.vocab_size * cfg.hidden_size + len(cfg.moe_layers) * cfg.top_k * expert


def describe_predictions(preds: list[Prediction], load: Load) -> str:
    p0 = preds[0]
    head = (f"predicted ({load.prompt_tokens} in / {load.output_tokens} out, uniform routing; link {p0.link_gbps:.1f} "
            f"GB/s {p0.link_source}; compute {p0.compute_source}):")
    rows = [f"{p.users:>4} users: output {p.output_tok_s:7.1f} tok/s (decode {p.decode_tok_s:7.1f}), hit rate "
            f"{p.hit_rate:5.1%} ({p.slots} slots), TTFT p50 {p.ttft_s * 1e3:6.0f} ms" for p in preds]
    return "\n".join([head, *rows])
