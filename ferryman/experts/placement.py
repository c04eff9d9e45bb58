"""Where the routed experts live, decided once from the memory plan.

    resident: `ExpertStore` on the device, expert id == slot (`ResidentExperts`), any format
    offload:  `HostExpertStore` in pinned host memory + `ExpertCache` slots on the device
              (`OffloadExperts`), the CPU standing in for the device on machines without one
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from ferryman.config import EngineConfig, ModelConfig, kv_dtype, parse_bytes, parse_expert_cache
from ferryman.envs import envs
from ferryman.errors import ConfigError
from ferryman.experts.host_store import HostExpertStore
from ferryman.experts.store import ExpertStore
from ferryman.layers.backend import triton_available
from ferryman.layers.fused_moe import MoEActivation
from ferryman.planner import (
    AUTO_NUM_SEQS,
    MemoryPlan,
    PlanRequest,
    plan_auto_seqs,
    plan_memory,
)

StoreFactory = Callable[[ModelConfig, torch.dtype, torch.device], ExpertStore]
log = logging.getLogger("ferryman.experts")


def device_budget(ecfg: EngineConfig, device: torch.device) -> int | None:
    """Bytes the plan may use on `device`: gpu_memory, else CUDA free memory x utilisation, else None."""
    if ecfg.offload.gpu_memory is not None:
        return parse_bytes(ecfg.offload.gpu_memory)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return int(free - total * (1 - ecfg.gpu_memory_utilization))
    return None


def engine_plan(ecfg: EngineConfig, cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
                max_model_len: int) -> MemoryPlan:
    """The memory plan; max_num_seqs None lets the planner pick the concurrency (`plan_auto_seqs`)."""
    off = ecfg.offload
    cache = parse_expert_cache(off.expert_cache) if off.expert_cache is not None else None
    kernels = envs.KERNELS if triton_available() else "torch"  # the machine's, resolved here: the plan is pure
    req = PlanRequest(cfg, dtype, device_budget(ecfg, device), max_model_len, ecfg.max_num_seqs or AUTO_NUM_SEQS[0],
                      ecfg.max_num_batched_tokens, ecfg.block_size, ecfg.kv_cache_tokens,
                      off.moe_strategy, cache, kv_dtype(ecfg.kv_cache_dtype, dtype, device), kernels,
                      ecfg.prefill_mode)
    return plan_memory(req) if ecfg.max_num_seqs is not None else plan_auto_seqs(req)


def enforce_budget(ecfg: EngineConfig, device: torch.device) -> None:
    """Cap what this process may allocate on a CUDA device at gpu_memory (no-op elsewhere), with
    expandable segments on so the cap is not spent on fragmentation."""
    if device.type != "cuda":
        return
    expandable_segments()
    if ecfg.offload.gpu_memory is None:
        return
    budget = parse_bytes(ecfg.offload.gpu_memory)
    total = torch.cuda.get_device_properties(device).total_memory
    if budget > total:
        raise ConfigError(f"gpu_memory {budget / 2**30:.2f} GiB exceeds the device's {total / 2**30:.2f} GiB")
    index = device.index if device.index is not None else torch.cuda.current_device()
    torch.cuda.set_per_process_memory_fraction(budget / total, index)


def expandable_segments() -> bool:
    """Turn on the CUDA caching allocator's expandable segments for segments made from now on,
    unless the user's own allocator settings name them (or another allocator). Returns whether
    this call turned them on."""
    import os
    import warnings

    user = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") + os.environ.get("PYTORCH_ALLOC_CONF", "")
    if "expandable_segments" in user or "cudaMallocAsync" in user:
        return False
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)  # torch >= 2.9
    try:
        with warnings.catch_warnings():  # older torch: the (later deprecated) cuda spelling
            warnings.simplefilter("ignore", FutureWarning)
            (setter or torch.cuda.memory._set_allocator_settings)("expandable_segments:True")
    except (RuntimeError, AttributeError) as e:  # an allocator without them: fragmentation costs slots
        log.warning("could not turn on the CUDA allocator's expandable segments (%s); the GPU budget may "
                    "lose some memory to fragmentation", e)
        return False
    return True


def store_factory(plan: MemoryPlan, device: torch.device) -> StoreFactory:
    if plan.strategy == "resident":
        return ExpertStore
    pin = device.type == "cuda"  # pinned memory needs a CUDA driver; on CPU the host is the device
    return lambda cfg, dtype, _device: HostExpertStore(cfg, dtype, pin=pin)


def make_backend(store: ExpertStore, model: torch.nn.Module, device: torch.device, plan: MemoryPlan | None,
                 act: MoEActivation, **options: Any) -> Any:
    """ResidentExperts for a device store, OffloadExperts (cache + next-layer guesses) for a host store
    with `plan.expert_slots` slots. options: see `offload_backend`."""
    from ferryman.experts.resident import ResidentExperts

    if not isinstance(store, HostExpertStore):
        if options.get("cpu_experts", "off") != "off":
            log.info("cpu_experts=%s has no effect: every expert is resident on the device", options["cpu_experts"])
        return ResidentExperts(store, act)
    if plan is None:
        raise ValueError("a host expert store needs a memory plan (its slot count)")
    return offload_backend(store, model, device, plan.expert_slots, act, **options)


def offload_backend(store: HostExpertStore, model: torch.nn.Module, device: torch.device, slots: int,
                    act: MoEActivation, policy: str | None = None,
                    prefetch: bool = True, cpu_experts: str = "off", calibration: str | None = None,
                    cpu_thread: bool | None = None, decode_prefetch: bool = True) -> Any:
    """policy: lru | lrfu (default policies.DEFAULT_POLICY); prefetch: next-layer guesses and prefill streaming;
    decode_prefetch: guesses acted on in decode steps too (OffloadConfig.decode_prefetch);
    cpu_experts: off | auto | on, misses computed on the CPU (experts/hybrid.py) with rates from the
    `calibration` file (default: the model's file in ~/.cache/ferryman) or measured at start;
    cpu_thread: the CPU part in a worker thread (default: on CUDA)."""
    from ferryman.experts.gpu_cache import ExpertCache
    from ferryman.experts.guesses import NextLayerGuesser
    from ferryman.experts.hybrid import make_hybrid
    from ferryman.experts.offload import OffloadExperts
    from ferryman.experts.policies import make_policy

    cache = ExpertCache(store, slots, device, make_policy(policy) if policy else make_policy())
    gates = {block.layer: block.gate.choice_scores for block in model.moe_blocks()}
    hybrid = make_hybrid(cpu_experts, cache, act, calibration)  # before any expert is cached
    guesser = NextLayerGuesser(gates, store.cfg.top_k, decode=decode_prefetch) if prefetch else None
    return OffloadExperts(cache, act, guesser, hybrid, cpu_thread)
