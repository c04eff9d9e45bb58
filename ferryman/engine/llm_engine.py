"""The engine loop: requests in, one scheduled step at a time, token deltas out."""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, replace

import torch

from ferryman.config import EngineConfig, ModelConfig
from ferryman.engine.detokenizer import IncrementalDetokenizer
from ferryman.engine.inputs import prepare_inputs
from ferryman.engine.model_runner import ModelRunner
from ferryman.engine.outputs import RequestMetrics, RequestOutput, StepDelta
from ferryman.engine.sched_types import ScheduledSeq, SchedulerConfig, SchedulerOutput
from ferryman.engine.scheduler import Scheduler
from ferryman.engine.sequence import Sequence
from ferryman.engine.split_wiring import make_split, set_split_bounds, shared_region, split_report
from ferryman.errors import ConfigError, PromptTooLongError
from ferryman.experts.placement import enforce_budget, engine_plan, store_factory
from ferryman.kvcache.state_checkpoints import CHECKPOINTS_PER_SEQ
from ferryman.kvcache.state_pool import num_linear_layers
from ferryman.kvcache.window_pool import num_window_layers, window_split
from ferryman.planner import kv_bytes_per_token
from ferryman.sampling_params import SamplingParams
from ferryman.tokenizer import extra_eos_ids, load_gguf_tokenizer, load_tokenizer
from ferryman.weights.build import build_model, resolve_dtype, resolve_model

log = logging.getLogger("ferryman.engine")
# room kept free on the GPU for activations of the largest prefill chunk and CUDA graphs
_ACTIVATION_HEADROOM = 2 << 30
# a step slower than this is logged with what it held (first-request compiles, stalls), and counted
SLOW_STEP_S = 1.0


@dataclass
class _Request:
    seq: Sequence
    detok: IncrementalDetokenizer
    output: RequestOutput


class LLMEngine:
    def __init__(self, ecfg: EngineConfig) -> None:
        self.ecfg = ecfg
        self.device = ecfg.torch_device()
        resolved = resolve_model(ecfg.model, ecfg.load_format, ecfg.config_folder, ecfg.quantization)
        self.cfg: ModelConfig = resolved.cfg
        self.max_model_len = ecfg.context_len(self.cfg)
        # budget split, resident vs offloaded experts, KV size (ferryman/planner.py); cap the GPU first
        enforce_budget(ecfg, self.device)
        self.plan = engine_plan(ecfg, self.cfg, resolve_dtype(ecfg.dtype, self.cfg), self.device, self.max_model_len)
        # the concurrency and step size the plan was made for (the planner picks them when None)
        self.ecfg = ecfg = replace(ecfg, max_num_seqs=self.plan.request.max_num_seqs,
                                   max_num_batched_tokens=self.plan.request.max_num_batched_tokens)
        loaded = build_model(ecfg.model, self.device, ecfg.dtype, ecfg.load_format, seed=ecfg.seed,
                             quantization=ecfg.quantization, progress=ecfg.progress,
                             store_factory=store_factory(self.plan, self.device),
                             host_embedding=self.plan.host_embedding and self.device.type == "cuda",
                             resolved=resolved)
        # a GGUF model's tokenizer comes from its metadata unless config_folder ships one
        self.tokenizer = load_tokenizer(loaded.folder)
        if self.tokenizer is None and loaded.gguf is not None and loaded.gguf.get("tokenizer.ggml.model") is not None:
            self.tokenizer = load_gguf_tokenizer(loaded.gguf.path, loaded.gguf.get)
        # the KV cache's storage dtype: the model's, or fp8 (kv_cache_dtype; planned above)
        kv = self.plan.request.kv_dtype or next(loaded.model.parameters()).dtype
        num_blocks = self._num_blocks(kv)
        # offload: KV blocks and expert slots in one region (engine/split_wiring.py)
        region = shared_region(self.plan, num_blocks, ecfg.block_size, self.device)
        if region is not None:
            num_blocks = region.num_blocks
        window = window_split(self.cfg)  # the sliding-window layers' own pool (kvcache/window_pool.py)
        num_window_blocks = self.plan.request.window_blocks
        # hybrid models: a linear-attention state slot per running sequence (kvcache/state_pool.py)
        num_state_slots = ecfg.max_num_seqs if num_linear_layers(self.cfg) else 0
        # and their prefix-cache checkpoints in host RAM (kvcache/state_checkpoints.py)
        num_checkpoints = CHECKPOINTS_PER_SEQ * num_state_slots if ecfg.enable_prefix_caching else 0
        eos = set(self.cfg.eos_token_ids) | extra_eos_ids(loaded.folder, self.tokenizer)
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_model_len=self.max_model_len,
                num_blocks=num_blocks,
                max_num_seqs=ecfg.max_num_seqs,
                max_num_batched_tokens=ecfg.max_num_batched_tokens,
                block_size=ecfg.block_size,
                enable_prefix_caching=ecfg.enable_prefix_caching,
                window=window,
                num_window_blocks=num_window_blocks,
                num_state_slots=num_state_slots,
                num_state_checkpoints=num_checkpoints,
                blocks_per_page=region.geometry.blocks_per_page if region is not None else 1,
                num_layers=self.cfg.num_layers,
                prefill_job_tokens=self.plan.prefill_job_tokens,
            ),
            eos_token_ids=eos,
        )
        graphs = not ecfg.enforce_eager
        self.runner = ModelRunner(loaded, self.device, num_blocks, ecfg.block_size, ecfg.max_num_seqs,
                                  self.max_model_len, use_cuda_graphs=graphs, plan=self.plan,
                                  # link steps leave the CPU nothing to split (planner.plan_decode_misses)
                                  expert_options=dict(strategy="offload" if self.plan.decode_misses == "link"
                                                      else ecfg.offload.moe_strategy,
                                                      calibration=ecfg.offload.calibration,
                                                      decode_prefetch=ecfg.offload.decode_prefetch),
                                  kv_dtype=kv, num_window_blocks=num_window_blocks,
                                  num_state_slots=num_state_slots, num_state_checkpoints=num_checkpoints,
                                  region=region, decode_misses=self.plan.decode_misses,
                                  link_on_trial=self.plan.request.decode_misses == "auto")
        # the boundary that moves with the load (engine/memory_split.py)
        self.split = make_split(self.plan, ecfg, self.cfg, region, self.scheduler.pool,
                                lambda: self.runner.experts.cache)
        if self.split is not None:
            self.scheduler.grow_kv = self.split.ensure_kv
        self.expert_bytes = loaded.store.nbytes()
        self.requests: dict[int, _Request] = {}  # unfinished, by request id (== seq id)
        self.finished: dict[int, RequestOutput] = {}  # finished, until popped
        self.num_steps = 0
        self.num_generated = 0
        self.last_step_size = 0  # sequences in the last step
        self.last_step_shape = (0, 0)  # the last step's (decoding sequences, prompt tokens)
        self.slow_steps = 0  # steps over SLOW_STEP_S
        self.slowest_step: dict = {}  # the slowest step: seconds, sequences, tokens, prefill tokens
        self.warming_up = False  # engine/warm_up.py runs: its slow steps (compiles) are expected
        # layer-major prefill (engine/prefill_job.py): jobs, their steps, and the longest step that ran
        # job layers beside decodes (what a decoding user waits for one token, at most)
        self.prefill_jobs = {"jobs": 0, "steps": 0, "decode_steps": 0, "max_decode_stall_s": 0.0}

    # ---- sizing ------------------------------------------------------------------------------
    def _num_blocks(self, dtype: torch.dtype) -> int:
        """Blocks of the main KV pool (every layer but the window pool's)."""
        per_token = kv_bytes_per_token(self.cfg, dtype, self.cfg.num_attention_layers - num_window_layers(self.cfg))
        wanted = self.ecfg.max_num_seqs * self.max_model_len
        if self.ecfg.kv_cache_tokens is not None:
            tokens = self.ecfg.kv_cache_tokens
        elif self.plan.kv_tokens is not None:  # a budget: the plan gave KV its share
            tokens = self.plan.kv_tokens
        elif self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            budget = free - total * (1 - self.ecfg.gpu_memory_utilization) - _ACTIVATION_HEADROOM
            budget -= replace(self.plan.request, kv_dtype=dtype).window_kv_bytes
            tokens = min(wanted, int(budget // per_token))
        else:
            tokens = min(wanted, max(4 * self.max_model_len, 1 << 16))
        blocks = math.ceil(max(tokens, 0) / self.ecfg.block_size)
        needed = math.ceil(self.max_model_len / self.ecfg.block_size)
        if blocks < needed:
            raise ConfigError(
                f"KV cache holds {blocks * self.ecfg.block_size} tokens, less than max_model_len "
                f"{self.max_model_len}; it needs {needed * self.ecfg.block_size * per_token / 2**30:.2f} GiB "
                f"- lower max_model_len or free memory"
            )
        return blocks

    def memory_split(self) -> dict:
        """The shared region's split (KV pages vs expert slots, in use / free, bounds, moves) with the
        expert cache's hit rate, the link's GB/s and the preemptions ({"shared": False} without one),
        and how decode steps reach uncached experts now (`miss_path`, `link_trial`)."""
        path = {"miss_path": "none" if self.plan.strategy == "resident" else self.runner.graph_mode(),
                "link_trial": self.runner.link_trial()}
        if self.split is None:
            return {"shared": False, "num_preemptions": self.scheduler.num_preemptions, **path}
        return {**split_report(self.split, self.plan.pages.page_bytes, self.ecfg.block_size,
                               self.expert_stats(block=False), self.scheduler.num_preemptions), **path}

    def set_memory_bounds(self, min_expert_slots: int | None = None, max_expert_slots: int | None = None,
                          kv_reserve_tokens: int | None = None) -> dict:
        """Change the split's bounds live (between steps); ConfigError naming a bound out of range."""
        set_split_bounds(self.split, self.ecfg.block_size, min_expert_slots, max_expert_slots, kv_reserve_tokens)
        return self.memory_split()

    # ---- requests ----------------------------------------------------------------------------
    def add_request(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        if len(prompt_token_ids) >= self.max_model_len:
            raise PromptTooLongError(len(prompt_token_ids), self.max_model_len)
        vocab = self.cfg.vocab_size
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise ConfigError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab})")
        seq = Sequence(prompt_token_ids, params)
        self.scheduler.add(seq)
        out = RequestOutput(seq.seq_id, list(prompt_token_ids))
        self.requests[seq.seq_id] = _Request(seq, IncrementalDetokenizer(self.tokenizer, params.stop), out)
        return seq.seq_id

    @property
    def uses_message_ends(self) -> bool:
        """Whether SamplingParams.message_ends matters: a hybrid model with prefix caching saves
        state checkpoints there (kvcache/state_checkpoints.py)."""
        return self.scheduler.checkpoints is not None

    def abort(self, request_id: int) -> None:
        if self.scheduler.finish(request_id, "abort") is not None:
            self._finalize(self.requests[request_id], "abort")

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[StepDelta]:
        out = self.scheduler.schedule()
        if out.is_empty:
            return []
        started = time.perf_counter()
        sampled = self.runner.execute(out)
        prefill = sum(s.num_tokens for s in out.scheduled if not s.is_decode)
        seconds = time.perf_counter() - started
        self._note_slow(out, prefill, seconds)
        self._note_job(out, seconds)
        self.runner.note_step(seconds, len(out.scheduled), out.is_decode_only and not out.job_layers)
        self.scheduler.update(out, sampled.token_ids)
        if self.split is not None:  # idle KV pages become expert slots, between steps
            self.split.rebalance()
        self.num_steps += 1
        self.last_step_size = len(out.scheduled)
        self.last_step_shape = (sum(1 for s in out.scheduled if s.is_decode), prefill)
        self.num_generated += len(sampled.token_ids)
        deltas = []
        for seq_id, token in sampled.token_ids.items():
            req = self.requests[seq_id]
            text = req.detok.update(req.seq.output_token_ids)
            if req.detok.stopped and not req.seq.is_finished:
                self.scheduler.finish(seq_id, "stop")
            reason = req.seq.finish_reason if req.seq.is_finished else None
            if reason is not None:
                text += req.detok.flush(req.seq.output_token_ids)
                self._finalize(req, reason)
            req.output.text += text
            deltas.append(StepDelta(seq_id, [token], text, reason, [sampled.logprobs.get(seq_id)],
                                    req.seq.num_cached_tokens))
        return deltas

    def _note_slow(self, out: SchedulerOutput, prefill: int, seconds: float) -> None:
        if seconds <= self.slowest_step.get("seconds", 0.0) and seconds <= SLOW_STEP_S:
            return
        shape = {"seconds": round(seconds, 3), "sequences": len(out.scheduled),
                 "tokens": out.num_batched_tokens, "prefill_tokens": prefill, "step": self.num_steps + 1}
        if seconds > self.slowest_step.get("seconds", 0.0):
            self.slowest_step = shape
        if seconds > SLOW_STEP_S:
            self.slow_steps += 1
            log.log(logging.INFO if self.warming_up else logging.WARNING,
                    "slow step %d: %.2f s for %d sequences, %d tokens (%d prefill)", shape["step"], seconds,
                    shape["sequences"], shape["tokens"], prefill)

    def _note_job(self, out: SchedulerOutput, seconds: float) -> None:
        if not out.job_layers:
            return
        jobs = self.prefill_jobs
        jobs["jobs"] += out.job_started is not None
        jobs["steps"] += 1
        if any(s.is_decode for s in out.scheduled):
            jobs["decode_steps"] += 1
            jobs["max_decode_stall_s"] = max(jobs["max_decode_stall_s"], round(seconds, 4))

    def _finalize(self, req: _Request, reason: str) -> None:
        seq, out = req.seq, req.output
        out.token_ids = list(seq.output_token_ids)
        out.finish_reason = reason
        out.metrics = _metrics(seq)
        self.requests.pop(seq.seq_id, None)
        self.finished[seq.seq_id] = out

    def pop_output(self, request_id: int) -> RequestOutput | None:
        """The final output of a finished request (once)."""
        return self.finished.pop(request_id, None)

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """Ids that finish a request unless it ignores eos: the model's and its tokenizer's."""
        return self.scheduler.eos_token_ids

    def reset_after_warm_up(self) -> None:
        """Forget what warm-up requests left: cached prompts, step counters and the expert guesses'
        grades (the gates learn from real traffic, not from the warm-up's small batches), and the samples
        of auto's trials (the warm-up's steps pay compiles)."""
        if self.has_unfinished():
            raise RuntimeError("reset_after_warm_up() needs an idle engine")
        guesser = getattr(self.runner.experts, "guesser", None)
        if guesser is not None:
            guesser.reset_grades()
        self.scheduler.reset_prefix_cache()
        self.runner.restart_trials()
        self.num_steps = self.num_generated = self.slow_steps = 0
        self.prefill_jobs = dict.fromkeys(self.prefill_jobs, 0)
        self.prefill_jobs["max_decode_stall_s"] = 0.0
        self.slowest_step = {}

    @torch.inference_mode()
    def score(self, prompts: list[list[int]]) -> list[torch.Tensor]:
        """Logits [L_i, V] fp32 at every position of each prompt (evaluation, parity tests).

        All prompts run packed in one prefill through the paged KV cache; blocks are returned
        uncached."""
        if self.scheduler.has_unfinished():
            raise RuntimeError("score() needs an idle engine")
        seqs = []
        sched = self.scheduler
        try:
            for ids in prompts:
                if len(ids) > self.max_model_len:
                    raise PromptTooLongError(len(ids), self.max_model_len)
                seq = Sequence(ids, SamplingParams(max_tokens=1))
                seqs.append(seq)
                if not sched.allocate_blocks(seq, seq.num_tokens):
                    raise ConfigError(self._score_too_big(sum(map(len, prompts))))
            step = SchedulerOutput([ScheduledSeq(s, s.num_tokens, 0, False) for s in seqs])
            inputs = prepare_inputs(step, self.ecfg.block_size, self.device, self.runner.window_kv)
            logits = self.runner.score(inputs)  # [T, V]
            return list(logits.split([len(p) for p in prompts]))
        finally:
            for seq in seqs:
                sched.free_blocks(seq)

    def _score_too_big(self, tokens: int) -> str:
        cfg = self.scheduler.config
        msg = f"KV cache too small to score {tokens} tokens at once ({cfg.num_blocks * cfg.block_size} tokens"
        if cfg.window is not None:  # every prompt is one step: its window layers hold all of it too
            msg += (f"; the sliding-window layers' pool holds {(cfg.num_window_blocks - 1) * cfg.block_size}: "
                    f"score fewer or shorter prompts per call")
        return msg + ")"

    def expert_stats(self, block: bool = True) -> dict:
        """Expert-cache counters (offload: hits, misses, prefetch_hits, bytes_h2d, h2d_seconds,
        stall_seconds, per_layer_hit_rate, ...); resident: the slot count only. block=False: the
        link times leave out copies still in flight rather than wait for them."""
        backend = self.runner.experts
        if hasattr(backend, "stats"):
            return backend.stats(block)
        return {"slots": self.plan.expert_slots, "resident": True}

    def stats(self, block: bool = True) -> dict:
        """Engine, KV, expert-cache and memory counters; block as in `expert_stats`."""
        return {
            "steps": self.num_steps,
            "generated_tokens": self.num_generated,
            "slow_steps": self.slow_steps,  # over SLOW_STEP_S (1 s), each logged with its shape
            "slowest_step": self.slowest_step,
            "max_model_len": self.max_model_len,
            "kv_cache_tokens": (self.scheduler.config.num_blocks - self.scheduler.pool.num_withdrawn)
            * self.scheduler.config.block_size,
            "cuda_graphs": self.runner.graphs is not None,
            "cuda_graph_mode": self.runner.graph_mode(),
            # auto's link reads on trial against the copy path (engine/segment_graphs.py), or None
            "link_trial": self.runner.link_trial(),
            "device": str(self.device),
            "expert_bytes": self.expert_bytes,
            "moe_strategy": self.plan.strategy,
            "prefill_mode": "layer" if self.plan.prefill_job_tokens else "chunk",
            "prefill_jobs": dict(self.prefill_jobs),
            "experts": self.expert_stats(block),
            "memory_split": self.split.snapshot() if self.split is not None else {},  # memory_split() has more
            **self.memory_stats(),
            **self.scheduler.stats(),
        }

    def memory_usage(self) -> dict[str, int]:
        """Bytes by use: weights other than routed experts on the device, routed experts on the device
        (all of them when resident, the cache slots when offloading), KV cache; experts in host RAM."""
        model = self.runner.model
        # a token-embedding table kept in host RAM (offloaded plans) is not device memory
        weights = sum(p.numel() * p.element_size() for p in model.parameters() if p.device.type == self.device.type)
        own = [a for a in model.attention_layers() if self.split is None or a.window_pool]  # not in the region
        kv = sum(t.numel() * t.element_size() for attn in own for t in (attn.k_cache, attn.v_cache)
                 if isinstance(t, torch.Tensor))
        experts = self.expert_stats()
        total = int(self.expert_bytes)
        on_device = int(experts["slots"] * experts["slot_bytes"]) if "slot_bytes" in experts else total
        if self.split is not None:  # the shared region's pages, by their current owner
            page = self.plan.pages.page_bytes
            kv, on_device = kv + self.split.kv_pages * page, self.split.expert_pages * page
        return {"weights": weights, "experts": on_device, "kv_cache": kv,
                "experts_host": total if on_device != total else 0}

    def memory_stats(self) -> dict:
        """On CUDA, the plan's device budget and activation headroom against the peaks the caching
        allocator saw (`reserved` is what the budget caps), in bytes; {} elsewhere."""
        if self.device.type != "cuda":
            return {}
        return {"memory_peaks": {"plan_total": self.plan.total_bytes, "plan_activations": self.plan.activation_bytes,
                           "peak_allocated": torch.cuda.max_memory_allocated(self.device),
                           "peak_reserved": torch.cuda.max_memory_reserved(self.device)}}


def _metrics(seq: Sequence) -> RequestMetrics:
    m = RequestMetrics(num_prompt_tokens=seq.num_prompt_tokens, num_output_tokens=seq.num_output_tokens,
                       num_cached_tokens=seq.num_cached_tokens)
    end = seq.finished_time or time.monotonic()
    m.total_s = end - seq.arrival_time
    if seq.first_scheduled_time is not None:
        m.queue_s = seq.first_scheduled_time - seq.arrival_time
    if seq.first_token_time is not None:
        m.ttft_s = seq.first_token_time - seq.arrival_time
        after = end - seq.first_token_time
        if seq.num_output_tokens > 1 and after > 0:
            m.decode_tokens_per_s = (seq.num_output_tokens - 1) / after
    return m

