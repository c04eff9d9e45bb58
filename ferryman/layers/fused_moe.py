"""Routed-expert computation of one MoE layer: `fused_moe(fmt, banks, x, topk_ids, topk_w, act)`.

    out[t] = sum_k topk_w[t, k] * expert_{topk_ids[t, k]}(x[t])
    expert(x) = act(x @ W13^T + b13) @ W2^T + b2

`topk_ids` are slot ids into the banks (the caller maps expert ids to slots). Backends:
- torch reference (CPU, or CUDA prefill with FERRYMAN_MOE_PREFILL=reference): experts one at a
  time, ascending id, each dequantised alone and dropped after use; the order of casts follows
  transformers' GptOssExperts / Qwen3MoeExperts (compute in x.dtype, product with the weight, then
  index_add).
- Triton decode (CUDA, T*K <= DECODE_MAX_PAIRS): ferryman/layers/fused_moe_triton.py.
- groups of experts through padded torch.bmm, the CUDA prefill path of quantised experts
  (ferryman/layers/batched_moe.py: 8 experts per group, the reference's per-token order).
- Triton grouped GEMM, the CUDA prefill path of unquantised (dense) experts
  (ferryman/layers/grouped_moe_triton.py: two launches per layer). FERRYMAN_MOE_PREFILL=
  auto|batched|grouped|reference picks (prefill_path).
FERRYMAN_MOE_BACKEND=torch|triton|auto (default auto) overrides the choice.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.nn.functional as F

from ferryman.quant import Banks, ExpertFormat, get_format

Upload = Callable[[torch.Tensor], torch.Tensor]  # a small host tensor -> the same on the device

DECODE_MAX_PAIRS = 64  # above this many (token, k) pairs the per-pair GEMV rereads too much
TRITON_FORMATS = ("dense", "mxfp4")


@dataclass(frozen=True)
class MoEActivation:
    """silu: gate = first I rows of w13, up = last I, out = silu(gate) * up.
    swiglu_oai (gpt-oss): gate = even rows, up = odd rows, gate <= limit, |up| <= limit,
    out = (up + 1) * gate * sigmoid(alpha * gate)."""

    kind: str = "silu"
    alpha: float = 1.702
    limit: float = 7.0

    def __post_init__(self) -> None:
        if self.kind not in ("silu", "swiglu_oai"):
            raise ValueError(f"MoEActivation.kind must be 'silu' or 'swiglu_oai', got {self.kind!r}")


def apply_activation(gate_up: torch.Tensor, act: MoEActivation) -> torch.Tensor:
    """gate_up: [n, 2I] -> [n, I], op for op as transformers does it."""
    if act.kind == "silu":
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up
    gate, up = gate_up[..., ::2], gate_up[..., 1::2]
    gate = gate.clamp(min=None, max=act.limit)
    up = up.clamp(min=-act.limit, max=act.limit)
    return (up + 1) * (gate * torch.sigmoid(gate * act.alpha))


def _check_inputs(x: torch.Tensor, topk_ids: torch.Tensor, topk_w: torch.Tensor, hidden: int) -> None:
    if x.dim() != 2 or x.shape[1] != hidden or not x.is_floating_point():
        raise ValueError(f"fused_moe: x must be a float [T, {hidden}] tensor, got {tuple(x.shape)} {x.dtype}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"fused_moe: topk_ids must be [T={x.shape[0]}, K], got {tuple(topk_ids.shape)}")
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"fused_moe: topk_ids must be int32/int64, got {topk_ids.dtype}")
    if topk_w.shape != topk_ids.shape or not topk_w.is_floating_point():
        raise ValueError(
            f"fused_moe: topk_w must be float {tuple(topk_ids.shape)}, got {tuple(topk_w.shape)} {topk_w.dtype}"
        )
    if topk_ids.device != x.device or topk_w.device != x.device:
        raise ValueError(f"fused_moe: x, topk_ids, topk_w on different devices ({x.device}, "
                         f"{topk_ids.device}, {topk_w.device})")


@lru_cache(maxsize=1)
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _backend() -> str:
    from ferryman.envs import envs

    return envs.MOE_BACKEND  # FERRYMAN_MOE_BACKEND, checked against auto|torch|triton


def _use_triton(fmt: str, x: torch.Tensor, pairs: int) -> bool:
    backend = _backend()
    if backend == "torch" or not x.is_cuda or fmt not in TRITON_FORMATS:
        return False
    if not triton_available():
        if backend == "triton":
            raise ValueError("FERRYMAN_MOE_BACKEND=triton but triton is not importable")
        return False
    return backend == "triton" or pairs <= DECODE_MAX_PAIRS


# Formats whose experts the grouped GEMM reads as they are (nothing to decode in its tiles). For
# them FERRYMAN_MOE_PREFILL=auto takes the grouped kernel: one qwen3-30b-a3b layer (bf16, 128
# experts, top-8) ran 3.2-4.4x faster than the batched path up to 1024 tokens and 1.2x at 4096,
# where the batched path spends its time on 16 groups' launches and a read of the routing. MXFP4
# keeps the batched path: decoding inside the grouped kernel's tiles was 1.2-19x slower there
# (benchmarks/bench_prefill_moe.py, docs/benchmarks.md, session 17).
GROUPED_BY_DEFAULT = ("dense",)


def prefill_path(fmt: str) -> str:
    """The CUDA prefill path that experts in format `fmt` take: FERRYMAN_MOE_PREFILL with auto
    resolved, and grouped falling back to batched where the grouped kernel cannot run (a format it
    has no kernel for, no Triton, FERRYMAN_MOE_BACKEND=torch). The planner counts this path's
    memory (planner._dequantised_experts)."""
    from ferryman.envs import envs

    path = envs.MOE_PREFILL
    if path == "auto":
        path = "grouped" if fmt in GROUPED_BY_DEFAULT else "batched"
    if path == "grouped" and (fmt not in TRITON_FORMATS or _backend() == "torch" or not triton_available()):
        path = "batched"
    return path


def _use_grouped(fmt: str, x: torch.Tensor) -> bool:
    """Prefill-sized batches through the grouped GEMM."""
    return x.is_cuda and prefill_path(fmt) == "grouped"


def _use_batched(fmt: str, x: torch.Tensor) -> bool:
    """Prefill-sized batches in groups of experts."""
    return x.is_cuda and prefill_path(fmt) == "batched"


def fused_moe(
    fmt: str,
    banks: Banks,
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_w: torch.Tensor,
    act: MoEActivation,
    host_ids: torch.Tensor | None = None,
    inputs_issued: Callable[[], None] | None = None,
    upload: Upload | None = None,
) -> torch.Tensor:
    """x [T, H], topk_ids [T, K] slot ids, topk_w [T, K] -> [T, H] in x.dtype. host_ids: the same
    slot ids on the host when the caller has them (offloaded experts): the prefill paths then
    group the pairs without reading the ids back from the device (no sync). inputs_issued: called
    exactly once, as soon as every host -> device copy the kernels need is issued; the batched
    prefill path calls it before its many launches, the others once their kernels are issued.
    upload: moves the prefill paths' small host-built inputs to the device (default: an async copy
    on the current stream; offloaded prefill puts them on the expert copy stream, experts/transfer.py)."""
    called = [False]

    def once() -> None:
        if inputs_issued is not None and not called[0]:
            called[0] = True
            inputs_issued()

    out = _dispatch(fmt, banks, x, topk_ids, topk_w, act, host_ids, once, upload)
    once()  # the paths that do not call it early
    return out


def _dispatch(fmt: str, banks: Banks, x: torch.Tensor, topk_ids: torch.Tensor, topk_w: torch.Tensor,
              act: MoEActivation, host_ids: torch.Tensor | None,
              inputs_issued: Callable[[], None], upload: Upload | None) -> torch.Tensor:
    form = get_format(fmt)
    num_slots, hidden, _ = form.dims(banks)
    _check_inputs(x, topk_ids, topk_w, hidden)
    if _use_triton(fmt, x, topk_ids.numel()):
        from ferryman.layers.fused_moe_triton import fused_moe_decode

        return fused_moe_decode(fmt, banks, x, topk_ids, topk_w, act.kind, act.alpha, act.limit)
    if _use_grouped(fmt, x):
        from ferryman.layers.grouped_moe_triton import grouped_moe

        return grouped_moe(fmt, banks, x, topk_ids, topk_w, act, path="grouped")
    if _use_batched(fmt, x):
        from ferryman.layers.batched_moe import fused_moe_batched

        return fused_moe_batched(form, banks, x, topk_ids, topk_w, act, host_ids=host_ids,
                                 inputs_issued=inputs_issued, upload=upload)
    if _cpu_kernel(form, x):  # MXFP4 on the CPU: the layer in one call of the C kernel, in fp32
        from ferryman.quant.mxfp4_cpu import LayerJob, pairs_of

        _check_slot_range(topk_ids.reshape(-1), num_slots)
        return LayerJob(x, banks, 0, pairs_of(topk_ids, topk_w), act.kind, act.alpha, act.limit).run().to(x.dtype)
    if not x.is_cuda and _gather_pays(form, banks, topk_ids, x):
        return fused_moe_gathered(form, banks, x, topk_ids, topk_w, act)
    return fused_moe_reference(form, banks, x, topk_ids, topk_w, act, host_ids=host_ids)


# CPU decode: dequantise the few experts a step uses into one batch and run two bmm calls,
# instead of a Python loop of small matmuls. Bounded so big experts (gpt-oss) keep the loop.
GATHER_MAX_BYTES = 64 << 20
# ... and only while each expert it touches is gathered at most this many times on average (by
# the compute dtype): the gathered path copies an expert's weights once per (token, expert) pair,
# the loop once. Crossovers on the dev VM (2 cores, demo-model layer, benchmarks/bench_cpu_moe.py):
# fp32 between 1.5 pairs per expert (even) and 2.5 (the loop 1.2-1.35x faster); bf16, whose small
# matmuls in the loop cost more, between 4 (gathered 1.4x faster) and 8 (the loop 1.25x faster).
# End to end, a bf16 bound of 6 gave slower prompts than 4, and a bound of 2 cost 16-user CPU
# serving a quarter of its tokens/s; without a bound the demo model's 64-token prompt took 1.5-6x
# longer (docs/benchmarks.md, session 17).
GATHER_MAX_COPIES = {torch.float32: 2}
GATHER_MAX_COPIES_DEFAULT = 4  # bf16, fp16


def _gather_pays(form: ExpertFormat, banks: Banks, topk_ids: torch.Tensor, x: torch.Tensor) -> bool:
    pairs = topk_ids.numel()
    if _gathered_bytes(form, banks, pairs, x) > GATHER_MAX_BYTES:
        return False
    copies = GATHER_MAX_COPIES.get(x.dtype, GATHER_MAX_COPIES_DEFAULT)
    # a token's K experts are distinct, so up to `copies` tokens (decode steps) pass without counting
    return topk_ids.shape[0] <= copies or pairs <= copies * torch.unique(topk_ids).numel()


def _gathered_bytes(form: ExpertFormat, banks: Banks, pairs: int, x: torch.Tensor) -> int:
    _, hidden, inter = form.dims(banks)
    return pairs * 3 * hidden * inter * x.element_size()  # dequantised w13 + w2 of every pair


def fused_moe_gathered(
    form: ExpertFormat,
    banks: Banks,
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_w: torch.Tensor,
    act: MoEActivation,
) -> torch.Tensor:
    """Same math as the reference for few pairs: x [T, H] -> [T, H] in x.dtype.

    Expert outputs are summed per token in ascending slot order in x.dtype, the order in which
    the reference's (and transformers') index_add_ accumulates them."""
    T, K = topk_ids.shape
    num_slots, hidden, _ = form.dims(banks)
    flat = topk_ids.reshape(-1).long()  # [P]
    _check_slot_range(flat, num_slots)
    bias = form.has_bias(banks)
    xs = x.repeat_interleave(K, dim=0)  # [P, H]
    gate_up = _pair_matvecs(form, banks, "w13", flat, xs)  # [P, 2I]
    if bias:
        gate_up = gate_up + banks["w13_bias"][flat].to(x.dtype)
    h = apply_activation(gate_up, act)  # [P, I]
    y = _pair_matvecs(form, banks, "w2", flat, h)  # [P, H]
    if bias:
        y = y + banks["w2_bias"][flat].to(x.dtype)
    y = (y * topk_w.reshape(-1)[:, None]).to(x.dtype).view(T, K, hidden)
    return sum_in_slot_order(y, topk_ids)


def sum_in_slot_order(y: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """y [T, K, H] (pair t*K + k's weighted output, in the output dtype) -> [T, H]: each token's K
    terms added one by one in ascending slot order from zero, the order in which the reference's
    (and transformers') index_add_ accumulates them."""
    T, K, hidden = y.shape
    order = topk_ids.long().argsort(dim=1, stable=True)  # [T, K] ascending slot per token
    y = y.gather(1, order[:, :, None].expand(T, K, hidden))
    out = torch.zeros_like(y[:, 0])
    for k in range(K):
        out = out + y[:, k]
    return out


# Dense experts at least this large are multiplied in place (views of the bank, no gathered copy):
# for big experts the copy costs as much memory traffic as the product itself.
IN_PLACE_MIN_BYTES = 1 << 20


def _pair_matvecs(form: ExpertFormat, banks: Banks, proj: str, flat: torch.Tensor, vecs: torch.Tensor) -> torch.Tensor:
    """Row p: W_proj[flat[p]] @ vecs[p]. flat: [P] slots, vecs: [P, in] -> [P, out] in vecs.dtype."""
    bank = banks.get(proj)
    if bank is not None and bank.dtype == vecs.dtype and bank[0].numel() * bank.element_size() >= IN_PLACE_MIN_BYTES:
        return torch.stack([torch.mv(bank[e], v) for e, v in zip(flat.tolist(), vecs)])
    w = form.dequant(banks, proj, flat, vecs.dtype)  # [P, out, in], transient
    return torch.bmm(w, vecs[:, :, None])[..., 0]


def _cpu_kernel(form: ExpertFormat, x: torch.Tensor) -> bool:
    """MXFP4 experts on the CPU go through the C kernel when it is built (quant/mxfp4_cpu.py): it
    reads each weight once, where the torch path dequantises the expert first (~80x slower)."""
    if form.name != "mxfp4" or x.device.type != "cpu":
        return False
    from ferryman.quant.mxfp4_cpu import available

    return available()


def _project(form: ExpertFormat, banks: Banks, proj: str, slot: int, xs: torch.Tensor) -> torch.Tensor:
    """xs [n, in] @ W_proj[slot]^T -> [n, out] in xs.dtype, the weights dequantised for the call."""
    w = form.dequant(banks, proj, slice(slot, slot + 1), xs.dtype)[0]  # [out, in], transient
    return xs @ w.T


def _expert_forward(
    form: ExpertFormat, banks: Banks, slot: int, xs: torch.Tensor, act: MoEActivation
) -> torch.Tensor:
    """One expert on its tokens. slot: a host int (views of the banks: no gather, no device sync),
    xs: [n, H] -> [n, H] in xs.dtype."""
    bias = form.has_bias(banks)
    gate_up = _project(form, banks, "w13", slot, xs)  # [n, 2I]
    if bias:  # added after the matmul, not fused (HF: x @ W + b)
        gate_up = gate_up + banks["w13_bias"][slot].to(xs.dtype)
    h = apply_activation(gate_up, act)  # [n, I]
    y = _project(form, banks, "w2", slot, h)  # [n, H]
    if bias:
        y = y + banks["w2_bias"][slot].to(xs.dtype)
    return y


def to_device(device: torch.device) -> Upload:
    """The plain upload: an asynchronous copy on the current stream (of a fresh pageable tensor,
    which the driver stages at once)."""
    return lambda t: t.to(device, non_blocking=True)


def _group_by_slot(topk_ids: torch.Tensor, num_slots: int, host_ids: torch.Tensor | None = None,
                   upload: Upload | None = None) -> tuple[list[int], torch.Tensor, list[int]]:
    """(slots used, ascending, on the host; pair ids [P] sorted by slot, on topk_ids' device; pairs
    per used slot). From host_ids (the same ids on the host) with no device sync; else with one
    device -> host read for the slots and their counts together."""
    if host_ids is not None:
        if host_ids.shape != topk_ids.shape:
            raise ValueError(f"fused_moe: host_ids {tuple(host_ids.shape)} do not match topk_ids {tuple(topk_ids.shape)}")
        sorted_ids, order = torch.sort(host_ids.reshape(-1).long(), stable=True)
        slots, counts = torch.unique_consecutive(sorted_ids, return_counts=True)
        host_slots, host_counts = slots.tolist(), counts.tolist()
        order = (upload or to_device(topk_ids.device))(order)
    else:
        flat = topk_ids.reshape(-1).long()  # [P], pair p = t*K + k
        sorted_ids, order = torch.sort(flat, stable=True)
        slots, counts = torch.unique_consecutive(sorted_ids, return_counts=True)
        host_slots, host_counts = torch.stack((slots, counts)).tolist()
    if host_slots and (host_slots[0] < 0 or host_slots[-1] >= num_slots):
        raise ValueError(f"fused_moe: topk_ids out of range [0, {num_slots}): min {host_slots[0]}, "
                         f"max {host_slots[-1]}")
    return host_slots, order, host_counts


def _check_slot_range(ids: torch.Tensor, num_slots: int) -> None:
    """Every id in [0, num_slots), read back with one device -> host copy."""
    if ids.numel() == 0:
        return
    lo, hi = torch.stack((ids.min(), ids.max())).tolist()
    if lo < 0 or hi >= num_slots:
        raise ValueError(f"fused_moe: topk_ids out of range [0, {num_slots}): min {lo}, max {hi}")


def fused_moe_reference(
    form: ExpertFormat,
    banks: Banks,
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_w: torch.Tensor,
    act: MoEActivation,
    host_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Torch reference on any device. x [T, H] -> [T, H] in x.dtype."""
    num_slots, _, _ = form.dims(banks)
    k = topk_ids.shape[1]
    out = torch.zeros_like(x)  # [T, H]
    slots, order, counts = _group_by_slot(topk_ids, num_slots, host_ids)
    # pairs sorted by slot, gathered once: each expert then takes slices (views, no launches)
    tokens_sorted = order // k  # [P]
    w_sorted = topk_w.reshape(-1)[order]  # [P]
    x_sorted = x[tokens_sorted]  # [P, H]
    start = 0
    for u, n in enumerate(counts):
        part = slice(start, start + n)  # the pairs routed to this slot
        start += n
        y = _expert_forward(form, banks, slots[u], x_sorted[part], act)  # [n, H]
        # weight product in the promoted dtype (fp32 weights: one rounding, as HF with
        # weights already in x.dtype), then accumulate in x.dtype like HF's index_add_
        y = y * w_sorted[part, None]
        out.index_add_(0, tokens_sorted[part], y.to(x.dtype))
    return out
