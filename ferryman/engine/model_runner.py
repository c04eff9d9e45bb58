"""Runs one scheduled step on the model: inputs -> forward -> logits -> sampled tokens.

Owns the KV cache tensors (bound to each attention layer) and the expert backend bound to each
MoE block. Decode-only steps replay a captured CUDA graph when one fits the batch.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from ferryman.config import ModelConfig
from ferryman.engine.cuda_graph import DecodeGraphs
from ferryman.engine.inputs import StepInputs, prepare_inputs
from ferryman.engine.layer_prefill import LayerPrefill, job_inputs
from ferryman.engine.outputs import SamplerOutput
from ferryman.engine.sampler import Sampler
from ferryman.engine.sched_types import SchedulerOutput
from ferryman.engine.segment_graphs import SegmentedDecode
from ferryman.engine.sequence import Sequence
from ferryman.experts.offload import OffloadExperts
from ferryman.experts.placement import make_backend, offload_backend
from ferryman.experts.split_trial import link_reads_trial
from ferryman.kvcache.shared_region import SharedRegion
from ferryman.kvcache.state_checkpoints import CheckpointStore
from ferryman.kvcache.state_pool import conv_state_shape, ssm_state_shape
from ferryman.kvcache.window_pool import window_split
from ferryman.layers.fused_moe import DECODE_MAX_PAIRS, MoEActivation
from ferryman.layers.moe_common import triton_reads
from ferryman.planner import MemoryPlan
from ferryman.weights.build import LoadedModel

log = logging.getLogger("ferryman.engine")
SEGMENT_MAX_BS = 64  # larger decode batches of offloaded models run eagerly (launches matter less)


def expert_activation(cfg: ModelConfig) -> MoEActivation:
    return MoEActivation(kind=cfg.expert_act, alpha=cfg.swiglu_alpha, limit=cfg.swiglu_limit)


class ModelRunner:
    def __init__(
        self,
        loaded: LoadedModel,
        device: torch.device,
        num_blocks: int,
        block_size: int,
        max_num_seqs: int,
        max_model_len: int,
        use_cuda_graphs: bool,
        plan: MemoryPlan | None = None,
        expert_options: dict[str, Any] | None = None,
        kv_dtype: torch.dtype | None = None,
        num_window_blocks: int = 0,
        num_state_slots: int = 0,
        num_state_checkpoints: int = 0,
        region: SharedRegion | None = None,
        decode_misses: str = "copy",
        link_on_trial: bool = False,
    ) -> None:
        self.cfg, self.model, self.device = loaded.cfg, loaded.model, device
        self.block_size = block_size
        self.dtype = next(self.model.parameters()).dtype
        # resident experts, or a slot cache of a host store (experts/placement.py); expert_options:
        # offload_backend's (strategy, calibration, decode_prefetch)
        # region: KV blocks and expert slots in one buffer (kvcache/shared_region.py), the experts'
        # slots are its pages, the first plan.expert_slots of them active at first
        # link_on_trial: link reads are auto's choice, kept only where decode steps show them faster
        self.region, self.decode_misses, self.link_on_trial = region, decode_misses, link_on_trial
        shared = {} if region is None or plan is None else \
            dict(rows=region.slot_rows(), active=list(range(plan.expert_slots)))
        self.experts = make_backend(loaded.store, self.model, device, plan, expert_activation(self.cfg),
                                    **(expert_options or {}), **shared)
        for block in self.model.moe_blocks():
            block.experts = self.experts
        # k_cache, v_cache per layer: [N, S, Hkv, D], in the model's dtype or fp8 (kv_cache_dtype);
        # with num_window_blocks, the sliding-window layers' N is that (kvcache/window_pool.py)
        self.kv_dtype = kv_dtype or self.dtype
        self.window_kv = num_window_blocks > 0
        for attn in self.model.attention_layers():
            attn.window_pool = self.window_kv and attn.window is not None
            n = num_window_blocks if attn.window_pool else num_blocks
            shape = attn.cache_shape(n, block_size)  # MLA layers: one latent cache [N, S, 1, C] (layers/mla.py)
            new = (lambda: region.layer_view(shape[1:], self.kv_dtype)) if region is not None and not attn.window_pool \
                else (lambda: torch.zeros(shape, dtype=self.kv_dtype, device=device))
            attn.k_cache = new()
            attn.v_cache = new() if attn.separate_values else None
        self.bind_states(num_state_slots)
        # the prefix cache's state checkpoints (kvcache/state_checkpoints.py), in host RAM
        self.checkpoints = CheckpointStore(num_state_checkpoints, [(layer.conv_state, layer.ssm_state)
                                           for layer in self.model.linear_layers()]) if num_state_checkpoints else None
        if self.checkpoints is not None:  # saves inside a chunk are written there by the layers themselves
            for layer, (conv, ssm) in zip(self.model.linear_layers(), self.checkpoints.saved):
                layer.checkpoint_conv, layer.checkpoint_ssm = conv, ssm
        self.sampler = Sampler()
        self.job: LayerPrefill | None = None  # the layer-major prefill in progress
        self.graphs: DecodeGraphs | SegmentedDecode | None = None
        if use_cuda_graphs and device.type == "cuda" and self.model.linear_layers():
            log.info("decode of a hybrid (linear-attention) model runs without CUDA graphs")
        elif use_cuda_graphs and device.type == "cuda":
            self.graphs = self._capture_graphs(max_num_seqs, -(-max_model_len // block_size), max_model_len)

    def bind_states(self, num_slots: int) -> None:
        """The state pool of the linear-attention layers (kvcache/state_pool.py): per layer a conv
        state [N, C, K-1] in the model's dtype and a recurrent state [N, Hv, Dk, Dv] in fp32."""
        if not self.model.linear_layers():
            return
        if num_slots < 1:
            raise ValueError("a model with linear-attention layers needs state slots (num_state_slots)")
        conv, ssm = (num_slots, *conv_state_shape(self.cfg)), (num_slots, *ssm_state_shape(self.cfg))
        for layer in self.model.linear_layers():
            layer.conv_state = torch.zeros(conv, dtype=self.dtype, device=self.device)
            layer.ssm_state = torch.zeros(ssm, dtype=torch.float32, device=self.device)

    def _capture_graphs(self, max_num_seqs: int, max_blocks: int, max_len: int) -> DecodeGraphs | SegmentedDecode | None:
        """Whole-step graphs when the experts never sync with the host (resident: batches the Triton
        decode kernel takes); per-layer graphs around the MoE of offloaded experts."""
        if not isinstance(self.experts, OffloadExperts):
            # a format the decode kernel does not read runs the batched path, which syncs: eager
            if not all(triton_reads(self.cfg.expert_format_of(layer)) for layer in self.cfg.moe_layers):
                return None
            graph_bs = min(max_num_seqs, max(1, DECODE_MAX_PAIRS // max(1, self.cfg.top_k)))
            return DecodeGraphs(self.model, graph_bs, max_blocks, max_len, self.device)
        try:
            return SegmentedDecode(self.model, min(max_num_seqs, SEGMENT_MAX_BS), max_blocks, max_len, self.device,
                                   capture=True, link=self.decode_misses == "link",
                                   trial=link_reads_trial() if self.link_on_trial else None)
        except RuntimeError as e:  # a capture failure costs speed, not correctness: decode eagerly
            log.warning("per-layer CUDA graphs could not be captured (%s); offloaded decode runs eagerly", e)
            torch.cuda.synchronize(self.device)
            return None

    def note_step(self, seconds: float, batch: int, decode_only: bool) -> None:
        """An engine step of `batch` sequences took `seconds`: auto's trials (the hybrid split's,
        link reads') time it."""
        self.experts.note_step(seconds, batch, decode_only)
        if isinstance(self.graphs, SegmentedDecode):
            self.graphs.note_step(seconds, batch, decode_only)

    def restart_trials(self) -> None:
        """Forget the trials' samples so far (the warm-up's steps pay compiles); verdicts stay."""
        self.experts.restart_trials()
        if isinstance(self.graphs, SegmentedDecode):
            self.graphs.restart_trial()

    def graph_mode(self) -> str:
        """'step' (whole decode steps), 'layer' (dense part of each layer, offloaded MoE eager), 'link'
        (offloaded, small batches as whole steps reading misses over the link, larger ones by layer) or
        'off'."""
        if self.graphs is None:
            return "off"
        if isinstance(self.graphs, SegmentedDecode):
            return "link" if self.graphs.link is not None else "layer"
        return "step"

    def link_trial(self) -> dict | None:
        """auto's link reads on trial against the copy path (steps, verdict, reason), or None."""
        trial = self.graphs.trial if isinstance(self.graphs, SegmentedDecode) else None
        return None if trial is None else trial.as_dict()

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> SamplerOutput:
        """Run the step: a layer-major job's layers first (engine/layer_prefill.py), then the scheduled
        sequences; returns the tokens (and logprobs) of the sequences that sample."""
        logits, seqs = self._run_job(out)
        if out.scheduled:
            inputs = prepare_inputs(out, self.block_size, self.device, self.window_kv)
            if self.checkpoints is not None and out.state_restores:
                self.checkpoints.restore(out.state_restores)
            self.experts.begin_step()
            step_logits = self.compute_logits(inputs, decode_only=out.is_decode_only)
            self.experts.end_step()
            if self.checkpoints is not None and out.state_saves:
                self.checkpoints.save(out.state_saves)
            if inputs.sample_seq_ids:
                logits = step_logits if logits is None else torch.cat([logits, step_logits])
                seqs += [s.seq for s in out.scheduled if s.sample]
        if not seqs:
            return SamplerOutput()
        return self.sampler.sample(logits, seqs)

    def _run_job(self, out: SchedulerOutput) -> tuple[torch.Tensor | None, list[Sequence]]:
        """This step's layers of the layer-major job; when it is done, the logits [B_j, V] of its
        sequences that sample (those still unfinished) and those sequences."""
        if out.job_started is not None:
            window = window_split(self.cfg) if self.window_kv else None
            self.job = LayerPrefill(self.model, self.experts,
                                    job_inputs(out.job_started, self.block_size, self.device, window))
        if not out.job_layers:
            return None, []
        assert self.job is not None  # the scheduler started it
        self.experts.begin_step()
        self.job.advance(out.job_layers)
        self.experts.end_step()
        if not self.job.done:
            return None, []
        logits, seq_ids = self.job.logits()
        self.job = None
        row = {seq_id: i for i, seq_id in enumerate(seq_ids)}
        seqs = [s.seq for s in out.job_finished]
        return logits[[row[s.seq_id] for s in seqs]], seqs

    @torch.inference_mode()
    def score(self, inputs: StepInputs) -> torch.Tensor:
        """logits [T, V] at every position of a packed prefill (LLMEngine.score), one expert step."""
        self.experts.begin_step()
        hidden = self.model(inputs.input_ids, inputs.positions, inputs.meta, inputs.host_ids)  # [T, H]
        self.experts.end_step()
        return self.model.compute_logits(hidden)

    def compute_logits(self, inputs: StepInputs, decode_only: bool) -> torch.Tensor:
        """logits [B_s, V] fp32 for the sampling rows."""
        if decode_only and self.graphs is not None and self.graphs.fits(inputs):
            return self.graphs.run(inputs)
        hidden = self.model(inputs.input_ids, inputs.positions, inputs.meta, inputs.host_ids)  # [T, H]
        if inputs.logits_indices.numel() == 0:
            return hidden.new_empty((0, self.cfg.vocab_size), dtype=torch.float32)
        return self.model.compute_logits(hidden[inputs.logits_indices])

    def rebind_experts(self, **options: Any) -> OffloadExperts:
        """Replace the offloaded experts by a fresh backend (same store and slot count) built with
        `options` (offload_backend's: policy, prefetch, decode_prefetch, strategy, ...; the CPU's
        layers stay the old backend's unless given); returns it."""
        old = self.experts
        if not isinstance(old, OffloadExperts):
            raise ValueError("rebind_experts needs an engine whose experts are offloaded")
        store, slots, device, act = old.cache.store, old.cache.table.num_slots, old.cache.device, old.act
        if old.cache.shared_rows is not None:  # the same pages of the shared region stay slots
            options = dict(options, rows=old.cache.shared_rows, active=old.cache.active_slots())
        options.setdefault("cpu_layers", len(old.cpu_layers))
        if device.type == "cuda":  # copies into the old pool may still be in flight
            torch.cuda.synchronize(device)
        if isinstance(self.graphs, SegmentedDecode):  # its MoE graphs hold the old backend
            self.graphs.release_moe()
        self.experts = old = None  # free the old slot pool before allocating the new one
        for block in self.model.moe_blocks():
            block.experts = None
        self.experts = offload_backend(store, self.model, device, slots, act, **options)
        for block in self.model.moe_blocks():
            block.experts = self.experts
        if isinstance(self.graphs, DecodeGraphs):  # whole-step graphs captured the old slot pool and table
            self.graphs = None
        return self.experts
