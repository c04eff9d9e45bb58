"""Routed-expert computation of one MoE layer: `fused_moe(fmt, banks, x, topk_ids, topk_w, act)`.

    out[t] = sum_k topk_w[t, k] * expert_{topk_ids[t, k]}(x[t])
    expert(x) = act(x @ W13^T + b13) @ W2^T + b2

`topk_ids` are slot ids into the banks (the caller maps expert ids to slots). This module picks
the path: on CUDA the Triton decode GEMVs (T*K <= DECODE_MAX_PAIRS, fused_moe_triton.py), else
`prefill_path`'s grouped GEMM (grouped_moe_triton.py) or padded batched GEMMs (batched_moe.py); on
the CPU the C kernel for MXFP4, dense, GGUF, int, fp8 and nvfp4 experts (quant/cpu_kernel.py), else
(others, or no C compiler) a gathered batch for few pairs of small experts, else the torch reference
(moe_reference.py). FERRYMAN_KERNELS: layers/backend.py.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ferryman.envs import envs
from ferryman.layers import backend
from ferryman.layers.batched_moe import fused_moe_batched
from ferryman.layers.moe_common import (HostBank, MoEActivation, Upload, check_inputs, check_slot_range,
                                        grouped_reads, to_device, triton_reads)
from ferryman.layers.moe_reference import fused_moe_gathered, fused_moe_reference
from ferryman.quant import Banks, ExpertFormat, get_format

__all__ = ["DECODE_MAX_PAIRS", "MoEActivation", "Upload", "fused_moe", "grouped_max_pairs", "prefill_path",
           "to_device"]

DECODE_MAX_PAIRS = 64  # above this many (token, k) pairs the per-pair GEMV rereads too much
# Packed experts: the grouped GEMM (decoding in its tiles, once per block of pairs of one expert) up to
# this many (token, k) pairs per format family, the batched path (each used expert dequantised once)
# above. MXFP4: gpt-oss-20b's crossover lies between 512 and 1024 tokens of top-4 (docs/benchmarks.md),
# about 64 pairs per expert of its 32. The others by benchmarks/bench_prefill_moe.py on the H200
# (docs/benchmarks.md, "packed formats"): the grouped GEMM wins up to 8,192 pairs for int4 and fp8 at
# qwen3-30b-a3b's shape (0.93 / 0.96 of batched; 1.5 / 1.6x slower at 16,384) and beyond 10,240 at
# qwen3-next's; nvfp4 crosses earlier at qwen3-30b-a3b's (0.69 at 4,096 pairs, 1.06 at 8,192).
GROUPED_MXFP4_MAX_PAIRS = 2048
GROUPED_INT_MAX_PAIRS = 8192  # int4 / int8 (quant/intq.py)
GROUPED_FP8_MAX_PAIRS = 8192  # fp8 blocks and channels (quant/fp8.py)
GROUPED_NVFP4_MAX_PAIRS = 6144  # nvfp4, nvfp4-ct (quant/nvfp4.py)
# GGUF blocks have no entry: the grouped GEMM does not read them (moe_common.grouped_reads)
_GROUPED_MAX_PAIRS = {"mxfp4": GROUPED_MXFP4_MAX_PAIRS, "int4": GROUPED_INT_MAX_PAIRS, "int8": GROUPED_INT_MAX_PAIRS,
                      "fp8": GROUPED_FP8_MAX_PAIRS, "nvfp4": GROUPED_NVFP4_MAX_PAIRS,
                      "nvfp4-ct": GROUPED_NVFP4_MAX_PAIRS}


def grouped_max_pairs(fmt: str) -> int | None:
    """The most (token, k) pairs `prefill_path` sends through the grouped GEMM for experts of format
    `fmt`: None for unquantised experts (any batch), 0 where the grouped GEMM does not read them."""
    if fmt == "dense":
        return None
    if not grouped_reads(fmt):
        return 0
    return _GROUPED_MAX_PAIRS.get(fmt.partition(":")[0], 0)


def prefill_path(fmt: str, pairs: int | None = None, kernels: str | None = None) -> str:
    """The CUDA path of a batch too large for the decode kernel: "grouped" for unquantised experts
    and packed ones the grouped GEMM reads up to their family's GROUPED_*_MAX_PAIRS (token, k) pairs,
    else "batched", as for every batch of the formats it does not read (GGUF) and wherever the grouped
    kernel cannot run (no Triton, FERRYMAN_KERNELS=torch). pairs None: the path of the largest batches.
    kernels: a FERRYMAN_KERNELS value to decide for (default: the process's)."""
    if (envs.KERNELS if kernels is None else kernels) == "torch" or not backend.triton_available():
        return "batched"
    limit = grouped_max_pairs(fmt)  # 0: the grouped GEMM does not read fmt, not even an empty batch
    if limit is None or (pairs is not None and 0 < limit and pairs <= limit):
        return "grouped"
    return "batched"


def fused_moe(fmt: str, banks: Banks, x: torch.Tensor, topk_ids: torch.Tensor, topk_w: torch.Tensor,
              act: MoEActivation, host_ids: torch.Tensor | None = None,
              inputs_issued: Callable[[], None] | None = None, upload: Upload | None = None,
              host: HostBank | None = None) -> torch.Tensor:
    """x [T, H], topk_ids [T, K] slot ids, topk_w [T, K] -> [T, H] in x.dtype. host_ids: the same
    ids on the host, if the caller has them: the batched path then groups the pairs with no device
    sync. inputs_issued: called exactly once, as soon as every host -> device copy the kernels need
    is issued (the batched path: before its many launches). upload: how the batched path's small
    host-built inputs reach the device (default: an async copy on the current stream). host: the
    layer's host bank; an id -1 - e then names its expert e (link-read decode, experts/link_table.py)."""
    form = get_format(fmt)
    num_slots, hidden, _ = form.dims(banks)
    check_inputs(x, topk_ids, topk_w, hidden)
    decode_kernel = triton_reads(fmt) and backend.moe_triton(x, topk_ids.numel() <= DECODE_MAX_PAIRS)
    if host is not None and not decode_kernel:  # no kernel reads the host bank: one bank of both
        ids = torch.where(topk_ids >= 0, topk_ids, num_slots - 1 - topk_ids)  # host expert e: num_slots + e
        both = {n: torch.cat([banks[n], host.banks[n].to(banks[n].device)]) for n in banks}
        return fused_moe(fmt, both, x, ids, topk_w, act, inputs_issued=inputs_issued, upload=upload)
    if decode_kernel:
        from ferryman.layers.fused_moe_triton import fused_moe_decode

        out = fused_moe_decode(fmt, banks, x, topk_ids, topk_w, act.kind, act.alpha, act.limit,
                               host=None if host is None else host.tables)
    elif x.is_cuda and prefill_path(fmt, topk_ids.numel()) == "grouped":
        from ferryman.layers.grouped_moe_triton import grouped_moe

        out = grouped_moe(fmt, banks, x, topk_ids, topk_w, act)
    elif x.is_cuda:  # calls inputs_issued itself, before its launches
        return fused_moe_batched(form, banks, x, topk_ids, topk_w, act, host_ids=host_ids,
                                 inputs_issued=inputs_issued, upload=upload)
    else:
        out = _cpu_paths(form, banks, x, topk_ids, topk_w, act, host_ids, num_slots)
    if inputs_issued is not None:
        inputs_issued()
    return out


def _cpu_paths(form: ExpertFormat, banks: Banks, x: torch.Tensor, topk_ids: torch.Tensor, topk_w: torch.Tensor,
               act: MoEActivation, host_ids: torch.Tensor | None, num_slots: int) -> torch.Tensor:
    if _cpu_kernel(form, banks, x):  # the layer in one call of the C kernel, in fp32
        from ferryman.quant.cpu_kernel import pairs_of
        from ferryman.quant.cpu_layer import LayerJob

        check_slot_range(topk_ids.reshape(-1), num_slots)
        return LayerJob(x, banks, 0, pairs_of(topk_ids, topk_w), act.kind, act.alpha, act.limit,
                        fmt=form.name).run().to(x.dtype)
    if gather_pays(form, banks, topk_ids, x):
        return fused_moe_gathered(form, banks, x, topk_ids, topk_w, act)
    return fused_moe_reference(form, banks, x, topk_ids, topk_w, act, host_ids=host_ids)


# CPU decode: the few experts a step uses dequantised into one batch (two bmm calls) instead of a
# loop of small matmuls, while the batch stays small (big experts, gpt-oss, keep the loop) and each
# expert is copied at most this many times on average (once per pair, where the loop reads it
# once); bf16's small matmuls cost more than fp32's, so it gathers longer (benchmarks/bench_cpu_moe.py)
GATHER_MAX_BYTES = 64 << 20
GATHER_MAX_COPIES = {torch.float32: 2}
GATHER_MAX_COPIES_DEFAULT = 4  # bf16, fp16


def gather_pays(form: ExpertFormat, banks: Banks, topk_ids: torch.Tensor, x: torch.Tensor) -> bool:
    _, hidden, inter = form.dims(banks)
    pairs = topk_ids.numel()
    if pairs * 3 * hidden * inter * x.element_size() > GATHER_MAX_BYTES:  # dequantised w13 + w2 of every pair
        return False
    copies = GATHER_MAX_COPIES.get(x.dtype, GATHER_MAX_COPIES_DEFAULT)
    # a token's K experts are distinct, so up to `copies` tokens (decode steps) pass without counting
    return topk_ids.shape[0] <= copies or pairs <= copies * torch.unique(topk_ids).numel()


def _cpu_kernel(form: ExpertFormat, banks: Banks, x: torch.Tensor) -> bool:
    """Whether experts on the CPU go through the C kernel (quant/cpu_layer.kernel_reads says which
    formats): it reads each weight once and computes in fp32, where the torch paths dequantise each
    expert first (docs/benchmarks.md, "CPU MoE")."""
    if x.device.type != "cpu":
        return False
    from ferryman.quant.cpu_layer import kernel_reads

    return kernel_reads(form.name, banks)
