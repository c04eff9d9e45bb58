"""What every routed-expert path shares: the activation, input checks, the grouping of (token, k)
pairs by slot and the per-token sum in slot order."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from ferryman.quant import Banks
from ferryman.quant.intq import parse_name, quant_code

Upload = Callable[[torch.Tensor], torch.Tensor]  # a small host tensor -> the same on the device
# the expert formats the MoE Triton kernels read (fp8 blocks: any whose width is a power of two >= 16)
TRITON_FORMATS = ("dense", "mxfp4", "fp8:128x128", "fp8:channel", "nvfp4", "nvfp4-ct")
# and the parametrised families ("family:params", quant/base.py) the decode kernel reads:
# int4/int8 ("int4:g128:sym", quant/intq.py) and GGUF blocks ("gguf:q4_k:q6_k", quant/gguf.py)
INT_FAMILIES = ("int4", "int8")
TRITON_FAMILIES = (*INT_FAMILIES, "gguf")


def triton_reads(fmt: str) -> bool:
    """Whether the Triton decode kernel (layers/fused_moe_triton.py) reads experts of format `fmt`."""
    return fmt in TRITON_FORMATS or fmt.partition(":")[0] in TRITON_FAMILIES


def grouped_reads(fmt: str) -> bool:
    """Whether the Triton grouped prefill GEMM (layers/grouped_moe_triton.py) reads experts of format
    `fmt`: every format the decode kernel reads but GGUF blocks, and fp8 of any block shape. GGUF
    prefills take the batched path at every size: decoding them in the GEMM's tiles measured 1.1x to
    15x its time on the H200 (qwen3-30b-a3b and qwen3-next layers in Q4_K_M, 16 to 4096 tokens)."""
    family = fmt.partition(":")[0]
    return (triton_reads(fmt) and family != "gguf") or family == "fp8"


def to_device(device: torch.device) -> Upload:
    """The plain upload: an asynchronous copy on the current stream (of a fresh pageable tensor,
    which the driver stages at once)."""
    return lambda t: t.to(device, non_blocking=True)


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


@dataclass(frozen=True)
class KernelBank:
    """One projection's weights, scales (dense: the weights again, unread) and bias (or an unread
    stand-in, stride 0) as the Triton kernels take them, with their slot strides in elements. Each
    expert's slice is contiguous; experts may be any stride apart (the expert-major slot pool)."""

    w: torch.Tensor
    s: torch.Tensor
    b: torch.Tensor
    strides: tuple[int, int, int]
    has_bias: bool
    g: torch.Tensor | None = None  # nvfp4: global scales [slots, parts] (else the weights again, unread)
    g_stride: int = 0
    z: torch.Tensor | None = None  # int asym: zero points [slots, out, groups] (else the weights again, unread)
    z_stride: int = 0


def quant_params(fmt: str) -> dict[str, int]:
    """The decode kernels' QF / QA / QB constexprs of a format: 1 = fp8 (QA x QB blocks, QB 0 a
    scale per row), 2 = nvfp4 (QA 1: the global scale divides), 3 = int (QA: bits, zero points, group
    indices; QB the group size), 0 = dense or mxfp4."""
    family, _, param = fmt.partition(":")
    if family == "fp8":
        bn, bk = (1, 0) if param == "channel" else (int(v) for v in param.split("x"))
        return dict(QF=1, QA=bn, QB=bk)
    if family in ("nvfp4", "nvfp4-ct"):
        return dict(QF=2, QA=int(family == "nvfp4-ct"), QB=0)
    if family in INT_FAMILIES:  # QF 3: int (quant/intq_triton.py quant_code)
        p = parse_name(fmt)
        return quant_code(p.bits, p.group, not p.sym, p.act)
    return dict(QF=0, QA=0, QB=0)


def kernel_bank(fmt: str, banks: Banks, proj: str, stand_in: torch.Tensor) -> KernelBank:
    g = z = None
    if fmt == "mxfp4":
        w, s = banks[f"{proj}_blocks"], banks[f"{proj}_scales"]
    elif fmt.startswith("fp8:"):  # e4m3 bytes as uint8: the kernel decodes their bits
        w, s = banks[proj].view(torch.uint8), banks[f"{proj}_scale"]
    elif fmt.startswith("nvfp4"):
        w, s, g = banks[f"{proj}_packed"], banks[f"{proj}_scale"].view(torch.uint8), banks[f"{proj}_gscale"]
    elif fmt.startswith("gguf:"):  # one uint8 bank of blocks per projection
        w = s = banks[f"{proj}_q"]
    elif fmt.partition(":")[0] in INT_FAMILIES:  # int codes, scales, zeros (asym), group indices (act)
        w, s = banks[f"{proj}_qweight"], banks[f"{proj}_scales"]
        g, z = banks.get(f"{proj}_gidx"), banks.get(f"{proj}_zeros")
    else:
        w, s = banks[proj], banks[proj]
    has_bias = "w13_bias" in banks and "w2_bias" in banks
    b = banks[f"{proj}_bias"] if has_bias else stand_in
    for name, t in (("weights", w), ("scales", s), ("bias", b), ("global scales / group indices", g), ("zeros", z)):
        if t is not None and t is not stand_in and t.shape[0] > 0 and not t[0].is_contiguous():
            raise ValueError(f"{fmt} {proj} {name}: each expert's slice must be contiguous for the Triton kernels, "
                             f"got strides {tuple(t.stride())} for shape {tuple(t.shape)}")
    return KernelBank(w, s, b, (w.stride(0), s.stride(0), b.stride(0) if has_bias else 0), has_bias,
                      w if g is None else g, 0 if g is None else g.stride(0), w if z is None else z,
                      0 if z is None else z.stride(0))


# the tensors of a KernelBank in host_table's order
HOST_TABLE_PARTS = ("weights", "scales", "global scales / group indices", "zero points", "bias")


def host_table(dev: KernelBank, host: KernelBank) -> list[int]:
    """The 10 numbers the kernels' HOST mode reads (_expert): where each of the host bank's tensors
    (HOST_TABLE_PARTS) begins, in elements from the device bank's, then its expert stride in
    elements. Both banks hold the same format."""
    pairs = ((dev.w, host.w), (dev.s, host.s), (dev.g, host.g), (dev.z, host.z), (dev.b, host.b))
    deltas, strides = [], []
    for part, (d, h) in zip(HOST_TABLE_PARTS, pairs):
        if d is None or h is None or d.dtype != h.dtype:
            raise ValueError(f"host bank {part}: {None if h is None else h.dtype} beside the device bank's "
                             f"{None if d is None else d.dtype}")
        gap = h.data_ptr() - d.data_ptr()
        if gap % d.element_size():
            raise ValueError(f"host bank {part} begins {gap} bytes from the device bank's: not a whole number "
                             f"of {d.element_size()}-byte elements")
        deltas.append(gap // d.element_size())
        strides.append(h.stride(0) if h.dim() and h.shape[0] > 1 else 0)
        # the kernels assume 16-element multiples (16-byte vector loads); the expert-major rows of
        # quant/layout.py (64-byte aligned offsets and rows) keep them
        if deltas[-1] % 16 or strides[-1] % 16:
            raise ValueError(f"host bank {part}: offset {deltas[-1]} or expert stride {strides[-1]} elements "
                             "is not a multiple of 16 (expert-major rows keep both aligned)")
    return deltas + strides


def host_tables(fmt: str, banks: Banks, host: Banks, device: torch.device) -> torch.Tensor:
    """[2, 10] int64 on `device`: host_table of w13, then of w2, for `fused_moe_decode(host=)`. Built
    once per pair of banks (a CUDA graph replays the kernels with the same table); host: the layer's
    experts in host memory the GPU can read (pinned), in the format of `banks`."""
    stand_in = torch.empty(0, device=device)
    rows = [host_table(kernel_bank(fmt, banks, p, stand_in), kernel_bank(fmt, host, p, stand_in))
            for p in ("w13", "w2")]
    return torch.tensor(rows, dtype=torch.int64).to(device)


@dataclass(frozen=True)
class HostBank:
    """A layer's experts in host memory the GPU can read (pinned), for `fused_moe(host=)`: an id
    -1 - e names expert e of `banks` [E, ...]; `tables` [2, 10] int64 on the device: host_tables."""

    banks: Banks
    tables: torch.Tensor


def check_inputs(x: torch.Tensor, topk_ids: torch.Tensor, topk_w: torch.Tensor, hidden: int) -> None:
    if x.dim() != 2 or x.shape[1] != hidden or not x.is_floating_point():
        raise ValueError(f"fused_moe: x must be a float [T, {hidden}] tensor, got {tuple(x.shape)} {x.dtype}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"fused_moe: topk_ids must be [T={x.shape[0]}, K], got {tuple(topk_ids.shape)}")
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"fused_moe: topk_ids must be int32/int64, got {topk_ids.dtype}")
    if topk_w.shape != topk_ids.shape or not topk_w.is_floating_point():
        raise ValueError(f"fused_moe: topk_w must be float {tuple(topk_ids.shape)}, got {tuple(topk_w.shape)} "
                         f"{topk_w.dtype}")
    if topk_ids.device != x.device or topk_w.device != x.device:
        raise ValueError(f"fused_moe: x, topk_ids, topk_w on different devices ({x.device}, "
                         f"{topk_ids.device}, {topk_w.device})")


def check_slot_range(ids: torch.Tensor, num_slots: int) -> None:
    """Every id in [0, num_slots), read back with one device -> host copy."""
    if ids.numel() == 0:
        return
    lo, hi = torch.stack((ids.min(), ids.max())).tolist()
    if lo < 0 or hi >= num_slots:
        raise ValueError(f"fused_moe: topk_ids out of range [0, {num_slots}): min {lo}, max {hi}")


def check_host_ids(topk_ids: torch.Tensor, host_ids: torch.Tensor | None) -> None:
    """host_ids, when given, must be topk_ids' shape (the same ids, on the host)."""
    if host_ids is not None and host_ids.shape != topk_ids.shape:
        raise ValueError(f"fused_moe: host_ids {tuple(host_ids.shape)} do not match topk_ids {tuple(topk_ids.shape)}")


def group_by_slot(topk_ids: torch.Tensor, num_slots: int, host_ids: torch.Tensor | None = None,
                  upload: Upload | None = None) -> tuple[list[int], torch.Tensor, list[int]]:
    """(slots used, ascending, on the host; pair ids [P] sorted by slot, on topk_ids' device; pairs
    per used slot). From host_ids (the same ids on the host) with no device sync."""
    check_host_ids(topk_ids, host_ids)
    if host_ids is not None:
        host_slots, order, host_counts = group_on_host(host_ids.reshape(-1).numpy(), num_slots)
        return host_slots, (upload or to_device(topk_ids.device))(torch.from_numpy(order)), host_counts
    flat = topk_ids.reshape(-1).long()  # [P], pair p = t*K + k
    sorted_ids, order = torch.sort(flat, stable=True)
    slots, counts = torch.unique_consecutive(sorted_ids, return_counts=True)
    host_slots, host_counts = torch.stack((slots, counts)).tolist()  # one device -> host read for both
    _check_slot_span(host_slots, num_slots)
    return host_slots, order, host_counts


def _check_slot_span(slots: list[int], num_slots: int) -> None:
    if slots and (slots[0] < 0 or slots[-1] >= num_slots):
        raise ValueError(f"fused_moe: topk_ids out of range [0, {num_slots}): min {slots[0]}, max {slots[-1]}")


def group_on_host(a: np.ndarray, num_slots: int) -> tuple[list[int], np.ndarray, list[int]]:
    """group_by_slot of host ids a [P]: (slots used, ascending; pair ids [P] by ascending slot, ties in
    pair order; pairs per used slot). numpy's stable argsort is a radix sort for 16-bit keys (torch's
    stable CPU sort of a 16k-token prefill's 64k pairs costs about a millisecond a layer)."""
    if a.size:
        _check_slot_span([int(a.min()), int(a.max())], num_slots)
    keys = a.astype(np.int16 if num_slots <= np.iinfo(np.int16).max else np.int32, copy=False)
    order = np.argsort(keys, kind="stable")  # [P] pair ids by ascending slot, ties in pair order
    counts = np.bincount(keys, minlength=num_slots)
    used = np.flatnonzero(counts)
    return used.tolist(), order, counts[used].tolist()


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
