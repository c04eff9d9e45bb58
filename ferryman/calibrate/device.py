"""The device's compute rates for one model's experts: what `ferryman plan` predicts prefill with.

    moe      seconds of one MoE layer's routed experts for T tokens (T in MOE_TOKENS), the model's
             format and shape, tokens routed uniformly top_k over the layer's experts: the kernel a
             prefill chunk or a layer-major job's chunk runs (`fused_moe`: grouped GEMM or batched)
    matmul   flop/s of a [T, H] x [H, 4H] GEMM in the model's dtype: the attention projections and
             the dense layers of a prefill chunk

Measured by `ferryman bench bw` on a CUDA machine (a second or two) and kept in the calibration file;
nothing here is assumed. Between measured token counts the MoE time is interpolated linearly, past
the largest it grows with the slope of the last two (`moe_seconds`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ferryman.calibrate.calibration import DeviceCompute
from ferryman.calibrate.timing import median_seconds, sync
from ferryman.config import ModelConfig
from ferryman.layers.fused_moe import MoEActivation, fused_moe
from ferryman.quant.base import get_format

MOE_TOKENS = (64, 256, 512, 1024, 2048, 4096)  # tokens of the measured MoE layers (grouped and batched paths)
MATMUL_TOKENS = 4096
MAX_BANK_BYTES = 2 << 30  # the experts measured: the layer's, at most this many bytes of them


def _seconds(run: Callable[[], None], device: torch.device, reps: int) -> float:
    """Median seconds of `run` to the device's completion, after one warm-up run."""
    return median_seconds(lambda: (run(), sync(device)), max(1, reps))[0]


def measure_device_compute(cfg: ModelConfig, dtype: torch.dtype, act: MoEActivation, device: torch.device,
                           reps: int, tokens: tuple[int, ...] = MOE_TOKENS) -> DeviceCompute:
    """Time the MoE kernel on random banks of the layer's experts (as many as MAX_BANK_BYTES hold)
    and a GEMM, on `device`; each figure the median of `reps` runs after a warm-up."""
    gen = torch.Generator(device=device).manual_seed(0)  # everything is drawn on the device
    points = _moe_points(cfg, dtype, act, device, reps, tokens, gen)
    hidden = cfg.hidden_size
    a = torch.randn(MATMUL_TOKENS, hidden, generator=gen, device=device).to(dtype)  # [T, H]
    b = torch.randn(hidden, 4 * hidden, generator=gen, device=device).to(dtype)  # [H, 4H]
    seconds = _seconds(lambda: a @ b, device, reps)
    return DeviceCompute(points, 2.0 * MATMUL_TOKENS * hidden * 4 * hidden / seconds, cfg.num_experts)


def _moe_points(cfg: ModelConfig, dtype: torch.dtype, act: MoEActivation, device: torch.device, reps: int,
                tokens: tuple[int, ...], gen: torch.Generator) -> tuple[tuple[int, float], ...]:
    """(tokens, seconds) of `fused_moe` over the layer's experts, each token routed to top_k distinct ones."""
    form = get_format(cfg.expert_format)
    hidden, inter, k = cfg.hidden_size, cfg.moe_intermediate_size, cfg.top_k
    n = min(cfg.num_experts, max(k, MAX_BANK_BYTES // form.expert_bytes(hidden, inter, cfg.expert_bias, dtype)))
    banks = form.random_banks(n, hidden, inter, cfg.expert_bias, dtype, gen, device)
    points = []
    for t in tokens:
        x = torch.randn(t, hidden, generator=gen, device=device).to(dtype)  # [T, H]
        ids = torch.rand(t, n, generator=gen, device=device).topk(k, dim=-1).indices  # [T, K] distinct, int64
        host_ids, w = ids.cpu(), torch.full((t, k), 1.0 / k, device=device)  # the engine has the ids on the host
        run = lambda: fused_moe(cfg.expert_format, banks, x, ids, w, act, host_ids=host_ids)  # noqa: E731, B023
        points.append((t, _seconds(run, device, reps)))
    return tuple(points)
