"""Offloaded experts: the `ExpertBackend` that computes from a slot cache of a host store.

The runner brackets each forward with `begin_step` / `end_step`. Per MoE layer and step:
1. `route`: the guesser's routers run (experts/guesses.py), then the batch's distinct expert ids
   and the guesses' are read on the host in one sync, and `make_plan` (experts/plan.py) decides;
2. `start`: the CPU's job starts (hybrid), `ExpertCache.acquire` pins the device's experts, copies
   the misses in and orders the kernels after the copies; expert ids become slot ids;
3. the kernel runs on the slot banks, eagerly (`forward`) or as the layer's CUDA graph
   (engine/segment_graphs.py after `prepare_decode`); the CPU's pairs weigh 0 in it;
4. `finish_step` unpins, then issues the prefetch copies; a streaming chunk then demotes what it
   brought in beyond the layer's even share (`ExpertCache.demote_fetched`).
A union larger than the slots not in use runs in rounds: cached experts first, then as many misses
as fit, each round a `fused_moe` over its (token, k) pairs, summed into the output.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, replace

import torch

from ferryman.experts.cpu_compute import CPUExperts
from ferryman.experts.gpu_cache import ExpertCache
from ferryman.experts.hybrid import HybridSplit
from ferryman.experts.guesses import NextLayerGuesser, Proposal
from ferryman.experts.plan import Guess, LayerPlan, Prefetch, make_plan
from ferryman.experts.routing import RoutingRead, host_ids_of
from ferryman.layers.fused_moe import MoEActivation, Upload, fused_moe, to_device


@dataclass(frozen=True)
class CPUPart:
    """A hybrid step's pairs computed on the CPU: the running `job` (a [T, H] host tensor when
    done) and `off`, [T, K] bool on the cache's device: the pairs it covers, which the device
    kernel gives weight 0."""

    job: Future
    off: torch.Tensor


@dataclass(frozen=True)
class ChunkRouting:
    """A layer-major chunk's routing read, started behind its router (`OffloadExperts.read_routing`),
    and the guesses proposed with it (the first chunk's)."""

    read: RoutingRead
    proposals: list[Proposal]


@dataclass(frozen=True)
class LayerStep:
    """A step whose experts are acquired (pinned) and mapped to slots, ready for its kernel (run by
    `forward`, or by a per-layer CUDA graph after `prepare_decode`) until `finish_step`."""

    plan: LayerPlan
    slots: list[int]  # the slots of plan.device
    # [T, K] int32 slot of each (token, k) pair, on the cache's device; None when the CPU computes
    # every pair (a hybrid step with nothing on the device)
    slot_ids: torch.Tensor | None
    host_slot_ids: torch.Tensor | None  # the same on the host, when the ids were read there
    cpu: CPUPart | None = None  # hybrid: what the CPU computes meanwhile
    prefetched: bool = False  # the plan's prefetch copies have started

    @property
    def layer(self) -> int:
        return self.plan.layer


class OffloadExperts:
    def __init__(self, cache: ExpertCache, act: MoEActivation, guesser: NextLayerGuesser | None = None,
                 hybrid: HybridSplit | None = None, cpu_thread: bool | None = None,
                 cpu_layers: frozenset[int] = frozenset()) -> None:
        self.cache, self.act, self.guesser, self.hybrid = cache, act, guesser, hybrid
        self.cpu_layers = cpu_layers  # MoE layers whose experts the CPU computes, all of them (cpu, layers)
        self.cpu: CPUExperts | None = None
        if hybrid is not None and hybrid.decision.enabled or cpu_layers:  # cpu_thread None: a worker on CUDA only
            threaded = cache.device.type == "cuda" if cpu_thread is None else cpu_thread
            self.cpu = CPUExperts(cache.store, act, threaded)
        self.fmt = cache.store.format.name
        self.num_experts = cache.num_experts

    # ---- a step ------------------------------------------------------------------------------
    def begin_step(self) -> None:
        """An engine step's forward starts: the policy's and the split's clocks advance."""
        self.cache.begin_step()
        if self.hybrid is not None:
            self.hybrid.advance()

    def end_step(self) -> None:
        """The step's forward is issued: forget what its first MoE layer used (the wrap guess's)."""
        if self.guesser is not None:
            self.guesser.first_used = None

    def note_step(self, seconds: float, batch: int, decode_only: bool) -> None:
        """An engine step took `seconds` for `batch` sequences: auto's split trial times it."""
        if self.hybrid is not None:
            self.hybrid.note_step(seconds, batch, decode_only)

    def restart_trials(self) -> None:
        """Forget the split trial's samples (a warm-up's steps pay compiles); a verdict stays."""
        if self.hybrid is not None and self.hybrid.trial is not None:
            self.hybrid.trial.restart()

    def forward(self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_w: torch.Tensor) -> torch.Tensor:
        # x: [T, H]; topk_ids (expert ids), topk_w: [T, K]
        streaming = topk_ids.numel() >= self.num_experts  # a chunk touching about every expert
        plan, host_ids = self.route(layer, x, topk_ids, streaming)
        if plan.rounds:
            out = self._compute_rounds(layer, x, topk_ids, topk_w, plan.device)
            self.issue_prefetches(plan)
            return out
        return self._compute(x, topk_w, self.start(plan, x, host_ids, topk_w))

    def read_routing(self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, first: bool) -> ChunkRouting:
        """A layer-major chunk's routing (x [T_c, H], topk_ids [T_c, K]) on its way to the host, started
        right after its router: the first chunk's guesses of the next layer too (router launches)."""
        proposals = []
        if first and self.guesser is not None and layer not in self.cpu_layers:
            proposals = self.guesser.propose(layer, x, True)
        return ChunkRouting(RoutingRead(topk_ids, [p[2] for p in proposals]), proposals)

    def forward_chunks(self, layer: int, x: torch.Tensor, bounds: list[tuple[int, int]],
                       routed: list[tuple[torch.Tensor, torch.Tensor]], reads: list[ChunkRouting],
                       emit: Callable[[int, torch.Tensor], None]) -> None:
        """A layer-major prefill's layer (engine/layer_prefill.py): x [T, H] holds every chunk's rows,
        chunk c at rows bounds[c] routed to routed[c] = (expert ids, weights) [T_c, K], its routing on
        the way to the host in reads[c] (`read_routing`). Chunk by chunk, as each read lands (later
        chunks' attention still running): a plan, an acquire that keeps its experts pinned until the
        last chunk's kernel is issued, so each uncached expert is copied once for all chunks, and one
        kernel on exactly the rows and weights chunk-major prefill gives it, its output handed to
        emit(c, [T_c, H]) (emit may overwrite x's rows of c). The next layers' copies start with the
        first kernel's inputs, as a streaming chunk's do. A chunk whose experts do not fit the slots
        left, or with a CPU share, and every chunk after it, go through `forward` one by one."""
        held: list[LayerStep] = []
        fetched: list[int] = []
        pinned: set[int] = set()  # experts the held steps pinned
        for c, (a, b) in enumerate(bounds):
            used, guessed, host_ids = reads[c].read.result()
            spare = sum(1 for e in used if e in pinned)
            plan = self._plan(layer, b - a, True, used, guessed, reads[c].proposals, host_ids, spare=spare)
            if plan.rounds or plan.cpu:  # more experts than free slots: the rest chunk by chunk, in rounds
                self._finish_chunks(layer, held, fetched)
                for d in range(c, len(bounds)):
                    emit(d, self.forward(layer, x[bounds[d][0] : bounds[d][1]], *routed[d]))
                return
            step = self.start(plan, x[a:b], host_ids, routed[c][1])
            assert step.slot_ids is not None  # no CPU part: checked above
            fetched += self.cache.last_fetched
            early = (lambda: self.issue_prefetches(plan)) if c == 0 else None
            emit(c, fused_moe(self.cache.format_of(layer), self.cache.banks_of(layer), x[a:b], step.slot_ids,
                              routed[c][1], self.act, host_ids=step.host_slot_ids, inputs_issued=early,
                              upload=self._upload(True)))
            held.append(replace(step, prefetched=True))
            pinned.update(plan.device)
        self._finish_chunks(layer, held, fetched)

    def _finish_chunks(self, layer: int, held: list[LayerStep], fetched: list[int]) -> None:
        """Unpin the chunks' experts; what they brought in goes first (a streaming chunk's demotion)."""
        for step in held:
            self.finish_step(step)
        if held:
            self.cache.last_fetched = fetched
            self.cache.demote_fetched(layer)

    def prepare_decode(self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor,
                       topk_w: torch.Tensor) -> LayerStep | None:
        """What `forward` does for a decode-sized step, up to the kernel. The caller runs fused_moe
        on the slot ids with the pairs `cpu.off` zeroed (in a CUDA graph), calls `finish_step`, then
        adds `cpu_part`. None when the step needs the eager path (more pairs than free slots)."""
        if layer not in self.cpu_layers and topk_ids.numel() > self.cache.available():
            return None
        plan, host_ids = self.route(layer, x, topk_ids, False)
        return self.start(plan, x, host_ids, topk_w)

    def route(self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor,
              streaming: bool) -> tuple[LayerPlan, torch.Tensor]:
        """The layer's plan, and topk_ids on the host, read back with the layer's one sync."""
        if layer in self.cpu_layers:  # the CPU computes every pair; nothing is guessed or cached
            used, _, host_ids = host_ids_of(topk_ids, [])
            return make_plan(layer, x.shape[0], streaming, used, (), self.cache.available(), used, []), host_ids
        proposals = self.guesser.propose(layer, x, streaming) if self.guesser is not None else []
        used, guessed, host_ids = host_ids_of(topk_ids, [p[2] for p in proposals])
        return self._plan(layer, x.shape[0], streaming, used, guessed, proposals, host_ids), host_ids

    def _plan(self, layer: int, rows: int, streaming: bool, used: list[int], guessed: list[list[int]],
              proposals: list[Proposal], host_ids: torch.Tensor, spare: int = 0) -> LayerPlan:
        """The plan of a step whose ids were read (host_ids [T, K]); spare: slots of `used` experts
        this layer's earlier chunks hold pinned (they need no free slot)."""
        if layer in self.cpu_layers:
            return make_plan(layer, rows, streaming, used, (), self.cache.available() + spare, used, [])
        if used and not 0 <= used[0] <= used[-1] < self.num_experts:  # used: ascending
            bad = used[0] if used[0] < 0 else used[-1]
            # CUDA's top-k returns arbitrary indices for NaN scores: an empty copy further on
            raise RuntimeError(f"MoE layer {layer}: the router chose expert {bad}, outside [0, {self.num_experts}) "
                               "(non-finite hidden states?)")
        g = self.guesser
        guesses: list[Guess] = []
        if g is not None:
            guesses = [Guess(t, kind, tuple(ids), g.copy_limit(t, kind, rows))
                       for (t, kind, _), ids in zip(proposals, guessed)]
            g.score(layer, used, 0 if streaming else rows)
            wrap = g.wrap(layer, used, rows, streaming)
            if wrap:
                guesses.append(Guess(g.first, "wrap", tuple(wrap)))
        cached = {e for e in used if self.cache.contains(layer, e)}
        cpu, units = None, 0.0
        if self.hybrid is not None and self.hybrid.applies(rows, streaming):
            cpu, units = self._split(layer, used, cached, host_ids)
        return make_plan(layer, rows, streaming, used, cached, self.cache.available() + spare, cpu, guesses, units)

    def _split(self, layer: int, used: list[int], cached: set[int],
               host_ids: torch.Tensor) -> tuple[list[int], float]:
        """The hybrid split's misses for the CPU (ascending), and what they cost it (1-token experts)."""
        assert self.hybrid is not None
        self.hybrid.history.use([(layer, e) for e in used])
        misses = [e for e in used if e not in cached]
        hits = len(cached)
        room = self.cache.available() - hits  # hits are cached and not in use between layers: >= 0
        tokens = torch.bincount(host_ids.flatten(), minlength=self.num_experts).tolist()  # per expert
        on_cpu = self.hybrid.split(layer, misses, room, device_min=0 if hits else 1, tokens=tokens)[1]
        return on_cpu, self.hybrid.units(on_cpu, tokens) if on_cpu else 0.0

    def start(self, plan: LayerPlan, x: torch.Tensor, host_ids: torch.Tensor, topk_w: torch.Tensor) -> LayerStep:
        """Carry `plan` out up to its kernel: start the CPU's job, pin the device's experts (copying
        the misses in) and map the pairs to slots. A pair on the CPU keeps its place in the kernel
        with weight 0 on a slot it reads anyway (0 x a finite expert output adds exactly nothing, and
        the kernel keeps its [T, K] shape and per-token summation order)."""
        cpu = self._submit(plan, x, host_ids, topk_w) if plan.cpu else None
        device = plan.device
        if cpu is not None and not device:  # no room at all: the CPU computes the whole layer
            return LayerStep(plan, [], None, None, cpu)
        slots = self.cache.acquire(plan.layer, device)
        on_cpu = list(plan.cpu)
        upload = self._upload(plan.streaming)
        dev_ids, host_slots = self._slot_ids(device + on_cpu, slots + slots[:1] * len(on_cpu), host_ids, upload)
        return LayerStep(plan, slots, dev_ids, host_slots, cpu)

    def _submit(self, plan: LayerPlan, x: torch.Tensor, host_ids: torch.Tensor, topk_w: torch.Tensor) -> CPUPart:
        """Start the CPU's part of a hybrid step (in the worker), while the device fetches."""
        assert self.cpu is not None  # the split applied
        on_cpu = list(plan.cpu)
        job = self.cpu.submit(plan.layer, x, host_ids, topk_w, on_cpu)
        off = torch.zeros(self.num_experts, dtype=torch.bool)
        off[on_cpu] = True
        return CPUPart(job, off[host_ids].to(self.cache.device, non_blocking=True))  # off: [T, K]

    def cpu_part(self, step: LayerStep) -> torch.Tensor:
        """The [T, H] output of the pairs `step` sent to the CPU, on the cache's device (waits)."""
        assert self.cpu is not None and step.cpu is not None  # a hybrid step
        out, seconds = self.cpu.result(step.cpu.job)
        if self.hybrid is not None:
            self.hybrid.observe(step.plan.cpu_units, seconds)
        return out.to(self.cache.device, non_blocking=True)

    def finish_step(self, step: LayerStep) -> None:
        """The kernel reading `step`'s slots is issued: unpin them, then start the guesses' copies.

        Invariant: speculative copies are issued after every host -> device copy the layer's kernel
        needs (slot ids, the prefill path's pair layout). Those small copies run on the compute
        stream, and a copy engine may serve them only after the large copies queued before them.
        A prefill chunk's copies start earlier, once those inputs are issued and before the batched
        path's launches (`fused_moe(inputs_issued=)`); its step comes here with them started."""
        self.cache.release(step.layer, step.plan.device, step.slots)
        if not step.prefetched:
            self.issue_prefetches(step.plan)

    def issue_prefetches(self, plan: LayerPlan) -> None:
        """Start the copies of the plan's guesses, and hand the guesser what to grade."""
        g, streaming = self.guesser, plan.streaming
        if g is None:
            return
        # hybrid decode: copy only the link's share of the guess (HybridSplit.link_share)
        split = self.hybrid if self.hybrid is not None and self.hybrid.active and not streaming else None
        for p in plan.prefetch:
            if p.kind == "gap":
                g.remember_gap(p.target, self.cache.prefetch(p.target, self._uncached(p)[: p.limit]))
                continue
            if p.tail is not None:
                g.remember_tail(p.target, list(p.tail))
            # ascending: consecutive experts into consecutive slots coalesce into one copy
            copy = sorted(p.experts) if split is None else split.link_share(p.target, self._uncached(p))
            fetched = self.cache.prefetch(p.target, copy, streaming=streaming)
            g.remember(p.target, list(p.guessed), fetched, streaming, plan.rows)

    def _uncached(self, p: Prefetch) -> list[int]:
        """The prefetch's experts not cached now (the layer's own fetches may have evicted some)."""
        return [e for e in p.experts if not self.cache.contains(p.target, e)]

    def _compute(self, x: torch.Tensor, topk_w: torch.Tensor, step: LayerStep) -> torch.Tensor:
        plan = step.plan
        if step.slot_ids is None:  # a hybrid step with every pair on the CPU
            out = torch.zeros_like(x)  # [T, H]
        else:
            w = topk_w if step.cpu is None else topk_w.masked_fill(step.cpu.off, 0.0)
            early = (lambda: self.issue_prefetches(plan)) if plan.streaming else None
            out = fused_moe(self.cache.format_of(step.layer), self.cache.banks_of(step.layer), x, step.slot_ids, w,
                            self.act, host_ids=step.host_slot_ids,
                            inputs_issued=early, upload=self._upload(plan.streaming))
            step = replace(step, prefetched=plan.streaming)
        self.finish_step(step)
        if plan.streaming:  # a chunk touching about every expert: what it brought in goes first
            self.cache.demote_fetched(step.layer)
        return out if step.cpu is None else out + self.cpu_part(step)

    def _compute_rounds(self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor,
                        topk_w: torch.Tensor, used: list[int]) -> torch.Tensor:
        # cached experts first: they are used in place before misses could evict them
        order = sorted(used, key=lambda e: not self.cache.contains(layer, e))
        out = torch.zeros_like(x)  # [T, H]
        start = 0
        while start < len(order):
            if self.cache.available() == 0:
                raise RuntimeError(f"MoE layer {layer}: every expert-cache slot is in use")
            part = order[start : start + self.cache.available()]
            start += len(part)
            slots = self.cache.acquire(layer, part)
            mask = torch.isin(topk_ids, torch.tensor(part, device=topk_ids.device))  # [T, K]
            tok, kk = mask.nonzero(as_tuple=True)  # pairs routed to this round's experts: [P]
            ids = self._slot_ids(part, slots, topk_ids[tok, kk])[0].unsqueeze(1)  # [P, 1]
            y = fused_moe(self.cache.format_of(layer), self.cache.banks_of(layer), x[tok], ids,
                          topk_w[tok, kk].unsqueeze(1), self.act)
            out.index_add_(0, tok, y)
            self.cache.release(layer, part, slots)
        return out

    def _upload(self, streaming: bool) -> Upload | None:
        """How a layer's small inputs reach the device: a prefill chunk's on the copy stream
        (Transfer.upload's invariant), a decode step's on the compute stream."""
        return self.cache.transfer.upload if streaming else None

    def _slot_ids(self, experts: list[int], slots: list[int], ids: torch.Tensor,
                  upload: Upload | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Expert ids -> (slot ids on the cache's device, the same on the host or None), through a
        per-call table (ids only name experts in `experts`). Host ids (the usual case: read for the
        lookup anyway) are mapped on the host and copied once (by `upload`); device ids are mapped
        on the device."""
        # fresh pageable tensors: the async copy stages them at once, nothing reuses their memory
        upload = upload or to_device(self.cache.device)
        if ids.device.type == "cpu" and ids.numel() <= 256:  # a few pairs: Python beats tensor ops
            slot_of = dict(zip(experts, slots))
            host = torch.tensor([slot_of[e] for e in ids.reshape(-1).tolist()], dtype=torch.int32).view(ids.shape)
            return upload(host), host
        lut = torch.zeros(self.num_experts, dtype=torch.int32)
        lut[torch.tensor(experts, dtype=torch.int64)] = torch.tensor(slots, dtype=torch.int32)
        if ids.device.type == "cpu":
            host = lut[ids]
            return upload(host), host
        return lut.to(ids.device, non_blocking=True)[ids], None

    def stats(self, block: bool = True) -> dict:
        out = self.cache.stats(block)
        for part in (self.guesser, self.hybrid, self.cpu):
            if part is not None:
                out.update(part.stats())
        return out
