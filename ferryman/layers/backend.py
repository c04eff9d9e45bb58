"""Which kernels run: FERRYMAN_KERNELS (auto|torch|triton, read once by envs; a bad value raises
ConfigError naming it), the escape hatch for the MoE and attention kernels.

auto: Triton for CUDA tensors when Triton imports, torch otherwise; torch: the torch paths;
triton: Triton wherever a kernel exists (attention on CPU tensors then needs TRITON_INTERPRET=1).
The small fused kernels (norms, RoPE, router) follow only `use_triton`: CUDA and Triton importable.
"""

from __future__ import annotations

import torch

from ferryman.envs import envs
from ferryman.quant.base import triton_available


def use_triton(x: torch.Tensor) -> bool:
    """The small fused kernels: CUDA tensors and Triton importable."""
    return x.is_cuda and triton_available()


def attention_triton(device: torch.device) -> bool:
    """Paged attention through Triton: auto on CUDA, or forced by FERRYMAN_KERNELS=triton."""
    return envs.KERNELS == "triton" or (envs.KERNELS == "auto" and device.type == "cuda")


def moe_triton(x: torch.Tensor, small: bool) -> bool:
    """The MoE decode kernel for x on CUDA: auto for `small` batches (few (token, k) pairs), any
    batch with FERRYMAN_KERNELS=triton, never with torch."""
    choice = envs.KERNELS
    if choice == "torch" or not x.is_cuda:
        return False
    if not triton_available():
        if choice == "triton":
            raise ValueError("FERRYMAN_KERNELS=triton but triton is not importable")
        return False
    return choice == "triton" or small


def moe_fused_act(x: torch.Tensor) -> bool:
    """The batched MoE path's fused bias and activation (moe_act_triton.bias_act): CUDA tensors,
    Triton importable, and not FERRYMAN_KERNELS=torch."""
    return use_triton(x) and envs.KERNELS != "torch"
