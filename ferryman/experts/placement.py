"""Where the routed experts live, decided once from the memory plan.

    resident: `ExpertStore` on the device, expert id == slot (`ResidentExperts`), any format
    offload:  `HostExpertStore` in pinned host memory + `ExpertCache` slots on the device
              (`OffloadExperts`), the CPU standing in for the device on machines without one

The strategies (`moe_strategy`) on top of the offloaded store:
    offload   misses copied over the link
    hybrid    misses split between the link and the CPU per layer step (experts/hybrid.py)
    cpu       every layer's experts computed on the CPU
    layers:N  the first N MoE layers' experts computed on the CPU, the others' all in slots
    auto      resident when every expert fits, else the split when the measured rates say it pays
              (and falls back to offload when it runs below its prediction)
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from ferryman.config import EngineConfig, ModelConfig, kv_dtype, parse_bytes, parse_expert_cache, parse_strategy
from ferryman.envs import envs
from ferryman.errors import ConfigError
from ferryman.experts.host_store import HostExpertStore
from ferryman.experts.store import ExpertStore
from ferryman.layers.backend import triton_available
from ferryman.layers.fused_moe import MoEActivation
from ferryman.planner import MemoryPlan, PlanRequest
from ferryman.planner_search import AUTO_NUM_SEQS, plan_auto_seqs, plan_memory

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
                      min_expert_slots=ecfg.min_expert_slots, prefill_mode=ecfg.prefill_mode,
                      decode_misses=ecfg.decode_misses)
    plan = plan_memory(req) if ecfg.max_num_seqs is not None else plan_auto_seqs(req)
    _ = plan.decode_misses  # ConfigError now for link reads the plan cannot run
    return plan


def enforce_budget(ecfg: EngineConfig, device: torch.device) -> None:
    """Cap what this process may allocate on a CUDA device at gpu_memory (the whole device when
    none is given; no-op elsewhere), with expandable segments on so the cap is not spent on
    fragmentation."""
    if device.type != "cuda":
        return
    expandable_segments()
    total = torch.cuda.get_device_properties(device).total_memory
    budget = total if ecfg.offload.gpu_memory is None else parse_bytes(ecfg.offload.gpu_memory)
    if budget > total:
        raise ConfigError(f"gpu_memory {budget / 2**30:.2f} GiB exceeds the device's {total / 2**30:.2f} GiB")
    index = device.index if device.index is not None else torch.cuda.current_device()
    # set each time, also to the whole device: the cap is per process and an engine built earlier in
    # it (another LLM, a test) may have left a smaller one
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
        return ResidentExperts(store, act)
    if plan is None:
        raise ValueError("a host expert store needs a memory plan (its slot count)")
    rows = options.get("rows")  # a shared region: every page has a slot id, plan.expert_slots active
    return offload_backend(store, model, device, plan.expert_slots if rows is None else rows.shape[0], act,
                           cpu_layers=plan.cpu_layers, **options)


def offload_backend(store: HostExpertStore, model: torch.nn.Module, device: torch.device, slots: int,
                    act: MoEActivation, policy: str | None = None,
                    prefetch: bool = True, strategy: str = "offload", calibration: str | None = None,
                    cpu_thread: bool | None = None, decode_prefetch: bool = True, cpu_layers: int = 0,
                    rows: torch.Tensor | None = None, active: list[int] | None = None) -> Any:
    """policy: lru | lrfu (default policies.DEFAULT_POLICY); prefetch: next-layer guesses and prefill streaming;
    decode_prefetch: guesses acted on in decode steps too (OffloadConfig.decode_prefetch);
    strategy: the moe_strategy (module docstring); hybrid and auto split misses with the CPU
    (experts/hybrid.py) by rates from the `calibration` file (default: the model's file in
    ~/.cache/ferryman) or measured at start; cpu_layers: the first MoE layers computed on the CPU
    (the plan's, for cpu and layers); cpu_thread: the CPU part in a worker thread (default: on CUDA);
    rows, active: the slot rows of a region shared with the KV cache and the slot ids the cache holds
    at first (kvcache/shared_region.py)."""
    from ferryman.experts.gpu_cache import ExpertCache
    from ferryman.experts.guesses import NextLayerGuesser
    from ferryman.experts.hybrid import make_hybrid
    from ferryman.experts.offload import OffloadExperts
    from ferryman.experts.policies import make_policy

    cache = ExpertCache(store, slots, device, make_policy(policy) if policy else make_policy(), rows=rows, active=active)
    gates = {block.layer: block.gate.choice_scores for block in model.moe_blocks()}
    name = parse_strategy(strategy)[0]
    split = {"hybrid": "on", "auto": "auto"}.get(name, "off")
    hybrid = make_hybrid(split, cache, act, calibration)  # before any expert is cached
    on_cpu = frozenset(store.cfg.moe_layers[:cpu_layers])
    guesser = None
    if prefetch and len(on_cpu) < len(store.cfg.moe_layers):  # the CPU's layers are never guessed for
        guesser = NextLayerGuesser({k: v for k, v in gates.items() if k not in on_cpu}, store.cfg.top_k,
                                   decode=decode_prefetch)
    return OffloadExperts(cache, act, guesser, hybrid, cpu_thread, on_cpu)
