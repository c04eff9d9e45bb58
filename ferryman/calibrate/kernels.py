"""Each CPU expert kernel's rate beside the host read bandwidth: what `ferryman bench bw --json`
reports under "cpu_kernels" (no GPU needed).

For every format the C kernel covers (quant/cpu_kernel.py KERNEL_FORMATS, and GGUF q8_0 / q4_k / q6_k
int4, fp8 and nvfp4 where the model's dims allow them) and each token count, a
layer job of top_k experts of the model's shape (`LayerJob`, the hybrid's and the cpu strategy's
path) cycles through a pool of random experts larger than the CPU caches, as misses do; the rate
is the median of `reps` jobs, in experts/s and GB/s of the format's bytes, and as a share of the
host read bandwidth measured in the same run.
"""

from __future__ import annotations

from typing import Any

import torch

from ferryman.calibrate.bandwidth import ExpertCycle
from ferryman.calibrate.timing import median_seconds
from ferryman.config import ModelConfig
from ferryman.layers.fused_moe import MoEActivation
from ferryman.quant import cpu_kernel
from ferryman.quant.base import get_format
from ferryman.quant.cpu_layer import LayerJob

KERNEL_TOKENS = (1, 8, 32)  # tokens per expert measured
# (label, format, bank dtype) of each kernel; MXFP4's banks are uint8 whatever the model dtype
KERNELS = (("mxfp4", "mxfp4", torch.bfloat16), ("bf16", "dense", torch.bfloat16),
           ("fp16", "dense", torch.float16), ("fp32", "dense", torch.float32),
           # packed formats, measured where the model's dims are whole blocks / groups of them
           ("q8_0", "gguf:q8_0:q8_0", torch.bfloat16), ("q4_k", "gguf:q4_k:q4_k", torch.bfloat16),
           ("q6_k", "gguf:q6_k:q6_k", torch.bfloat16), ("int4", "int4:g128:sym", torch.bfloat16),
           ("fp8", "fp8:128x128", torch.bfloat16), ("nvfp4", "nvfp4", torch.bfloat16))


def kernel_fits(fmt: str, hidden: int, inter: int) -> bool:
    """Whether experts of format `fmt` can have these dims (GGUF blocks, int groups)."""
    try:
        get_format(fmt).weight_specs(1, hidden, inter, torch.bfloat16)
    except ValueError:
        return False
    return True


def kernel_rates(cfg: ModelConfig, act: MoEActivation, read_gbps: float, reps: int, pool_bytes: int,
                 tokens: tuple[int, ...] = KERNEL_TOKENS) -> list[dict[str, Any]]:
    """One row per (kernel, tokens per expert): experts/s, GB/s and the share of `read_gbps`."""
    if not cpu_kernel.available():
        return []
    hidden, inter, k = cfg.hidden_size, cfg.moe_intermediate_size, cfg.top_k
    rows = []
    for label, fmt, dtype in KERNELS:
        if not kernel_fits(fmt, hidden, inter):
            continue
        form = get_format(fmt)
        eb = form.expert_bytes(hidden, inter, cfg.expert_bias, dtype)
        n = max(k + 1, -(-pool_bytes // eb))
        banks = form.random_banks(n, hidden, inter, cfg.expert_bias, dtype, torch.Generator().manual_seed(0))
        for t in tokens:
            seconds = _job_seconds(banks, fmt, k, t, act, reps, dtype)
            gbps = k * eb / seconds / 1e9
            rows.append({"kernel": label, "tokens": t, "experts_per_s": k / seconds, "gbps": gbps,
                         "of_host_read": gbps / read_gbps if read_gbps > 0 else None, "expert_bytes": eb})
        del banks
    return rows


def _job_seconds(banks: dict[str, torch.Tensor], fmt: str, k: int, tokens: int, act: MoEActivation,
                 reps: int, dtype: torch.dtype) -> float:
    """Median seconds of one layer job: `tokens` tokens (activations in `dtype`, as an engine of that
    dtype has them: bf16 x bf16 takes vdpbf16ps where the CPU has it) each routed to the same k
    distinct experts."""
    num = next(iter(banks.values())).shape[0]
    cycle = ExpertCycle(1, num, k)
    x = torch.randn(tokens, get_format(fmt).dims(banks)[1], generator=torch.Generator().manual_seed(1)).to(dtype)
    w = [1.0 / k] * tokens
    bias: dict = {}

    def rep() -> None:
        ids = cycle.next()[1]
        pairs = {e: (list(range(tokens)), w) for e in ids}
        LayerJob(x, banks, 0, pairs, act.kind, act.alpha, act.limit, bias, fmt).run()

    return median_seconds(rep, max(3, reps))[0]
