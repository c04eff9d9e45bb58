"""`ferryman plan`'s report of a MemoryPlan: the split, the link bound of batch-1 decode, hints, and
the predicted output tokens/s and time to first token of a served load (`predict`)."""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from ferryman.config import GiB, MiB, ModelConfig
from ferryman.kvcache.window_pool import num_window_layers
from ferryman.planner import MemoryPlan, link_blockers, link_step_fits, non_expert_params
from ferryman.prefill_steps import piece_tokens, pieces_of, prefill_tail, step_tokens


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
        ("activations", f"{g(plan.activation_bytes)}  prefill chunk of {r.max_num_batched_tokens} tokens "
                        f"(a prompt's last piece up to {prefill_tail(r.max_num_batched_tokens or 0)} more)"
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
        rows.append(("miss path", _misses_mode(plan)))
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


def _misses_mode(plan: MemoryPlan) -> str:
    if plan.decode_misses == "link":
        trial = ("; auto's choice, on trial: copies take over where decode steps run faster with them"
                 if plan.request.decode_misses == "auto" else "")
        return (f"read over the link by the decode kernel, whole steps in one CUDA graph, up to "
                f"{_link_seqs(plan)} sequences (copied into slots beyond)" + trial)
    blockers = link_blockers(plan.request, plan.cpu_layers)
    why = ("" if plan.request.decode_misses == "copy" else f"; link steps need {' and '.join(blockers)}"
           if blockers else "; the experts' format reads slowly over the link")
    split = ("; under auto the CPU may take some (the hybrid split, on trial: kept only where decode steps "
             "run faster)" if plan.request.strategy == "auto" else "")
    return "copied into slots layer by layer" + why + split


def _link_seqs(plan: MemoryPlan) -> int:
    return max((n for n in range(1, 257) if link_step_fits(plan.request.cfg, n)), default=0)


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
#   - slots: the shared region's pages less its KV pages, which follow engine/memory_split.py: they
#     grow when a step needs blocks (down to the engine's least slots, 2 E) and after each step
#     give their idle pages beyond the reserve (one step's tokens) to the experts, the KV floor's too;
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
# a link step's seconds per layer besides its reads: 0.14-0.18 ms measured on qwen3-30b-a3b at 8 GiB
# (docs/benchmarks.md); its misses are read at the link rate, no host step between layers
LINK_LAYER_S = 0.16e-3
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
        self.reserve_blocks = -(-step_tokens(r.max_num_batched_tokens or 0) // r.block_size)
        windows = [cfg.window_of(i) for i in range(cfg.num_layers) if not cfg.is_linear_layer(i)]
        self.full_layers = sum(w is None for w in windows)
        self.window_layers = [w for w in windows if w is not None]
        # per token: every parameter but the routed experts, the embedding and the lm_head (sampled rows only)
        embed = cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_word_embeddings else 2)
        self.dense_flops = 2.0 * max(0, non_expert_params(cfg) - embed)

    def kv_pages(self, pages: int, held: int, after: bool) -> int:
        """The split's KV pages as engine/memory_split.py moves them, from `pages` while the sequences
        hold `held` blocks: before a step `ensure_kv` grows them to what the step needs (not below
        the least slots); after it `rebalance` lends idle pages while the free blocks beyond the
        reserve fill a page (not above every expert)."""
        geo, region = self.plan.pages, self.plan.region_pages
        if geo is None:
            return 0
        q = geo.blocks_per_page
        need = -(-held // q)
        if not after:
            return max(pages, min(need, region - self.least))
        lend = min(max(0, (pages * q - held - self.reserve_blocks) // q), pages - need, self.most - (region - pages))
        return pages - max(0, lend)

    def slots(self, kv_pages: int) -> int:
        return self.plan.expert_slots if self.plan.pages is None else self.plan.region_pages - kv_pages

    def hit(self, slots: int) -> float:
        return min(1.0, slots / max(1, self.moe_layers * self.experts))

    def misses_s(self, tokens: int, hit: float) -> float:
        """One MoE layer's link seconds for `tokens` tokens."""
        return used_experts(self.experts, self.k, tokens) * (1.0 - hit) * self.row / self.rates.link_bps

    def decode_s(self, seqs: int, hit: float) -> float:
        used = used_experts(self.experts, self.k, seqs)
        link = self.plan.decode_misses == "link" and link_step_fits(self.cfg, seqs)
        return self.moe_layers * (self.misses_s(seqs, hit) + (LINK_LAYER_S if link else LAYER_S)
                                  + used * self.row / HBM_BPS)

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
        full, rest = pieces_of(tokens, chunk)  # the last chunk takes a short tail
        moe = full * self.moe_s(chunk) + (self.moe_s(rest) if rest else 0.0)
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


@dataclass
class Replay:
    """The outcome of `simulate`: each request's TTFT, the load's wall seconds, the engine's steps,
    and the expert slots of its decode-only steps, weighted by their time (None: there were none)."""

    ttfts: list[float]
    wall_s: float
    steps: int
    decode_slots: float | None


class _Engine:
    """The scheduler's policy (engine/scheduler.py, prefill_job.py) over `_Request`s, costed by StepCosts."""

    def __init__(self, costs: StepCosts, load: Load) -> None:
        r, plan = costs.plan.request, costs.plan
        self.costs, self.load = costs, load
        self.P, self.C, self.S = load.prompt_tokens, r.max_num_batched_tokens or 1, r.max_num_seqs
        self.L, self.J, self.bs = costs.cfg.num_layers, plan.prefill_job_tokens, r.block_size
        self.waiting: deque[_Request] = deque()
        self.running: list[_Request] = []
        self.job: _Job | None = None
        self.kv = plan.region_pages - plan.expert_slots if plan.pages is not None else 0  # KV pages now

    def schedule(self) -> tuple[list[tuple[_Request, int]], int]:
        """(scheduled (request, tokens), job layers) of the next step."""
        P, budget, scheduled = self.P, self.C, []
        for req in self.running:  # decodes and prefill chunks of running sequences first
            if budget <= 0:
                break
            scheduled.append((req, 1 if req.computed >= P else piece_tokens(P - req.computed, budget, self.C)))
            budget -= scheduled[-1][1]
        if self.job is None and self.J and self.waiting and P > step_tokens(self.C):  # the head and those behind it
            members = []
            while self.waiting and len(self.running) + len(members) < self.S and (len(members) + 1) * P <= self.J:
                members.append(self.waiting.popleft())
            self.job = _Job(members, max(1, self.L * self.C // max(1, len(members) * P))) if members else None
        while self.job is None and self.waiting and budget > 0 and len(self.running) < self.S:  # FCFS
            self.running.append(self.waiting.popleft())
            scheduled.append((self.running[-1], piece_tokens(P, budget, self.C)))
            budget -= scheduled[-1][1]
        if self.job is None:
            return scheduled, 0
        left = self.L - self.job.done
        return scheduled, min(left, self.job.per_step) if scheduled else left

    def held(self, scheduled: list[tuple[_Request, int]]) -> int:
        """KV blocks the sequences hold (a step's blocks are allocated before it runs)."""
        now = {id(q): n for q, n in scheduled}
        held = sum(-(-(q.computed + q.generated + now.get(id(q), 0)) // self.bs) for q in self.running)
        return held + (0 if self.job is None else len(self.job.members) * -(-self.P // self.bs))

    def step_s(self, scheduled: list[tuple[_Request, int]], layers: int, hit: float) -> float:
        pieces = [(q.computed, n) for q, n in scheduled if q.computed < self.P]
        tokens = sum(n for _, n in scheduled)
        seconds = self.costs.prompt_s(tokens, pieces, hit) if pieces else \
            self.costs.decode_s(tokens, hit) if scheduled else 0.0
        if layers:
            assert self.job is not None
            n = len(self.job.members)
            seconds += self.costs.prompt_s(n * self.P, [(0, self.P)] * n, hit, self.C) * layers / self.L
            self.job.done += layers
        return seconds

    def update(self, scheduled: list[tuple[_Request, int]]) -> list[_Request]:
        """Advance the computed tokens; returns the requests that sampled a token."""
        sampled = [q for q, n in scheduled if q.computed + n >= self.P]
        for q, n in scheduled:
            q.computed = min(self.P, q.computed + n)
        if self.job is not None and self.job.done == self.L:
            for q in self.job.members:
                q.computed = self.P
            self.running += self.job.members
            sampled += self.job.members
            self.job = None
        return sampled


def simulate(costs: StepCosts, load: Load) -> Replay:
    """Replay `load` through the engine's scheduling, step by step, with `costs`' step times."""
    eng = _Engine(costs, load)
    total = load.total_requests
    arrivals = [0.0] * min(load.users, total)
    sent, ttfts, t, steps, decode_t, decode_slots = len(arrivals), [], 0.0, 0, 0.0, 0.0
    while len(ttfts) < total or eng.running:
        eng.waiting.extend(_Request(a) for a in arrivals if a <= t)
        arrivals = [a for a in arrivals if a > t]
        if not eng.running and eng.job is None and not eng.waiting:
            t = min(arrivals)
            continue
        scheduled, layers = eng.schedule()
        eng.kv = costs.kv_pages(eng.kv, eng.held(scheduled), after=False)
        slots = costs.slots(eng.kv)
        seconds = eng.step_s(scheduled, layers, costs.hit(slots))
        if not layers and all(q.computed >= load.prompt_tokens for q, _ in scheduled):
            decode_t, decode_slots = decode_t + seconds, decode_slots + seconds * slots
        t, steps = t + seconds, steps + 1
        for q in eng.update(scheduled):
            q.generated += 1
            if q.first is None:
                q.first = t
                ttfts.append(t - q.arrival)
            if q.generated >= load.output_tokens:
                eng.running.remove(q)
                if sent < total:  # the client's next request
                    arrivals.append(t + CLIENT_S)
                    sent += 1
        eng.kv = costs.kv_pages(eng.kv, eng.held([]), after=True)
    return Replay(ttfts, t, steps, decode_slots / decode_t if decode_t else None)


def predict(plan: MemoryPlan, rates: Rates, load: Load) -> Prediction:
    costs = StepCosts(plan, rates)
    replay = simulate(costs, load)
    slots = replay.decode_slots if replay.decode_slots is not None else float(plan.expert_slots)
    decode = load.users / costs.decode_s(load.users, costs.hit(round(slots)))
    return Prediction(load.users, costs.hit(round(slots)), round(slots), decode,
                      load.total_requests * load.output_tokens / replay.wall_s, statistics.median(replay.ttfts),
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
