"""CUDA graphs for decode steps: one graph per batch-size bucket, sharing one memory pool.

Invariant: everything a captured step reads lives in the static buffers of `StaticDecodeInputs`;
`fill` copies the step's inputs into them (padding rows write their k/v nowhere: slot -1) and the
graph replays. Offloaded experts sync with the host once per MoE layer, so their steps cannot be
one graph: `engine/segment_graphs.py` captures the dense part of each layer instead.
"""

from __future__ import annotations

import torch
from torch import nn

from ferryman.engine.inputs import StepInputs
from ferryman.layers.paged_attention import AttnMetadata


def buckets(max_bs: int) -> list[int]:
    sizes = [b for b in (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256) if b < max_bs]
    return sizes + [max_bs]


class StaticDecodeInputs:
    """The decode-step inputs at fixed addresses, for up to `max_bs` sequences."""

    def __init__(self, max_bs: int, max_blocks: int, max_seq_len: int, device: torch.device,
                 model: nn.Module | None = None) -> None:
        self.max_bs, self.max_seq_len = max_bs, max_seq_len
        self.input_ids = torch.zeros(max_bs, dtype=torch.int64, device=device)
        # a token-embedding table in host RAM cannot be read inside a graph: `fill` looks the
        # step's rows up and copies them into `embeds` [max_bs, H], which the graphs read instead
        self.model, self.embeds = model, None
        if model is not None and model.embed_tokens.weight.device.type != torch.device(device).type:
            self.embeds = torch.zeros(max_bs, model.cfg.hidden_size, dtype=model.embed_tokens.weight.dtype,
                                      device=device)
        self.positions = torch.zeros(max_bs, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((max_bs,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(max_bs, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(max_bs, max_blocks, dtype=torch.int32, device=device)
        # the window pool's tables and slots, when the model's window layers have one (window_pool.py)
        self.window_tables = self.window_slots = None
        if model is not None and any(a.window_pool for a in model.attention_layers()):
            self.window_tables = torch.zeros_like(self.block_tables)
            self.window_slots = torch.full_like(self.slot_mapping, -1)
        self.query_start_loc = torch.arange(max_bs + 1, dtype=torch.int32, device=device)

    def meta(self, bs: int) -> AttnMetadata:
        return AttnMetadata(
            query_start_loc=self.query_start_loc[: bs + 1],
            seq_lens=self.seq_lens[:bs],
            block_tables=self.block_tables[:bs],
            slot_mapping=self.slot_mapping[:bs],
            max_query_len=1,
            max_seq_len=self.max_seq_len,
            window_block_tables=None if self.window_tables is None else self.window_tables[:bs],
            window_slot_mapping=None if self.window_slots is None else self.window_slots[:bs],
        )

    def fits(self, inputs: StepInputs) -> bool:
        B = inputs.input_ids.shape[0]
        return B <= self.max_bs and inputs.meta.block_tables.shape[1] <= self.block_tables.shape[1]

    def fill(self, inputs: StepInputs, sizes: list[int]) -> tuple[int, int]:
        """Copy a step's inputs in; returns (B rows of the step, the bucket bs >= B it runs at)."""
        B = inputs.input_ids.shape[0]
        bs = next(b for b in sorted(sizes) if b >= B)
        m = inputs.meta
        self.input_ids[:B].copy_(inputs.input_ids)
        if self.embeds is not None and self.model is not None:
            self.embeds[:B].copy_(self.model.embed(inputs.input_ids, inputs.host_ids))
        self.positions[:B].copy_(inputs.positions)
        self.slot_mapping[:B].copy_(m.slot_mapping)
        self.slot_mapping[B:bs].fill_(-1)
        self.seq_lens[:B].copy_(m.seq_lens)
        self.seq_lens[B:bs].fill_(1)
        self.block_tables[:B, : m.block_tables.shape[1]].copy_(m.block_tables)
        if self.window_tables is not None and self.window_slots is not None:
            if m.window_block_tables is None or m.window_slot_mapping is None:
                raise RuntimeError("decode graphs of a model with a window pool got no window block tables")
            self.window_slots[:B].copy_(m.window_slot_mapping)
            self.window_slots[B:bs].fill_(-1)
            self.window_tables[:B, : m.window_block_tables.shape[1]].copy_(m.window_block_tables)
        return B, bs

    def token_embeds(self, bs: int) -> torch.Tensor | None:
        """The embeds buffer's first bs rows when the table is on the host, else None (the graph
        looks the rows up itself from input_ids)."""
        return None if self.embeds is None else self.embeds[:bs]


class DecodeGraphs:
    """Whole decode steps as graphs (resident experts: the MoE kernels never sync with the host)."""

    def __init__(self, model: nn.Module, max_bs: int, max_blocks: int, max_seq_len: int, device: torch.device) -> None:
        self.model, self.max_bs, self.device = model, max_bs, device
        self.static = StaticDecodeInputs(max_bs, max_blocks, max_seq_len, device, model)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.pool = None
        for bs in reversed(buckets(max_bs)):
            self._capture(bs)

    def _forward(self, bs: int) -> torch.Tensor:
        st = self.static
        hidden = self.model(st.input_ids[:bs], st.positions[:bs], st.meta(bs), embeds=st.token_embeds(bs))
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def _capture(self, bs: int) -> None:
        for _ in range(2):  # warm up: Triton compiles and autotunes outside the capture
            self._forward(bs)
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            self.logits[bs] = self._forward(bs)
        if self.pool is None:
            self.pool = graph.pool()
        self.graphs[bs] = graph

    def fits(self, inputs: StepInputs) -> bool:
        return self.static.fits(inputs)

    def run(self, inputs: StepInputs) -> torch.Tensor:
        B, bs = self.static.fill(inputs, list(self.graphs))
        self.graphs[bs].replay()
        return self.logits[bs][:B]
