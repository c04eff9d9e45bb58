"""Triton decode path of `fused_moe`: one GEMV per (token, k) pair, dequantisation in the kernel.

    kernel 1  h[p]  = act(x[t] @ W13[slot]^T + b13[slot])        p = t*K + k, h: [P, I]
    kernel 2  y[p]  = (h[p] @ W2[slot]^T + b2[slot]) * topk_w[p]   y: [P, H] fp32
    out[t]          = sum_k y[t*K + k]                             (torch, fp32, then x.dtype)

Made for decode (P = T*K small): every program streams BLOCK_N weight rows of one expert.
Grids come from static sizes and slot ids are read on the device, so nothing syncs with the
host and a CUDA graph can capture it.

Measured on an H200 (benchmarks/bench_fused_moe.py, gpt-oss-20b layer, bf16, graph replay):
T=1, K=4 (53 MB of experts) ~56-63 us = ~0.9 TB/s, T=4 ~1.2 TB/s, against a 4.25 TB/s copy.
Tile sizes barely move it, nor does prefetching a step ahead: the mxfp4 path is bound by the
integer work of decoding nibbles (~4 ops per element) and x handling, not by DRAM. "dot"
(tl.dot_scaled) measured slower (~85 us).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ferryman.quant.base import Banks, get_format

ACT_KINDS = {"silu": 0, "swiglu_oai": 1}
FORMATS = {"dense": 0, "mxfp4": 1}


@dataclass(frozen=True)
class DecodeConfig:
    """Tile sizes of the decode GEMVs and how mxfp4 rows are multiplied.

    impl "fma": nibbles decoded with integer ops, fp32 FMAs (any x dtype, runs in the interpreter).
    impl "dot": tl.dot_scaled on tensor cores, Triton's own e2m1 upcast (CUDA, bf16/fp16 x only).
    """

    block_n: int = 16  # output rows per program (kernel 1 loads 2x: gate and up)
    block_k: int = 512  # inputs per loop step; a multiple of 32 for mxfp4
    num_warps: int = 2  # H200 sweep (benchmarks/bench_fused_moe.py --sweep): 55.7 us vs 63.0 us at 4 warps
    impl: str = "fma"
    fuse_k: bool = False  # kernel 2 sums the K experts of a token itself (grid T, not T*K; no torch sum)

    def __post_init__(self) -> None:
        for name in ("block_n", "block_k"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"DecodeConfig.{name} must be a power of two >= 16, got {v}")
        if self.block_k < 32:
            raise ValueError(f"DecodeConfig.block_k must be >= 32, got {self.block_k}")
        if self.impl not in ("fma", "dot"):
            raise ValueError(f"DecodeConfig.impl must be 'fma' or 'dot', got {self.impl!r}")


@functools.cache
def default_decode_config() -> DecodeConfig:
    """Tiles from FERRYMAN_MOE_DECODE_TILES="block_n,block_k,num_warps,impl" (for tuning), else defaults."""
    from ferryman.envs import envs

    raw = envs.MOE_DECODE_TILES
    if not raw:
        return DecodeConfig()
    try:
        n, k, w, impl, *rest = raw.split(",")
        fuse = [r.strip() for r in rest] == ["fusek"]
        if rest and not fuse:
            raise ValueError(f"unknown option {','.join(rest)!r}")
        return DecodeConfig(block_n=int(n), block_k=int(k), num_warps=int(w), impl=impl.strip(), fuse_k=fuse)
    except ValueError as e:
        raise ValueError(f"FERRYMAN_MOE_DECODE_TILES={raw!r}: expected block_n,block_k,num_warps,impl[,fusek] ({e})") from None


@triton.jit
def moe_act(gate, up, alpha, limit, ACT: tl.constexpr):
    # ACT 0 = silu: silu(gate) * up; 1 = swiglu_oai: clamped, (up + 1) * gate * sigmoid(alpha gate)
    if ACT == 0:
        h = gate * tl.sigmoid(gate) * up
    else:
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
        h = (up + 1.0) * (gate * tl.sigmoid(gate * alpha))
    return h


@triton.jit
def gate_up_rows(n, I: tl.constexpr, ACT: tl.constexpr):
    # rows of w13 holding gate / up column n of h. silu: n and I + n; swiglu_oai: 2n and 2n + 1
    if ACT == 0:
        return n, n + I
    return 2 * n, 2 * n + 1


@triton.jit
def _e2m1_bits(words, N: tl.constexpr):
    # nibble N of each uint32 word (element 8j+N of the row) -> fp32 holding e2m1 x 2^-126:
    # its magnitude bits (e1 e0 m) go under fp32's exponent/mantissa boundary (bits 24..22),
    # its sign bit to bit 31. Code +-1 (0.5) becomes a subnormal, which FMA keeps exactly.
    if N < 6:
        mag = (words << (22 - 4 * N)) & 0x01C00000
    else:
        mag = (words >> (4 * N - 22)) & 0x01C00000
    sign = (words << (28 - 4 * N)) & 0x80000000
    return (mag | sign).to(tl.float32, bitcast=True)


@triton.jit
def _e8m0(s):
    # s: uint32 scale bytes -> 2^(s-127) (s = 0 reads as 0 instead of 2^-127, s = 255 as inf)
    return (s << 23).to(tl.float32, bitcast=True)


@triton.jit
def _mxfp4_step(w_words, s_base, rows, rmask, g0, NG: tl.constexpr, G: tl.constexpr):
    # blocks g0..g0+G of each row -> (words [R, G, 4] uint32, scales [R, G] uint32); past NG: 0
    grp = g0 + tl.arange(0, G)
    m2 = rmask[:, None] & (grp < NG)[None, :]  # [R, G]
    woff = rows[:, None, None] * (NG * 4) + grp[None, :, None] * 4 + tl.arange(0, 4)[None, None, :]
    words = tl.load(w_words + woff, mask=m2[:, :, None], other=0).to(tl.uint32, bitcast=True)
    s = tl.load(s_base + rows[:, None] * NG + grp[None, :], mask=m2, other=0).to(tl.uint32)
    return words, s


@triton.jit
def _mxfp4_rows_dot_fma(w_base, s_base, rows, rmask, x_row, KDIM: tl.constexpr, NROWS: tl.constexpr,
                        BLOCK_K: tl.constexpr):
    # rows: [R] weight rows of one expert; w_base -> blocks [rows, KDIM/32, 16] bytes, read as 4
    # little-endian uint32 words per block (word j: elements 8j..8j+7, nibble n = element 8j+n);
    # s_base -> scales [rows, KDIM/32]; x_row -> [KDIM]. Returns [R] fp32 dot products.
    G: tl.constexpr = BLOCK_K // 32
    NG: tl.constexpr = KDIM // 32
    offs_g = tl.arange(0, G)
    offs_w = tl.arange(0, 4)
    w_words = w_base.to(tl.pointer_type(tl.int32))
    acc = tl.zeros([NROWS, G], dtype=tl.float32)
    words, s = _mxfp4_step(w_words, s_base, rows, rmask, 0, NG, G)
    for g0 in range(0, NG, G):
        # issue the next step's loads before using this one's: two steps of weights in flight
        next_words, next_s = _mxfp4_step(w_words, s_base, rows, rmask, g0 + G, NG, G)
        grp = g0 + offs_g  # [G]
        x_ptrs = x_row + grp[:, None] * 32 + offs_w[None, :] * 8  # [G, 4] element 8j of each word
        xmask = (grp < NG)[:, None]
        part = tl.zeros([NROWS, G, 4], dtype=tl.float32)
        for n in tl.static_range(8):
            # x x 2^64 keeps x x (e2m1 x 2^-126) in the normal range; 2^62 below restores it
            xn = tl.load(x_ptrs + n, mask=xmask, other=0.0).to(tl.float32) * 18446744073709551616.0
            part += _e2m1_bits(words, n) * xn[None, :, :]
        acc += (tl.sum(part, axis=2) * 4.611686018427388e18) * _e8m0(s)  # x 2^62 x 2^(s-127)
        words, s = next_words, next_s
    return tl.sum(acc, axis=1)


@triton.jit
def _mxfp4_rows_dot_tc(w_base, s_base, rows, rmask, x_row, KDIM: tl.constexpr, NROWS: tl.constexpr,
                       BLOCK_K: tl.constexpr, TC: tl.constexpr):
    # Same contract as _mxfp4_rows_dot_fma, on tensor cores: [R, BK] e2m1 x [BK, 16] (x in every
    # column, the MMA's smallest N) -> column 0.
    G: tl.constexpr = BLOCK_K // 32
    NG: tl.constexpr = KDIM // 32
    offs_b = tl.arange(0, BLOCK_K // 2)
    offs_g = tl.arange(0, G)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([NROWS, 16], dtype=tl.float32)
    for k0 in range(0, KDIM, BLOCK_K):
        bmask = rmask[:, None] & (k0 // 2 + offs_b[None, :] < KDIM // 2)
        w = tl.load(w_base + rows[:, None] * (KDIM // 2) + k0 // 2 + offs_b[None, :], mask=bmask, other=0)
        smask = rmask[:, None] & (k0 // 32 + offs_g[None, :] < NG)
        s = tl.load(s_base + rows[:, None] * NG + k0 // 32 + offs_g[None, :], mask=smask, other=0)
        xv = tl.load(x_row + k0 + offs_k, mask=k0 + offs_k < KDIM, other=0.0)
        xt = tl.broadcast_to(xv[:, None], (BLOCK_K, 16))
        if TC == 2:
            acc = tl.dot_scaled(w, s, "e2m1", xt, None, "fp16", acc=acc)
        else:
            acc = tl.dot_scaled(w, s, "e2m1", xt, None, "bf16", acc=acc)
    col = tl.arange(0, 16)
    return tl.sum(tl.where(col[None, :] == 0, acc, 0.0), axis=1)


@triton.jit
def _dense_rows_dot(w_base, rows, rmask, x_row, KDIM: tl.constexpr, NROWS: tl.constexpr,
                    BLOCK_K: tl.constexpr):
    # rows: [R] weight rows of one expert; w_base -> [rows, KDIM]; x_row -> [KDIM]. -> [R] fp32
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = w_base + rows[:, None] * KDIM + offs_k[None, :]
    acc = tl.zeros([NROWS, BLOCK_K], dtype=tl.float32)
    w = tl.load(w_ptrs, mask=rmask[:, None] & (offs_k < KDIM)[None, :], other=0.0)
    for k0 in range(0, KDIM, BLOCK_K):
        # next step's weights in flight while this one is multiplied
        kn = k0 + BLOCK_K + offs_k
        next_w = tl.load(w_ptrs + k0 + BLOCK_K, mask=rmask[:, None] & (kn < KDIM)[None, :], other=0.0)
        k = k0 + offs_k
        xv = tl.load(x_row + k, mask=k < KDIM, other=0.0).to(tl.float32)
        acc += w.to(tl.float32) * xv[None, :]
        w = next_w
    return tl.sum(acc, axis=1)


@triton.jit
def _rows_dot(w_ptr, s_ptr, slot, W_STRIDE: tl.constexpr, S_STRIDE: tl.constexpr, rows, rmask, x_row,
              OUT: tl.constexpr, KDIM: tl.constexpr, NROWS: tl.constexpr, MXFP4: tl.constexpr,
              BLOCK_K: tl.constexpr, TC: tl.constexpr):
    # expert `slot` of a bank [E, OUT, KDIM] (dense) or [E, OUT, KDIM/32, 16] + scales (mxfp4), each
    # expert contiguous, experts W_STRIDE / S_STRIDE elements apart (strided: the expert-major slot
    # pool; constexpr: a model has one or two layouts, and contiguous banks compile exactly as
    # before); TC: 0 = FMA path, 1/2 = tensor cores with bf16/fp16 activations
    if MXFP4:
        w_base = w_ptr + slot * W_STRIDE
        s_base = s_ptr + slot * S_STRIDE
        if TC != 0:
            acc = _mxfp4_rows_dot_tc(w_base, s_base, rows, rmask, x_row, KDIM, NROWS, BLOCK_K, TC)
        else:
            acc = _mxfp4_rows_dot_fma(w_base, s_base, rows, rmask, x_row, KDIM, NROWS, BLOCK_K)
    else:
        acc = _dense_rows_dot(w_ptr + slot * W_STRIDE, rows, rmask, x_row, KDIM, NROWS, BLOCK_K)
    return acc


@triton.jit
def _expert_bases(w_ptr, s_ptr, b_ptr, addr_ptr, slot, INDIRECT: tl.constexpr, W_OFF: tl.constexpr,
                  S_OFF: tl.constexpr, B_OFF: tl.constexpr):
    # INDIRECT: `slot` is an expert id and addr[slot] the address of that expert's row of bytes
    # (a cache slot on the device, or pinned host memory read over the link: zero-copy), its banks
    # at fixed byte offsets in the row. Returns the bank pointers of that row and slot 0, which
    # _rows_dot and the bias loads then use unchanged. Otherwise the arguments, unchanged.
    if INDIRECT:
        row = tl.load(addr_ptr + slot).to(tl.pointer_type(tl.uint8))
        w_ptr = (row + W_OFF).to(w_ptr.dtype, bitcast=True)
        s_ptr = (row + S_OFF).to(s_ptr.dtype, bitcast=True)
        b_ptr = (row + B_OFF).to(b_ptr.dtype, bitcast=True)
        slot = slot * 0
    return w_ptr, s_ptr, b_ptr, slot


@triton.jit
def _w13_act_kernel(x_ptr, ids_ptr, w_ptr, s_ptr, b_ptr, h_ptr, alpha, limit, addr_ptr,
                    W_STRIDE: tl.constexpr, S_STRIDE: tl.constexpr, B_STRIDE: tl.constexpr, INDIRECT: tl.constexpr,
                    W_OFF: tl.constexpr, S_OFF: tl.constexpr, B_OFF: tl.constexpr, H: tl.constexpr, I: tl.constexpr, TOPK: tl.constexpr, ACT: tl.constexpr,
                    MXFP4: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, TC: tl.constexpr):
    pair = tl.program_id(0)
    slot = tl.load(ids_ptr + pair).to(tl.int64)
    w_ptr, s_ptr, b_ptr, slot = _expert_bases(w_ptr, s_ptr, b_ptr, addr_ptr, slot, INDIRECT, W_OFF, S_OFF, B_OFF)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] columns of h
    nmask = n < I
    gate_rows, up_rows = gate_up_rows(n, I, ACT)
    # one pass over gate and up rows together: [BN, 2] -> [2 BN] (interleaved = contiguous rows)
    rows = tl.reshape(tl.join(gate_rows, up_rows), [2 * BLOCK_N])
    rmask = tl.reshape(tl.join(nmask, nmask), [2 * BLOCK_N])
    x_row = x_ptr + (pair // TOPK) * H
    acc = _rows_dot(w_ptr, s_ptr, slot, W_STRIDE, S_STRIDE, rows, rmask, x_row, 2 * I, H, 2 * BLOCK_N, MXFP4,
                    BLOCK_K, TC)
    if HAS_BIAS:
        acc += tl.load(b_ptr + slot * B_STRIDE + rows, mask=rmask, other=0.0).to(tl.float32)
    # round like the reference, which holds gate_up in the compute dtype
    acc = acc.to(h_ptr.dtype.element_ty).to(tl.float32)
    gate, up = tl.split(tl.reshape(acc, [BLOCK_N, 2]))
    h = moe_act(gate, up, alpha, limit, ACT)
    tl.store(h_ptr + pair * I + n, h.to(h_ptr.dtype.element_ty), mask=nmask)


@triton.jit
def _w2_kernel(h_ptr, ids_ptr, w_ptr, s_ptr, b_ptr, topk_w_ptr, y_ptr, addr_ptr,
               W_STRIDE: tl.constexpr, S_STRIDE: tl.constexpr, B_STRIDE: tl.constexpr, INDIRECT: tl.constexpr,
               W_OFF: tl.constexpr, S_OFF: tl.constexpr, B_OFF: tl.constexpr, H: tl.constexpr, I: tl.constexpr, MXFP4: tl.constexpr, HAS_BIAS: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TC: tl.constexpr):
    pair = tl.program_id(0)
    slot = tl.load(ids_ptr + pair).to(tl.int64)
    w_ptr, s_ptr, b_ptr, slot = _expert_bases(w_ptr, s_ptr, b_ptr, addr_ptr, slot, INDIRECT, W_OFF, S_OFF, B_OFF)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] output features
    rmask = rows < H
    acc = _rows_dot(w_ptr, s_ptr, slot, W_STRIDE, S_STRIDE, rows, rmask, h_ptr + pair * I, H, I, BLOCK_N, MXFP4,
                    BLOCK_K, TC)
    if HAS_BIAS:
        acc += tl.load(b_ptr + slot * B_STRIDE + rows, mask=rmask, other=0.0).to(tl.float32)
    acc *= tl.load(topk_w_ptr + pair).to(tl.float32)
    tl.store(y_ptr + pair * H + rows, acc, mask=rmask)


@triton.jit
def _w2_sum_kernel(h_ptr, ids_ptr, w_ptr, s_ptr, b_ptr, topk_w_ptr, out_ptr, addr_ptr,
                   W_STRIDE: tl.constexpr, S_STRIDE: tl.constexpr, B_STRIDE: tl.constexpr, INDIRECT: tl.constexpr,
                   W_OFF: tl.constexpr, S_OFF: tl.constexpr, B_OFF: tl.constexpr, H: tl.constexpr, I: tl.constexpr, TOPK: tl.constexpr, MXFP4: tl.constexpr,
                   HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TC: tl.constexpr):
    # _w2_kernel for all K pairs of one token, summed in fp32 in k order, stored in out's dtype
    t = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] output features
    rmask = rows < H
    total = tl.zeros([BLOCK_N], dtype=tl.float32)
    for kk in tl.static_range(TOPK):
        pair = t * TOPK + kk
        slot = tl.load(ids_ptr + pair).to(tl.int64)
        wp, sp, bp, slot = _expert_bases(w_ptr, s_ptr, b_ptr, addr_ptr, slot, INDIRECT, W_OFF, S_OFF, B_OFF)
        acc = _rows_dot(wp, sp, slot, W_STRIDE, S_STRIDE, rows, rmask, h_ptr + pair * I, H, I, BLOCK_N,
                        MXFP4, BLOCK_K, TC)
        if HAS_BIAS:
            acc += tl.load(bp + slot * B_STRIDE + rows, mask=rmask, other=0.0).to(tl.float32)
        total += acc * tl.load(topk_w_ptr + pair).to(tl.float32)
    tl.store(out_ptr + t * H + rows, total.to(out_ptr.dtype.element_ty), mask=rmask)


def _weights(fmt: str, banks: Banks, proj: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, scales) of one projection; dense passes its weights twice (scales unused)."""
    if fmt == "mxfp4":
        pair = (banks[f"{proj}_blocks"], banks[f"{proj}_scales"])
    else:
        pair = (banks[proj], banks[proj])
    for t in pair:
        _check_expert_contiguous(t, f"{fmt} bank of {proj}")
    return pair


def _check_expert_contiguous(t: torch.Tensor, what: str) -> None:
    """Each expert's slice contiguous; the experts may be any stride apart (expert-major pools)."""
    if t.shape[0] > 0 and not t[0].is_contiguous():
        raise ValueError(f"{what}: each expert's slice must be contiguous for the Triton kernels, "
                         f"got strides {tuple(t.stride())} for shape {tuple(t.shape)}")


def _tensor_core_mode(cfg: DecodeConfig, fmt: str, dtype: torch.dtype) -> int:
    """0 = FMA path; 1/2 = tl.dot_scaled with bf16/fp16 x (mxfp4 only; fp32 x keeps FMAs)."""
    if cfg.impl != "dot" or fmt != "mxfp4":
        return 0
    return {torch.bfloat16: 1, torch.float16: 2}.get(dtype, 0)


@dataclass(frozen=True)
class RowAddresses:
    """Experts addressed by row instead of by slot: `addr[e]` (int64, on the device) is where expert
    e's row of bytes starts (a cache slot in device memory, or pinned host memory that the kernel
    reads over the link), each bank at `offsets[name]` bytes into the row (host_store.ExpertLayout)."""

    addr: torch.Tensor  # [E] int64
    offsets: dict[str, int]

    def constexprs(self, fmt: str, proj: str, has_bias: bool) -> dict[str, int | bool]:
        w = self.offsets[f"{proj}_blocks" if fmt == "mxfp4" else proj]
        s = self.offsets[f"{proj}_scales"] if fmt == "mxfp4" else w
        b = self.offsets[f"{proj}_bias"] if has_bias else 0
        return {"INDIRECT": True, "W_OFF": w, "S_OFF": s, "B_OFF": b}


_DIRECT = {"INDIRECT": False, "W_OFF": 0, "S_OFF": 0, "B_OFF": 0}


def fused_moe_decode(
    fmt: str,
    banks: Banks,
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_w: torch.Tensor,
    kind: str,
    alpha: float,
    limit: float,
    cfg: DecodeConfig | None = None,
    rows: RowAddresses | None = None,
) -> torch.Tensor:
    """x [T, H], topk_ids/topk_w [T, K] -> [T, H] in x.dtype. Inputs are validated by the caller.
    rows: topk_ids are expert ids read through `rows.addr` (banks then only give dtypes and dims)."""
    if fmt not in FORMATS:
        raise ValueError(f"no Triton kernel for expert format {fmt!r}; have {sorted(FORMATS)}")
    cfg = cfg or default_decode_config()
    _, hidden, inter = get_format(fmt).dims(banks)
    t, k = topk_ids.shape
    x = x.contiguous()
    ids = topk_ids.reshape(-1).contiguous()  # [P] slot of each pair
    tw = topk_w.reshape(-1).contiguous()  # [P]
    w13, s13 = _weights(fmt, banks, "w13")
    w2, s2 = _weights(fmt, banks, "w2")
    has_bias = "w13_bias" in banks and "w2_bias" in banks
    b13 = banks["w13_bias"] if has_bias else x
    b2 = banks["w2_bias"] if has_bias else x
    if has_bias:
        _check_expert_contiguous(b13, "w13_bias")
        _check_expert_contiguous(b2, "w2_bias")
    # slot strides in elements of each tensor (contiguous banks: the size of one expert)
    st13 = dict(W_STRIDE=w13.stride(0), S_STRIDE=s13.stride(0), B_STRIDE=b13.stride(0) if has_bias else 0,
                **(rows.constexprs(fmt, "w13", has_bias) if rows else _DIRECT))
    st2 = dict(W_STRIDE=w2.stride(0), S_STRIDE=s2.stride(0), B_STRIDE=b2.stride(0) if has_bias else 0,
               **(rows.constexprs(fmt, "w2", has_bias) if rows else _DIRECT))
    addr = rows.addr if rows is not None else ids  # unread unless INDIRECT
    h = torch.empty(t * k, inter, dtype=x.dtype, device=x.device)  # [P, I]
    common = dict(MXFP4=FORMATS[fmt], HAS_BIAS=has_bias, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                  TC=_tensor_core_mode(cfg, fmt, x.dtype), num_warps=cfg.num_warps)
    _w13_act_kernel[(t * k, triton.cdiv(inter, cfg.block_n))](
        x, ids, w13, s13, b13, h, float(alpha), float(limit), addr, **st13,
        H=hidden, I=inter, TOPK=k, ACT=ACT_KINDS[kind], **common)
    if cfg.fuse_k:
        out = torch.empty(t, hidden, dtype=x.dtype, device=x.device)  # [T, H]
        _w2_sum_kernel[(t, triton.cdiv(hidden, cfg.block_n))](
            h, ids, w2, s2, b2, tw, out, addr, **st2, H=hidden, I=inter, TOPK=k, **common)
        return out
    y = torch.empty(t * k, hidden, dtype=torch.float32, device=x.device)  # [P, H]
    _w2_kernel[(t * k, triton.cdiv(hidden, cfg.block_n))](
        h, ids, w2, s2, b2, tw, y, addr, **st2, H=hidden, I=inter, **common)
    return y.view(t, k, hidden).sum(dim=1).to(x.dtype)  # [T, H]
