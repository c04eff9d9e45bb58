"""The engine's wiring of the shared region: KV blocks and expert slots in one set of pages
(kvcache/shared_region.py), and the boundary between them that moves with the load
(engine/memory_split.py). A resident plan has neither: every function here then gives None.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ferryman.config import EngineConfig, ModelConfig
from ferryman.engine.memory_split import MemorySplit, SlotLender, SplitBounds
from ferryman.errors import ConfigError
from ferryman.kvcache.block_pool import BlockPool
from ferryman.kvcache.shared_region import SharedRegion
from ferryman.prefill_steps import step_tokens
from ferryman.planner import MemoryPlan


def shared_region(plan: MemoryPlan, kv_blocks: int, block_size: int, device: torch.device) -> SharedRegion | None:
    """The shared region of an offloaded plan: its expert slots plus pages for `kv_blocks` blocks."""
    geo = plan.pages
    if geo is None:
        return None
    kv_pages = geo.pages_for_tokens(kv_blocks * block_size, block_size)
    return SharedRegion(geo, plan.expert_slots + kv_pages, device)


def split_bounds(plan: MemoryPlan, ecfg: EngineConfig, cfg: ModelConfig) -> SplitBounds:
    """The split's starting bounds: the least and most expert slots, the free KV blocks kept."""
    r = plan.request
    # an asked expert_cache caps the cache; otherwise every expert may come to the device
    most = plan.expert_slots if r.expert_cache is not None else r.total_experts
    reserve, least = ecfg.kv_reserve_tokens, ecfg.min_expert_slots
    if least is None:  # two layers' experts: the layer computing and the next one streaming in
        least = max(r.slot_floor, 2 * cfg.num_experts)
    reserve_tokens = step_tokens(ecfg.max_num_batched_tokens) if reserve is None else reserve
    return SplitBounds(min(least, plan.expert_slots, most), most, -(-reserve_tokens // ecfg.block_size))


def make_split(plan: MemoryPlan, ecfg: EngineConfig, cfg: ModelConfig, region: SharedRegion | None,
               pool: BlockPool, cache: Callable[[], SlotLender]) -> MemorySplit | None:
    """The boundary over `region` between `pool`'s KV pages and the expert cache's slots
    (`cache` returns the current one); None without a region."""
    if region is None:
        return None
    floor = region.geometry.pages_for_tokens(plan.request.shared_floor_tokens, ecfg.block_size)
    return MemorySplit(pool, cache, region.num_pages, split_bounds(plan, ecfg, cfg), floor)


def split_report(split: MemorySplit, page_bytes: int, block_size: int, experts: dict,
                 num_preemptions: int) -> dict:
    """The split (KV pages vs expert slots, in use / free, bounds, moves) with the expert cache's
    hit rate and the link's GB/s from `experts` (the backend's stats), and the preemptions."""
    link = experts["bytes_h2d"] / experts["h2d_seconds"] / 1e9 if experts["h2d_seconds"] else 0.0
    return {"shared": True, **split.snapshot(), "page_bytes": page_bytes, "block_size": block_size,
            "region_bytes": split.num_pages * page_bytes, "expert_slots_filled": experts["slots_filled"],
            "hit_rate": experts["hit_rate"], "link_gbps": link, "num_preemptions": num_preemptions}


def set_split_bounds(split: MemorySplit | None, block_size: int, min_expert_slots: int | None,
                     max_expert_slots: int | None, kv_reserve_tokens: int | None) -> None:
    """Change the split's bounds live (between steps); ConfigError naming a bound out of range."""
    if split is None:
        raise ConfigError("memory bounds need offloaded experts (a region shared by KV and expert slots)")
    reserve = None if kv_reserve_tokens is None else -(-kv_reserve_tokens // block_size)
    try:
        split.set_bounds(min_expert_slots, max_expert_slots, reserve)
    except ValueError as e:
        raise ConfigError(str(e)) from None
