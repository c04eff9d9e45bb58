"""Decode steps of offloaded models: the dense part of every layer as a CUDA graph, the MoE eager.

An offloaded MoE layer reads the batch's expert ids on the host (one sync) to fetch its misses, so
a whole step cannot be one graph (engine/cuda_graph.py). Between two such syncs everything is
static: segment i = (residual add +) norm, attention, norm, router of layer i (a dense MLP too for
layers without experts); the last segment is the final norm + lm_head. Each segment is captured
once per batch bucket. A step replays segment 0, runs MoE layer 0 eagerly on its B real rows,
replays segment 1, ... : one launch per segment instead of ~12 eager ones. With late decode
prefetch (FERRYMAN_DECODE_PREFETCH=late) each MoE layer is followed by the backend's guess of the
next one from the residual stream (`OffloadExperts.guess_after`).

Buffers (fixed addresses, `[max_bs, ...]`) and their invariants:
- `x`: the previous block's output, not yet added; `res`: the residual stream before it. Segment i
  reads x and res and writes res, `h` (its MLP input) and, for a MoE layer, `ids` / `w` (the
  routing); the eager MoE then writes x[:B]. A dense layer's segment writes x itself.
- Rows B..bs are padding: they hold stale finite values, write their KV to slot -1, and never
  reach the experts (no expert is fetched for them).
- Segments replay in order on one stream, so one memory pool serves every graph: no two graphs'
  temporaries are live at once, and whatever outlives a segment is copied into the buffers above.
`capture=False` runs the same segment functions eagerly over the same buffers (CPU tests).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch

from ferryman.engine.cuda_graph import StaticDecodeInputs, buckets
from ferryman.engine.inputs import StepInputs
from ferryman.layers.moe import SparseMoE
from ferryman.models.transformer import MoETransformer


class SegmentedDecode:
    def __init__(self, model: MoETransformer, max_bs: int, max_blocks: int, max_seq_len: int,
                 device: torch.device, capture: bool) -> None:
        self.model, self.device, self.capture = model, torch.device(device), capture
        self.static = StaticDecodeInputs(max_bs, max_blocks, max_seq_len, self.device, model)
        dtype = model.embed_tokens.weight.dtype
        self.x = torch.zeros(max_bs, model.cfg.hidden_size, dtype=dtype, device=self.device)  # [max_bs, H]
        self.res = torch.zeros_like(self.x)
        self.h = torch.zeros_like(self.x)
        self.ids: torch.Tensor | None = None  # [max_bs, K]; allocated at the first routing (router's dtype)
        self.w: torch.Tensor | None = None
        self.moe = {i: layer.mlp for i, layer in enumerate(model.layers) if isinstance(layer.mlp, SparseMoE)}
        self.sizes = buckets(max_bs)
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}  # bs -> one graph per segment
        self.logits: dict[int, torch.Tensor] = {}  # bs -> the final segment's output [bs, V]
        self.pool = None
        if capture:
            for bs in reversed(self.sizes):
                self._capture(bs)

    # ---- segments --------------------------------------------------------------------------
    def _segment(self, i: int, bs: int) -> None:
        st, layer = self.static, self.model.layers[i]
        positions, meta = st.positions[:bs], st.meta(bs)
        if i == 0:
            emb = st.token_embeds(bs)
            h, res = layer.attend(positions, self.model.embed_tokens(st.input_ids[:bs]) if emb is None else emb,
                                  None, meta)
        else:
            h, res = layer.attend(positions, self.x[:bs], self.res[:bs], meta)
        self.res[:bs].copy_(res)
        block = self.moe.get(i)
        if block is None:
            self.x[:bs].copy_(layer.mlp(h))
            return
        ids, w = block.select(h)  # [bs, K]
        if self.ids is None or self.w is None:
            self.ids = torch.zeros((self.x.shape[0], ids.shape[1]), dtype=ids.dtype, device=self.device)
            self.w = torch.zeros((self.x.shape[0], w.shape[1]), dtype=w.dtype, device=self.device)
        self.h[:bs].copy_(h)
        self.ids[:bs].copy_(ids)
        self.w[:bs].copy_(w)

    def _final(self, bs: int) -> torch.Tensor:
        hidden = self.model.norm.add_forward(self.x[:bs], self.res[:bs])[0]  # [bs, H]
        return self.model.compute_logits(hidden)  # [bs, V] fp32

    def _functions(self, bs: int) -> list[Callable[[], torch.Tensor | None]]:
        return [partial(self._segment, i, bs) for i in range(len(self.model.layers))] + [partial(self._final, bs)]

    @torch.inference_mode()
    def _capture(self, bs: int) -> None:
        fns = self._functions(bs)
        for _ in range(2):  # warm up (Triton compiles) without the experts: no fetch, no statistics
            for f in fns:
                f()
        torch.cuda.synchronize(self.device)
        graphs = []
        for f in fns:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                out = f()
            if self.pool is None:
                self.pool = graph.pool()
            graphs.append(graph)
        assert out is not None  # the final segment returns the logits
        self.logits[bs] = out
        self.graphs[bs] = graphs

    # ---- a step -----------------------------------------------------------------------------
    def fits(self, inputs: StepInputs) -> bool:
        return self.static.fits(inputs)

    def run(self, inputs: StepInputs) -> torch.Tensor:
        """logits [B, V] fp32 of a decode-only step."""
        B, bs = self.static.fill(inputs, self.sizes)
        fns = None if self.capture else self._functions(bs)
        n = len(self.model.layers)
        for i in range(n):
            self._run_segment(i, bs, fns)
            block = self.moe.get(i)
            if block is not None:
                assert self.ids is not None and self.w is not None  # set by the segment above
                self.x[:B].copy_(block.compute(self.h[:B], self.ids[:B], self.w[:B]))
                if getattr(block.experts, "late_guess", False):  # the residual the next layer starts from
                    block.experts.guess_after(i, self.res[:B] + self.x[:B])
        logits = self._run_segment(n, bs, fns)
        return logits[:B]

    def _run_segment(self, j: int, bs: int, fns: list[Callable[[], torch.Tensor | None]] | None) -> torch.Tensor:
        if fns is not None:
            out = fns[j]()
            return out if out is not None else self.x
        self.graphs[bs][j].replay()
        return self.logits[bs]
