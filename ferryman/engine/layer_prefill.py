"""The runner's side of layer-major prefill: a job's chunks computed layer by layer.

The scheduler (engine/prefill_job.py) hands over a job once, then a number of layers per step.
Per layer, in chunk order: each chunk's attention (reading the KV the earlier chunks wrote at this
layer, writing its own) and, with offloaded experts, its router, whose ids start for the host at once;
then the MoE of every chunk (OffloadExperts.forward_chunks: chunk c planned as its ids land, while
the GPU still runs later chunks' attention; each uncached expert copied once for the job, the
chunks' experts pinned until the last kernel is issued; the next layer's copies start with the
first kernel).

Invariants:
- `hidden` [T, H] and `residual` [T, H] hold every job token between layers, on the device (the
  planner counts them, planner.prefill_job_bytes); chunk c owns rows bounds[c];
- within a layer, chunk c's attention runs after chunks < c's (causal order through paged KV);
- each chunk sees the same inputs as in chunk-major prefill (same chunks, packing, kernels), so
  both modes give the same tokens; the final norm and lm_head run on the sampled rows only.
"""

from __future__ import annotations

import torch

from ferryman.engine.inputs import StepInputs, prepare_inputs
from ferryman.engine.sched_types import JobPiece, PrefillJob, ScheduledSeq, SchedulerOutput
from ferryman.experts.offload import ChunkRouting, OffloadExperts
from ferryman.kvcache.window_pool import ring_table
from ferryman.layers.moe import SparseMoE
from ferryman.models.transformer import MoETransformer


def job_inputs(job: PrefillJob, block_size: int, device: torch.device, window: int | None) -> list[StepInputs]:
    """One StepInputs per chunk; with a window pool (window: its W), each chunk's window tables map
    onto the job's rings."""
    out = []
    for chunk in job.chunks:
        tables = None
        if window is not None:
            tables = {p.seq.seq_id: ring_table(p.seq.window_table, window, block_size, *job.rings[p.seq.seq_id],
                                               p.start_pos, p.end) for p in chunk}
        step = SchedulerOutput([_scheduled(p) for p in chunk])
        out.append(prepare_inputs(step, block_size, device, window is not None, tables))
    return out


def _scheduled(p: JobPiece) -> ScheduledSeq:
    return ScheduledSeq(p.seq, p.num_tokens, p.start_pos, p.end == p.seq.num_tokens)


class LayerPrefill:
    def __init__(self, model: MoETransformer, experts: object, chunks: list[StepInputs]) -> None:
        self.model, self.experts, self.chunks = model, experts, chunks
        self.bounds: list[tuple[int, int]] = []
        rows = 0
        for c in chunks:
            self.bounds.append((rows, rows + c.input_ids.numel()))
            rows += c.input_ids.numel()
        self.hidden = torch.cat([model.embed(c.input_ids, c.host_ids) for c in chunks])  # [T, H]
        self.residual: torch.Tensor | None = None  # [T, H] after the first layer
        self.next_layer = 0

    @property
    def done(self) -> bool:
        return self.next_layer == len(self.model.layers)

    def advance(self, num_layers: int) -> None:
        for _ in range(num_layers):
            self._layer(self.next_layer)
            self.next_layer += 1

    def _layer(self, index: int) -> None:
        layer = self.model.layers[index]
        first, residual = self.residual is None, self.residual
        if residual is None:
            residual = self.residual = torch.empty_like(self.hidden)
        mlp = layer.mlp
        early = isinstance(mlp, SparseMoE) and isinstance(self.experts, OffloadExperts)
        routed: list[tuple[torch.Tensor, torch.Tensor]] = []  # (ids, weights) [T_c, K] per chunk
        reads: list[ChunkRouting] = []
        for c, ((a, b), inp) in enumerate(zip(self.bounds, self.chunks)):
            # in place: the first layer's residual input is hidden's rows (read before they are written)
            layer.attend(inp.positions, self.hidden[a:b], None if first else residual[a:b], inp.meta,
                         into=(self.hidden[a:b], residual[a:b]))
            if early:  # its routing starts for the host now, while the later chunks' attention runs
                routed.append(mlp.select(self.hidden[a:b]))
                reads.append(self.experts.read_routing(index, self.hidden[a:b], routed[-1][0], c == 0))
        self._mlp(mlp, index, routed, reads)

    def _mlp(self, mlp: torch.nn.Module, index: int, routed: list[tuple[torch.Tensor, torch.Tensor]],
             reads: list[ChunkRouting]) -> None:
        """hidden's rows: MLP input -> MLP output, chunk by chunk (rows of c are read by c only)."""
        if not isinstance(mlp, SparseMoE):
            for a, b in self.bounds:
                self.hidden[a:b] = mlp(self.hidden[a:b])
            return
        if not routed:
            routed = [mlp.select(self.hidden[a:b]) for a, b in self.bounds]

        def emit(c: int, out: torch.Tensor) -> None:  # chunk c's routed output: add the shared experts'
            a, b = self.bounds[c]
            shared = mlp.shared(self.hidden[a:b])
            self.hidden[a:b] = out if shared is None else out + shared

        if isinstance(self.experts, OffloadExperts):
            if mlp.trace is not None:
                mlp.trace.record(index, torch.cat([r[0] for r in routed]))
            self.experts.forward_chunks(index, self.hidden, self.bounds, routed, reads, emit)
            return
        for c, (a, b) in enumerate(self.bounds):
            emit(c, mlp.compute(self.hidden[a:b], *routed[c]))

    def logits(self) -> tuple[torch.Tensor, list[int]]:
        """(logits [B_s, V] fp32 of the sampled rows, their seq ids) once every layer ran."""
        assert self.done and self.residual is not None
        rows = torch.cat([inp.logits_indices + a for (a, _), inp in zip(self.bounds, self.chunks)])
        seq_ids = [i for inp in self.chunks for i in inp.sample_seq_ids]
        hidden = self.model.norm.add_forward(self.hidden[rows], self.residual[rows])[0]  # [B_s, H]
        return self.model.compute_logits(hidden), seq_ids
