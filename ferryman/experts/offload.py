"""Offloaded experts: the `ExpertBackend` that computes from a slot cache of a host store.

Per MoE layer and step (any mix of prefill chunks and decodes):
1. the union of the batch's top-k ids is read on the host (one sync; concurrent requests
   share every lookup and fetch), together with the guess for the next layer;
2. `ExpertCache.acquire` pins the union, copies the misses in, and orders the kernels after
   the copies; hits are used in place, never fetched again;
3. expert ids become slot ids through a per-call table, and `fused_moe` runs on the slot banks
   (strided banks when the pool is expert-major: its kernels read either layout);
4. `release` unpins (later copies into those slots wait for the kernels that read them), then
   the next layer's guessed experts start copying into slots not in use (prefetch / prefill
   streaming, experts/prefetch.py): after the kernel's small host -> device inputs, never ahead
   of them on a copy engine (`finish_step`). A streaming chunk's copies start as soon as those
   inputs are issued, before the batched path's launches, and its inputs travel on the copy
   stream itself (`Transfer.upload`). With FERRYMAN_PREFILL_LOOKAHEAD=2 it also queues the layer
   after, into free or demoted slots only (it never evicts what the next layer was given); late
   decode guesses: experts/late_guess.py;
5. a streaming chunk (touching about every expert) then demotes what it brought in beyond the
   layer's even share, so prefill cycles a window of slots instead of flushing the cache
   (`ExpertCache.demote_fetched`).

If the union is larger than the slots not in use (a long prefill chunk with a small cache), the
layer runs in rounds: cached experts first, then as many misses as fit, each round a
`fused_moe` over its (token, k) pairs, summed into the output.

Hybrid (cpu_experts, experts/hybrid.py): in a decode-sized step the misses split into those
fetched and those computed on the CPU from the host store (experts/cpu_compute.py, a worker
thread on CUDA) while the device fetches and computes the rest; the CPU's [T, H] part is added.
The device kernel keeps every pair, those computed on the CPU with weight 0 (`CPUPart.off`), so
the same step runs eagerly or as the layer's MoE graph.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from ferryman.experts.cpu_compute import CPUExperts
from ferryman.experts.gpu_cache import ExpertCache
from ferryman.experts.routing import host_ids_of
from ferryman.experts.late_guess import LateGuesses
from ferryman.experts.layer_step import CPUPart, Guess, LayerStep, Prefetch
from ferryman.experts.hybrid import HybridSplit
from ferryman.experts.prefetch import NextLayerGuesser
from ferryman.envs import envs
from ferryman.errors import ConfigError
from ferryman.layers.fused_moe import DECODE_MAX_PAIRS, MoEActivation, Upload, fused_moe, to_device

if TYPE_CHECKING:
    from ferryman.experts.staging import RowStager

MAX_LOOKAHEAD = 4


class OffloadExperts:
    def __init__(self, cache: ExpertCache, act: MoEActivation, guesser: NextLayerGuesser | None = None,
                 hybrid: HybridSplit | None = None, cpu_thread: bool | None = None, zero_copy: bool = False,
                 lookahead: int | None = None, stage_rows: int = 0) -> None:
        self.cache, self.act, self.guesser, self.hybrid = cache, act, guesser, hybrid
        # prefill streaming: a chunk's experts start copying this many MoE layers ahead
        self.lookahead = envs.PREFILL_LOOKAHEAD if lookahead is None else lookahead
        if not 1 <= self.lookahead <= MAX_LOOKAHEAD:
            raise ConfigError(f"prefill lookahead (FERRYMAN_PREFILL_LOOKAHEAD) must be 1..{MAX_LOOKAHEAD} layers, "
                              f"got {self.lookahead}")
        # zero_copy: decode-sized calls read every expert where it is (slot or pinned host row) in
        # the kernel, with no host sync, so whole decode steps are graph-safe; otherwise the slot
        # table lives on the host and each MoE layer syncs once
        self.zero_copy = zero_copy
        self.graph_safe = zero_copy
        self.stager: RowStager | None = None  # staged zero-copy (experts/staging.py)
        if zero_copy:
            _check_zero_copy(cache, hybrid)
            table = cache.enable_row_addresses()
            if stage_rows:
                from ferryman.experts.staging import RowStager

                lo = cache.pool.flat.data_ptr()
                self.stager = RowStager(table, lo, lo + cache.pool.flat.numel(), stage_rows)
        self.cpu: CPUExperts | None = None
        if hybrid is not None and hybrid.decision.enabled:  # cpu_thread None: a worker on CUDA only
            threaded = cache.device.type == "cuda" if cpu_thread is None else cpu_thread
            self.cpu = CPUExperts(cache.store, act, threaded)
        self.fmt = cache.store.format.name
        self.num_experts = cache.num_experts
        self.prefetch_enabled = guesser is not None
        self._last_layer = 1 << 30
        # late decode prefetch: the next layer's guess (late2: the next two layers') from the
        # residual after each MoE layer, read back on arrival (experts/late_guess.py)
        self.late_guess = guesser is not None and guesser.late_depth > 0 and not zero_copy
        self.late = LateGuesses(cache, guesser if self.late_guess else None)
        self._first_used: list[int] | None = None  # the first MoE layer's experts this step (_wrap_guess)
        self._step_seqs = 1  # rows of the step in progress (_route)

    def forward(
        self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_w: torch.Tensor
    ) -> torch.Tensor:
        # x: [T, H]; topk_ids (expert ids), topk_w: [T, K]
        if self.zero_copy and topk_ids.numel() <= DECODE_MAX_PAIRS:  # its step is counted by after_step
            return self._zero_copy(layer, x, topk_ids, topk_w)
        streaming = topk_ids.numel() >= self.num_experts  # a chunk touching about every expert
        used, prefetches, host_ids = self._route(layer, x, topk_ids, streaming)
        if self.hybrid is not None and self.hybrid.applies(x.shape[0], streaming):
            return self._compute(x, topk_w, self._hybrid_step(layer, x, topk_w, host_ids, used, prefetches), False)
        if len(used) > self.cache.available():
            out = self._compute_rounds(layer, x, topk_ids, topk_w, used)
            self._after_kernel(prefetches, streaming)
            return out
        return self._compute(x, topk_w, self._acquire(layer, used, host_ids, prefetches, streaming), streaming)

    def prepare_decode(self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor,
                       topk_w: torch.Tensor) -> LayerStep | None:
        """What `forward` does for a decode-sized step, up to the kernel: the one sync, lookup,
        fetches, the CPU's part of a hybrid split, and the slot mapping. The caller runs fused_moe
        on the slot ids with the pairs `cpu.off` zeroed (in a CUDA graph), calls `finish_step`, then
        adds `cpu_part`. None when the step needs the eager path: zero-copy, or more pairs than
        free slots (rounds)."""
        if self.zero_copy or topk_ids.numel() > self.cache.available():
            return None
        used, prefetches, host_ids = self._route(layer, x, topk_ids, False)
        if self.hybrid is not None and self.hybrid.applies(x.shape[0], False):
            return self._hybrid_step(layer, x, topk_w, host_ids, used, prefetches)
        return self._acquire(layer, used, host_ids, prefetches, False)

    def cpu_part(self, step: LayerStep) -> torch.Tensor:
        """The [T, H] output of the pairs `step` sent to the CPU, on the cache's device (waits)."""
        assert self.cpu is not None and step.cpu is not None  # a hybrid step made by _hybrid_step
        out, seconds = self.cpu.result(step.cpu.job)
        if self.hybrid is not None:
            self.hybrid.observe(step.cpu.units, seconds)
        return out.to(self.cache.device, non_blocking=True)

    def finish_step(self, step: LayerStep) -> None:
        """The kernel reading `step`'s slots is issued: unpin them, then start the guesses' copies.

        Invariant: speculative copies are issued after every host -> device copy the layer's kernel
        needs (slot ids, the prefill path's pair layout). Those small copies run on the compute
        stream, and a copy engine may serve them only after the large copies queued before them.
        A prefill chunk's copies start earlier, once those inputs are issued and before the batched
        path's launches (`fused_moe(inputs_issued=)`, FERRYMAN_PREFETCH_BEFORE_GROUPS); its step
        comes here with no prefetches left."""
        self.cache.release(step.layer, step.used, step.slots)
        self._after_kernel(step.prefetches, step.streaming)

    def _after_kernel(self, prefetches: list[Prefetch], streaming: bool) -> None:
        """The layer's kernels are issued (finish_step's invariant): start the guesses' copies."""
        self._prefetch(prefetches, streaming)
        self.late.issue_deferred()

    def _route(self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor,
               streaming: bool) -> tuple[list[int], list[Prefetch], torch.Tensor]:
        """Start of a layer step: (distinct experts used, the guesses to prefetch, topk_ids on the
        host), read back with the layer's one sync; the late guess's copies start before it."""
        if layer <= self._last_layer:  # the first MoE layer of a new step
            self.cache.begin_step()
            if self.hybrid is not None:
                self.hybrid.advance()
        self._last_layer = layer
        self._step_seqs = x.shape[0]  # the guesses' precision gate grades steps by their size
        self.late.take(layer)
        guesses = self._guesses(layer, x, streaming)
        used, guessed, host_ids = host_ids_of(topk_ids, [g[1] for g in guesses])
        prefetches: list[Prefetch] = list(zip(guesses, guessed))
        if self.guesser is not None:
            self.guesser.score(layer, used, 0 if streaming else x.shape[0])
            prefetches += self._wrap_guess(layer, used, x.shape[0], streaming)
        return used, prefetches, host_ids

    def _wrap_guess(self, layer: int, used: list[int], seqs: int, streaming: bool) -> list[Prefetch]:
        """Decode steps: remember what the first MoE layer used; at the last, guess that for the
        next step's first layer (the same sequences' next tokens), whose copies then run through
        the end of this step and the start of the next, when the link otherwise idles."""
        g = self.guesser
        assert g is not None  # _route calls this with a guesser only
        if layer == g.first:
            self._first_used = None if streaming else used
        elif not streaming and self._first_used and g.wants_wrap(layer, seqs):
            return [((g.first, None), list(self._first_used))]
        return []

    def _acquire(self, layer: int, used: list[int], host_ids: torch.Tensor, prefetches: list[Prefetch],
                 streaming: bool, cpu: CPUPart | None = None) -> LayerStep:
        """Pin `used` (copying the misses in) and map the pairs to slots; the guesses' copies wait in
        the step for `finish_step` (or start here with FERRYMAN_PREFETCH_AFTER_KERNELS=0). `cpu`: a
        hybrid step's pairs on the CPU, which keep their place in the kernel with weight 0 on a slot
        it reads anyway (0 x a finite expert output adds exactly nothing, and the kernel keeps its
        [T, K] shape and per-token summation order)."""
        if cpu is not None and not used:  # no room at all: the CPU computes the whole layer
            return LayerStep(layer, [], [], None, None, prefetches, streaming, cpu)
        slots = self.cache.acquire(layer, used)
        if not envs.PREFETCH_AFTER_KERNELS:
            self._prefetch(prefetches, streaming)
            prefetches = []
        on_cpu = [] if cpu is None else cpu.experts
        dev_ids, host_slots = self._slot_ids(used + on_cpu, slots + slots[:1] * len(on_cpu), host_ids,
                                             self._upload(streaming))
        return LayerStep(layer, used, slots, dev_ids, host_slots, prefetches, streaming, cpu)

    def _zero_copy(self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_w: torch.Tensor) -> torch.Tensor:
        """Cached experts from their slots, the rest from pinned host memory over the link, in one
        kernel pass; the cache is neither consulted on the host nor changed (prefill fills it)."""
        from ferryman.layers.fused_moe_triton import RowAddresses, fused_moe_decode

        assert self.cache.rows is not None  # enabled in __init__
        index = self.cache.moe_index[layer]
        self.cache.rows.record(index, topk_ids)
        addr = self.cache.rows.layer(index)
        if self.stager is not None and self.stager.fits(topk_ids.numel()):  # host rows -> staging rows first
            addr = self.stager.stage(index, topk_ids)
        rows = RowAddresses(addr, self.cache.pool.layout.offsets)
        return fused_moe_decode(self.fmt, self.cache.banks, x, topk_ids, topk_w, self.act.kind, self.act.alpha,
                                self.act.limit, rows=rows)

    def after_step(self, num_rows: int) -> None:
        """After a decode step of `num_rows` sequences: count its zero-copy reads as hits (slot) or
        misses (host row), and let the policy see the cached experts it used. One small D2H read,
        after the sampler has synchronised anyway; graph-replayed steps included."""
        k = self.cache.store.cfg.top_k
        if not self.zero_copy or num_rows * k > DECODE_MAX_PAIRS or self.cache.rows is None:
            return
        self.cache.begin_step()
        seen = self.cache.rows.seen[:, : num_rows * k].cpu()  # [layers, P]
        for layer, index in self.cache.moe_index.items():
            used = torch.unique(seen[index]).tolist()
            self.cache.count_reads(layer, used)

    def guess_after(self, layer: int, residual: torch.Tensor) -> None:
        """Late decode prefetch after `layer`'s eager MoE: guess from the residual [B, H] (late_guess.py)."""
        self.late.after(layer, residual)

    def guesses_made(self, layer: int, ids: torch.Tensor) -> None:
        """Late guesses of `layer` computed inside its MoE CUDA graph, ids [D, B, K] (late_guess.py)."""
        self.late.made(layer, ids)

    def _guesses(self, layer: int, x: torch.Tensor, streaming: bool) -> list[Guess]:
        """The next layer's guess when prefetch applies, and for a streaming chunk the layers up to
        `lookahead` ahead (their copies queue behind the next layer's)."""
        if not self.prefetch_enabled or self.guesser is None or (self.late_guess and not streaming):
            return []
        nxt = self.guesser.next_of.get(layer)
        if nxt is None:
            return []
        if not self.guesser.wants_prefetch(nxt, streaming, x.shape[0]):
            if not streaming and self.guesser.wants_gap(nxt, x.shape[0]):  # the full guess is off there
                gap = self.guesser.guess(layer, x)
                return [] if gap is None else [gap]
            return []  # no router launch, nothing more to read back
        first = self.guesser.guess(layer, x, wide=not streaming)
        out = [first] if first is not None else []
        for depth in range(2, self.lookahead + 1 if streaming else 2):
            ahead = self.guesser.guess_ahead(layer, x, depth)
            if ahead is None:
                break
            out.append(ahead)
        return out

    def _prefetch(self, prefetches: list[Prefetch], streaming: bool) -> None:
        if self.guesser is None:
            return
        # hybrid decode: copy only the link's share of the guess (HybridSplit.link_share)
        split = self.hybrid if self.hybrid is not None and self.hybrid.decision.enabled and not streaming else None
        for depth, ((target, ids), guessed) in enumerate(prefetches, start=1):  # in layer order
            if not streaming and not self.guesser.counters_for(self._step_seqs)[target].enabled:  # a gap guess
                copy = [e for e in guessed if not self.cache.contains(target, e)][: self.guesser.gap_k]
                self.guesser.remember_gap(target, self.cache.prefetch(target, copy, depth))
                continue
            take = guessed
            if not streaming and self._step_seqs == 1 and ids is not None:  # a full guess, most likely first
                width = self.guesser.copy_width(target)
                self.guesser.remember_tail(target, guessed[width:])
                take = guessed[:width]
            # ascending: consecutive experts into consecutive slots coalesce into one copy
            copy = sorted(take) if split is None else \
                split.link_share(target, [e for e in take if not self.cache.contains(target, e)])
            fetched = self.cache.prefetch(target, copy, depth, streaming=streaming)
            self.guesser.remember(target, guessed, fetched, streaming, self._step_seqs)

    def _compute(self, x: torch.Tensor, topk_w: torch.Tensor, step: LayerStep, streaming: bool) -> torch.Tensor:
        if step.slot_ids is None:  # a hybrid step with every pair on the CPU
            out = torch.zeros_like(x)  # [T, H]
        else:
            w = topk_w if step.cpu is None else topk_w.masked_fill(step.cpu.off, 0.0)
            early = streaming and envs.PREFETCH_BEFORE_GROUPS
            out = fused_moe(self.fmt, self.cache.banks, x, step.slot_ids, w, self.act, host_ids=step.host_slot_ids,
                            inputs_issued=(lambda: self._prefetch(step.prefetches, streaming)) if early else None,
                            upload=self._upload(streaming))
            if early:
                step = replace(step, prefetches=[])  # their copies have started
        self.finish_step(step)
        if streaming:  # a chunk touching about every expert: what it brought in goes first
            self.cache.demote_fetched(step.layer)
        return out if step.cpu is None else out + self.cpu_part(step)

    def _hybrid_step(self, layer: int, x: torch.Tensor, topk_w: torch.Tensor, host_ids: torch.Tensor,
                     used: list[int], prefetches: list[Prefetch]) -> LayerStep:
        """Split the misses into fetched and computed on the CPU (started here, in the worker), and
        acquire the rest: the step's kernel covers every pair, the CPU's with weight 0."""
        assert self.hybrid is not None and self.cpu is not None  # applies() implies both
        self.hybrid.history.use([(layer, e) for e in used])
        misses = [e for e in used if not self.cache.contains(layer, e)]
        hits = len(used) - len(misses)
        # hits are cached and not in use between layers, so room >= 0
        room = self.cache.available() - hits
        tokens = torch.bincount(host_ids.flatten(), minlength=self.num_experts).tolist()  # per expert
        _, on_cpu = self.hybrid.split(layer, misses, room, device_min=0 if hits else 1, tokens=tokens)
        if not on_cpu:
            return self._acquire(layer, used, host_ids, prefetches, False)
        job = self.cpu.submit(layer, x, host_ids, topk_w, on_cpu)  # runs while the device works
        off = torch.zeros(self.num_experts, dtype=torch.bool)
        off[on_cpu] = True
        units = self.hybrid.units(on_cpu, tokens)
        cpu = CPUPart(on_cpu, job, off[host_ids].to(self.cache.device, non_blocking=True), units)  # off: [T, K]
        cpu_set = set(on_cpu)
        return self._acquire(layer, [e for e in used if e not in cpu_set], host_ids, prefetches, False, cpu)

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
            y = fused_moe(self.fmt, self.cache.banks, x[tok], ids, topk_w[tok, kk].unsqueeze(1), self.act)
            out.index_add_(0, tok, y)
            self.cache.release(layer, part, slots)
        return out

    def _upload(self, streaming: bool) -> Upload | None:
        """How a layer's small inputs reach the device: a prefill chunk's on the copy stream
        (Transfer.upload's invariant), a decode step's too with FERRYMAN_INPUTS_ON_COPY_STREAM=all,
        the others on the compute stream."""
        mode = envs.INPUTS_ON_COPY_STREAM
        return self.cache.transfer.upload if mode == "all" or (mode == "prefill" and streaming) else None

    def _slot_ids(self, experts: list[int], slots: list[int], ids: torch.Tensor,
                  upload: Upload | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Expert ids -> (slot ids on the cache's device, the same on the host or None), through a
        per-call table (ids only name experts in `experts`). Host ids (the usual case: read for the
        lookup anyway) are mapped on the host and copied once (by `upload`: a prefill stream's go on
        the copy stream, Transfer.upload); device ids are mapped on the device."""
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
        out["zero_copy"] = self.zero_copy  # its decode reads are not counted as hits or misses
        if self.guesser is not None:
            out.update(self.guesser.stats())
        if self.hybrid is not None:
            out.update(self.hybrid.stats())
        if self.cpu is not None:
            out.update(self.cpu.stats())
        return out


def _check_zero_copy(cache: ExpertCache, hybrid: HybridSplit | None) -> None:
    if cache.device.type != "cuda":
        raise ConfigError("zero-copy decode (FERRYMAN_ZERO_COPY) needs a CUDA device: its kernels read pinned "
                          "host memory through unified addressing")
    if not cache.store.pinned:
        raise ConfigError("zero-copy decode (FERRYMAN_ZERO_COPY) needs the experts in pinned host memory, and "
                          "pinning failed here (see the warning above); turn it off")
    if hybrid is not None and hybrid.decision.enabled:
        raise ConfigError("zero-copy decode (FERRYMAN_ZERO_COPY) and --cpu-experts are exclusive; pick one")
