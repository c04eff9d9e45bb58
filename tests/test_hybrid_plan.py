"""The memory plan of a hybrid model: KV in its attention layers only, the state pool on the device,
the prefix checkpoints in host RAM."""

from __future__ import annotations

import torch

from ferryman.config import GiB
from ferryman.kvcache.state_checkpoints import CHECKPOINTS_PER_SEQ
from ferryman.planner import PlanRequest, kv_bytes_per_token
from ferryman.planner_search import plan_memory
from tiny_models import preset_config


def test_qwen3_next_plan_counts_the_state_pool() -> None:
    cfg = preset_config("qwen3-next-80b-a3b")
    assert cfg.num_attention_layers == 12  # 48 layers, every 4th full attention
    # per sequence and linear layer: conv [8192, 3] bf16 + recurrent [32, 128, 128] fp32
    per_seq = 36 * (8192 * 3 * 2 + 32 * 128 * 128 * 4)
    req = PlanRequest(cfg, torch.bfloat16, 16 * GiB, max_model_len=8192, max_num_seqs=4)
    plan = plan_memory(req)
    assert req.kv_per_token == kv_bytes_per_token(cfg, torch.bfloat16) == 12 * 2 * 2 * 256 * 2
    assert plan.state_bytes == 4 * per_seq and plan.checkpoint_host_bytes == CHECKPOINTS_PER_SEQ * plan.state_bytes == 6 * plan.state_bytes
    assert plan.strategy == "offload" and plan.total_bytes <= 16 * GiB
    # the state's bytes come out of the expert cache: what is left is less than one slot
    assert 0 <= 16 * GiB - plan.total_bytes < plan.slot_bytes
