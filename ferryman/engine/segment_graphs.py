"""Decode steps of offloaded models: the dense part of every layer as a CUDA graph, the MoE eager.

An offloaded MoE layer reads the batch's expert ids on the host (one sync) to fetch its misses, so
a whole step cannot be one graph (engine/cuda_graph.py). Between two such syncs everything is
static: segment i = (residual add +) norm, attention, norm, router of layer i (and its shared
experts, or the dense MLP of a layer without experts); the last segment is the final norm +
lm_head. Each segment is captured once per batch bucket. A step replays segment 0, runs MoE layer
0 eagerly on its B real rows, replays segment 1, ... : one launch per segment instead of ~12 eager
ones. The MoE kernel itself is a graph too when the batch fits the Triton decode kernel: the
backend carries the layer's plan out up to the kernel (`OffloadExperts.prepare_decode`: the sync,
lookup, fetches), its slot ids go into a static buffer, the layer's MoE graph replays, and
`finish_step` starts the guesses' copies.
A hybrid split (--moe-strategy hybrid) zeroes the weights of the CPU's pairs in `w` before the replay and
adds the CPU's part to x after it. Steps that need the eager MoE (rounds, a backend rebound after
capture) run it between the segments.

Buffers (fixed addresses, `[max_bs, ...]`) and their invariants:
- `x`: the previous block's output, not yet added; `res`: the residual stream before it. Segment i
  reads x and res and writes res, `h` (its MLP input) and, for a MoE layer, `ids` / `w` (the
  routing); the eager MoE then writes x[:B], or the MoE graph x[:bs] from `slots` (the slot of
  each pair; padding rows repeat row 0's). A dense layer's segment writes x itself. A layer with
  shared experts writes their output to `shared` in its segment; it is added to x[:B] after the
  routed experts (routed + shared, the reference's order).
- Rows B..bs are padding: they hold stale finite values, write their KV to slot -1, and never
  reach the experts (no expert is fetched for them).
- Segments replay in order on one stream, so one memory pool serves every graph: no two graphs'
  temporaries are live at once, and whatever outlives a segment is copied into the buffers above.
`capture=False` runs the same segment functions eagerly over the same buffers (CPU tests).

Link reads (`link=True`, experts/link_table.py): a batch the decode kernel takes (bs x K pairs within
DECODE_MAX_PAIRS, and at most planner.LINK_MAX_SHARE of a layer's experts) runs as one graph, ("step", n):
each layer's attention, its MoE mapping its expert ids through the link table (uncached experts
are read over the link by the kernel itself) and the shared experts' add, on the step's own tensors
(none of the segments' staging copies), then the final norm and lm_head. Padding
rows take row 0's experts (`valid`), so they read nothing more. No host step between layers; the
cache's bookkeeping runs once per step (`settle`). When auto chose link reads, they stand on trial
(`trial`, experts/split_trial.link_reads_trial): link-sized steps alternate in windows between link steps
and the copy path (both captured at those sizes), timed by the engine (`note_step`); a verdict
against link reads turns them off for good.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial

import torch

from ferryman.engine.cuda_graph import StaticDecodeInputs, buckets
from ferryman.engine.inputs import StepInputs
from ferryman.experts.link_table import LinkTable
from ferryman.experts.offload import OffloadExperts
from ferryman.experts.split_trial import SplitTrial
from ferryman.layers import backend
from ferryman.layers.fused_moe import DECODE_MAX_PAIRS, fused_moe
from ferryman.layers.moe_common import triton_reads
from ferryman.layers.moe import SparseMoE
from ferryman.models.transformer import MoETransformer
from ferryman.planner import link_step_fits

log = logging.getLogger("ferryman.engine")
Key = tuple[str, int]  # ("seg", layer) | ("moe", layer) | ("final", num_layers) | ("step", num_layers)


class SegmentedDecode:
    def __init__(self, model: MoETransformer, max_bs: int, max_blocks: int, max_seq_len: int,
                 device: torch.device, capture: bool, link: bool = False,
                 trial: SplitTrial | None = None) -> None:
        self.model, self.device, self.capture = model, torch.device(device), capture
        self.static = StaticDecodeInputs(max_bs, max_blocks, max_seq_len, self.device, model)
        dtype = model.embed_tokens.weight.dtype
        self.x = torch.zeros(max_bs, model.cfg.hidden_size, dtype=dtype, device=self.device)  # [max_bs, H]
        self.res = torch.zeros_like(self.x)
        self.h = torch.zeros_like(self.x)
        self.shared = torch.zeros_like(self.x)  # [max_bs, H]: the shared experts' output of the layer
        self.ids: torch.Tensor | None = None  # [max_bs, K]; allocated at the first routing (router's dtype)
        self.w: torch.Tensor | None = None
        self.moe = {i: layer.mlp for i, layer in enumerate(model.layers) if isinstance(layer.mlp, SparseMoE)}
        self.slots = torch.zeros(max_bs, model.cfg.top_k, dtype=torch.int32, device=self.device)  # [max_bs, K]
        # the backend each MoE graph was captured against: its slot banks are baked into the graph
        self.captured = {i: self._graph_backend(i) for i in self.moe}
        self.sizes = buckets(max_bs)
        self.link = self._link_table(max_bs) if link else None
        self.trial = trial if self.link is not None else None  # link reads on trial (auto's choice)
        self.timed = False  # the last step ran link-sized while on trial: its time is a sample
        self.valid = torch.zeros(max_bs, dtype=torch.bool, device=self.device)  # [max_bs] rows < B (link steps)
        self.graphs: dict[int, dict[Key, torch.cuda.CUDAGraph]] = {}  # bs -> a graph per segment / MoE
        self.logits: dict[int, dict[Key, torch.Tensor]] = {}  # bs -> the final / step graph's logits [bs, V]
        self.pool = None
        if capture:
            for bs in reversed(self.sizes):
                self._capture(bs)

    # ---- segments --------------------------------------------------------------------------
    def _attend(self, i: int, bs: int, x: torch.Tensor, res: torch.Tensor,
                into: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's attention block on the static rows: (MLP input, residual) [bs, H] each, written
        into `into` if given; x, res: the previous layer's (unused at layer 0, which starts from the
        tokens' embeddings)."""
        st, layer = self.static, self.model.layers[i]
        positions, meta = st.positions[:bs], st.meta(bs)
        if i == 0:
            emb = st.token_embeds(bs)
            return layer.attend(positions, self.model.embed_tokens(st.input_ids[:bs]) if emb is None else emb,
                                None, meta, into)
        return layer.attend(positions, x, res, meta, into)

    def _segment(self, i: int, bs: int) -> None:
        layer = self.model.layers[i]
        # the MLP input and the residual straight into their buffers (res: its own rows, read first)
        h, _ = self._attend(i, bs, self.x[:bs], self.res[:bs], into=(self.h[:bs], self.res[:bs]))
        block = self.moe.get(i)
        if block is None:
            self.x[:bs].copy_(layer.mlp(h))
            return
        ids, w = block.select(h)  # [bs, K]
        shared = block.shared(h)
        if shared is not None:
            self.shared[:bs].copy_(shared)
        if self.ids is None or self.w is None:
            self.ids = torch.zeros((self.x.shape[0], ids.shape[1]), dtype=ids.dtype, device=self.device)
            self.w = torch.zeros((self.x.shape[0], w.shape[1]), dtype=w.dtype, device=self.device)
        self.ids[:bs].copy_(ids)
        self.w[:bs].copy_(w)

    def _moe(self, i: int, bs: int) -> None:
        """Layer i's experts on the static rows: x[:bs] from h, the slots and the weights."""
        experts = self.moe[i].experts
        assert isinstance(experts, OffloadExperts) and self.w is not None  # _moe_keys / the segment
        self.x[:bs].copy_(fused_moe(experts.cache.format_of(i), experts.cache.banks_of(i), self.h[:bs],
                                    self.slots[:bs], self.w[:bs], experts.act))

    def _graph_backend(self, i: int) -> OffloadExperts | None:
        experts = self.moe[i].experts
        return experts if isinstance(experts, OffloadExperts) else None

    def _link_layer(self, i: int, bs: int, x: torch.Tensor, res: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i of a link step on the step's own tensors, uncached experts read over the link: (its
        output, the residual) [bs, H]. No host step runs inside a link step, so nothing is staged in
        the static buffers the copy path's segments hand over."""
        h, res = self._attend(i, bs, x, res)
        block = self.moe.get(i)
        if block is None:
            return self.model.layers[i].mlp(h), res
        experts, link = block.experts, self.link
        assert isinstance(experts, OffloadExperts) and link is not None  # _link_table
        ids, w = block.select(h)  # [bs, K]
        ids = torch.where(self.valid[:bs, None], ids, ids[:1])  # padding rows: row 0's experts
        m = link.row(i)
        link.log[m, :bs].copy_(ids)  # as int32
        slots = link.table[m][ids]  # [bs, K] int32: slot, or -1 - e
        out = fused_moe(experts.cache.format_of(i), experts.cache.banks_of(i), h, slots, w, experts.act,
                        host=link.banks[i])
        shared = block.shared(h)
        return (out if shared is None else out + shared), res  # routed + shared, the reference's order

    def _link_step(self, bs: int) -> torch.Tensor:
        """A whole decode step with link reads: logits [bs, V]."""
        x, res = self.x[:bs], self.res[:bs]  # unread: layer 0 starts from the embeddings
        for i in range(len(self.model.layers)):
            x, res = self._link_layer(i, bs, x, res)
        return self._final(bs, x, res)

    def _link_table(self, max_bs: int) -> LinkTable | None:
        """The link table of the one offloaded backend every MoE layer uses, when link steps can
        run: no layer on the CPU, no hybrid split, formats the decode kernel reads, and host
        banks the GPU can read (pinned, through the Triton decode kernel; the CPU reads its own)."""
        backends = {id(b): b for b in self.captured.values()}
        ex = next(iter(backends.values()), None)
        if len(backends) != 1 or ex is None or ex.cpu_layers or ex.hybrid is not None:
            return None
        if self.device.type == "cuda" and not (ex.cache.store.pinned and
                                               backend.moe_triton(torch.empty(0, device=self.device), True)):
            return None  # only the Triton decode kernel reads host banks in place (not FERRYMAN_KERNELS=torch)
        if not all(triton_reads(ex.cache.format_of(i)) for i in self.moe):
            return None
        try:
            return LinkTable(ex.cache, max_bs, self.model.cfg.top_k)
        except ValueError as e:  # banks the kernels cannot read in place: the copy path, as without link
            log.warning("link reads are off: %s", e)
            return None

    def _link_graph(self, bs: int) -> bool:
        """Batch bs runs as a link step (planner.link_step_fits)."""
        return self.link is not None and link_step_fits(self.model.cfg, bs)

    def _final(self, bs: int, x: torch.Tensor | None = None, res: torch.Tensor | None = None) -> torch.Tensor:
        """The final norm and lm_head on the last layer's output (default: the static rows')."""
        x, res = (self.x[:bs], self.res[:bs]) if x is None or res is None else (x, res)
        hidden = self.model.norm.add_forward(x, res)[0]  # [bs, H]
        return self.model.compute_logits(hidden)  # [bs, V] fp32

    def _functions(self, bs: int) -> dict[Key, Callable[[], torch.Tensor | None]]:
        """What is captured at batch bs: the whole link step, or the segments (_segment_functions)."""
        if not self._link_graph(bs):
            return self._segment_functions(bs)
        fns: dict[Key, Callable[[], torch.Tensor | None]] = {("step", len(self.model.layers)):
                                                               partial(self._link_step, bs)}
        return fns if self.trial is None else fns | self._segment_functions(bs)

    def _segment_functions(self, bs: int) -> dict[Key, Callable[[], torch.Tensor | None]]:
        """In replay order: segment i, then layer i's MoE graph when it has one; the final segment."""
        fns: dict[Key, Callable[[], torch.Tensor | None]] = {}
        n = len(self.model.layers)
        for i in range(n):
            fns[("seg", i)] = partial(self._segment, i, bs)
            if self._moe_graph(i, bs):
                fns[("moe", i)] = partial(self._moe, i, bs)
        fns[("final", n)] = partial(self._final, bs)
        return fns

    def _moe_graph(self, i: int, bs: int) -> bool:
        """Layer i's MoE runs as a graph at batch bs: an offloaded backend whose decode kernel needs
        no host sync (bs x K pairs within the Triton decode kernel's range)."""
        return self.captured.get(i) is not None and bs * self.model.cfg.top_k <= DECODE_MAX_PAIRS

    @torch.inference_mode()
    def _capture(self, bs: int) -> None:
        fns = self._functions(bs)
        for _ in range(2):  # warm up (Triton compiles) without the experts: no fetch, no statistics
            for f in fns.values():
                f()
        torch.cuda.synchronize(self.device)
        graphs, logits = {}, {}
        for key, f in fns.items():
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                out = f()
            if self.pool is None:
                self.pool = graph.pool()
            graphs[key] = graph
            if out is not None:  # the final segment and the link step return the logits
                logits[key] = out
        self.logits[bs] = logits
        self.graphs[bs] = graphs

    def release_moe(self) -> None:
        """Forget the MoE graphs and the backends they were captured against (rebind_experts): the
        old slot pool can then be freed before a new one is allocated; those layers run eagerly."""
        self.captured = {i: None for i in self.moe}
        self.link = None  # its table names the old pool's slots
        for graphs in self.graphs.values():
            for key in [k for k in graphs if k[0] in ("moe", "step")]:
                del graphs[key]

    # ---- a step -----------------------------------------------------------------------------
    def fits(self, inputs: StepInputs) -> bool:
        return self.static.fits(inputs)

    def run(self, inputs: StepInputs) -> torch.Tensor:
        """logits [B, V] fp32 of a decode-only step."""
        B, bs = self.static.fill(inputs, self.sizes)
        n = len(self.model.layers)
        self.timed = False
        if self.link is not None:
            link_sized = self._link_graph(bs) and all(self.moe[i].trace is None for i in self.moe)
            self.timed = link_sized and self.trial is not None
            if link_sized and (self.trial is None or self.trial.on):
                self.valid.fill_(False)
                self.valid[:B] = True
                self.link.publish()
                logits = self._run(("step", n), bs, None if self.capture else self._functions(bs))
                self.link.logged(B)
                self.link.settle(keep=1)  # the previous link step's bookkeeping, while this one computes
                return logits[:B]
            self.link.settle()  # every link step's, before the copy path reads the cache
        # eager where this batch's graphs were not captured (a link batch traced, or rebound)
        fns = None if self.capture and ("seg", 0) in self.graphs.get(bs, {}) else self._segment_functions(bs)
        for i in range(n):
            self._run(("seg", i), bs, fns)
            block = self.moe.get(i)
            if block is None:
                continue
            if not self._moe_step(i, B, bs, fns):
                assert self.ids is not None and self.w is not None  # set by the segment above
                self.x[:B].copy_(block.compute(self.h[:B], self.ids[:B], self.w[:B]))
            if block.shared_experts is not None:
                self.x[:B].add_(self.shared[:B])
        logits = self._run(("final", n), bs, fns)
        return logits[:B]

    def restart_trial(self) -> None:
        """Forget the link trial's samples (a warm-up's steps pay compiles); a verdict stays."""
        if self.trial is not None:
            self.trial.restart()

    def note_step(self, seconds: float, batch: int, decode_only: bool) -> None:
        """An engine step of `batch` sequences took `seconds`: a sample of the link trial when it ran
        link-sized (a link step or the copy path, as the trial's window said). A verdict against link
        reads turns them off: every later step takes the copy path."""
        timed, self.timed = self.timed, False
        if not timed or self.trial is None or self.link is None:
            return
        verdict = self.trial.note(seconds, batch, decode_only)
        if verdict is None:
            return
        log.info("decode_misses auto: %s", self.trial.reason)
        if not verdict:
            self.link.settle()
            self.link = None
            for graphs in self.graphs.values():
                graphs.pop(("step", len(self.model.layers)), None)

    def _moe_step(self, i: int, B: int, bs: int, fns: dict[Key, Callable[[], torch.Tensor | None]] | None) -> bool:
        """Layer i's MoE through its graph; False when this step needs the eager path."""
        block, experts = self.moe[i], self.moe[i].experts
        if (not self._moe_graph(i, bs) or experts is not self.captured[i] or block.trace is not None
                or self.ids is None):
            return False
        assert isinstance(experts, OffloadExperts)  # captured[i] is one
        assert self.w is not None  # written by the segment, with ids
        step = experts.prepare_decode(i, self.h[:B], self.ids[:B], self.w[:B])
        if step is None:
            return False
        if step.slot_ids is None:  # hybrid, every pair on the CPU: no kernel, no guesses
            experts.finish_step(step)
            self.x[:B].copy_(experts.cpu_part(step))
            return True
        if step.cpu is not None:  # hybrid: the CPU's pairs weigh 0 in the graph's kernel
            self.w[:B].masked_fill_(step.cpu.off, 0.0)
        self.slots[:B].copy_(step.slot_ids)
        if bs > B:  # padding rows read row 0's slots: valid, finite, and their output is unused
            self.slots[B:bs].copy_(self.slots[:1].expand(bs - B, -1))
        self._run(("moe", i), bs, fns)
        experts.finish_step(step)
        if step.cpu is not None:
            self.x[:B].add_(experts.cpu_part(step))
        return True

    def _run(self, key: Key, bs: int, fns: dict[Key, Callable[[], torch.Tensor | None]] | None) -> torch.Tensor:
        if fns is not None:
            out = fns[key]()
            return out if out is not None else self.x
        self.graphs[bs][key].replay()
        return self.logits[bs].get(key, self.x)
