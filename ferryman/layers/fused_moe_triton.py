"""Triton decode path of `fused_moe`: one GEMV per (token, k) pair, dequantisation in the kernel.

    kernel 1  h[p]  = act(x[t] @ W13[slot]^T + b13[slot])        p = t*K + k, h: [P, I]
    kernel 2  y[p]  = (h[p] @ W2[slot]^T + b2[slot]) * topk_w[p]   y: [P, H] fp32
    out[t]          = sum_k y[t*K + k]                             (torch, fp32, then x.dtype)

Made for decode (P = T*K small): every program streams BLOCK_N weight rows of one expert.
Grids come from static sizes and slot ids are read on the device, so nothing syncs with the
host and a CUDA graph can capture it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ferryman.layers.moe_act_triton import ACT_KINDS, gate_up_rows, moe_act
from ferryman.layers.moe_common import TRITON_FAMILIES, TRITON_FORMATS, kernel_bank, quant_params, triton_reads
from ferryman.quant.base import Banks, get_format
from ferryman.quant.fp8_triton import fp8_rows_dot
from ferryman.quant.gguf_triton import gguf_rows_dot, type_code
from ferryman.quant.intq_triton import int_rows_dot
from ferryman.quant.nvfp4_triton import nvfp4_rows_dot

BLOCK_N = 16  # output rows per program (kernel 1 loads 2x: gate and up)
BLOCK_K = 512  # inputs per loop step; a multiple of 32 for mxfp4
NUM_WARPS = 2


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
def _rows_dot(w_base, s_base, g_base, z_base, rows, rmask, x_row, KDIM: tl.constexpr,
              NROWS: tl.constexpr, PART_ROWS: tl.constexpr, MXFP4: tl.constexpr, QF: tl.constexpr, QA: tl.constexpr,
              QB: tl.constexpr, BLOCK_K: tl.constexpr, GGUF: tl.constexpr):
    # one expert of a bank [E, OUT, KDIM] (dense) or [E, OUT, KDIM/32, 16] + scales (mxfp4): the
    # bases point at its weights, scales, global scales / group indices and zero points (_bases).
    # QF 1: fp8 (QA x QB blocks, QB 0: a scale per row); QF 2: nvfp4 (QA 1: the global scale divides;
    # g: global scales, row r of the bank uses g[r // PART_ROWS]); QF 3: int words (quant/intq_triton.py;
    # g: group indices of part r // PART_ROWS, z: zero points)
    # GGUF: the bank's ggml type code (quant/gguf_triton.py), rows of blocks [E, OUT, row_bytes] uint8
    if GGUF != 0:
        acc = gguf_rows_dot(w_base, rows, rmask, x_row, KDIM, NROWS, GGUF)
    elif MXFP4:
        acc = _mxfp4_rows_dot_fma(w_base, s_base, rows, rmask, x_row, KDIM, NROWS, BLOCK_K)
    elif QF == 1:
        acc = fp8_rows_dot(w_base, s_base, rows, rmask, x_row, KDIM, NROWS, QA, QB, BLOCK_K)
    elif QF == 2:
        acc = nvfp4_rows_dot(w_base, s_base, g_base, rows, rmask, x_row, KDIM, NROWS, PART_ROWS, QA, 16)
    elif QF == 3:
        acc = int_rows_dot(w_base, s_base, z_base, g_base, rows, rmask, x_row, KDIM, NROWS, BLOCK_K, QA, QB,
                           PART_ROWS)
    else:
        acc = _dense_rows_dot(w_base, rows, rmask, x_row, KDIM, NROWS, BLOCK_K)
    return acc


@triton.jit
def _expert(ptr, slot, STRIDE: tl.constexpr, host_ptr, J: tl.constexpr, HOST: tl.constexpr):
    # the first element of one expert's tensor J (0 weights, 1 scales, 2 global scales / group
    # indices, 3 zero points, 4 bias): slot >= 0 is a slot of the device bank at ptr, STRIDE
    # elements apart. With HOST, slot < 0 names expert -1 - slot of the layer's host bank (pinned
    # and mapped: the GPU reads it over the link), which begins host_ptr[J] elements from ptr with
    # experts host_ptr[5 + J] elements apart (host_table)
    if HOST:
        delta = tl.load(host_ptr + J)
        hstride = tl.load(host_ptr + 5 + J)
        off = tl.where(slot < 0, delta + (-1 - slot) * hstride, slot * STRIDE)
        if STRIDE % 16 == 0:  # host_table's are multiples of 16 too: loads stay 16-byte vectors
            off = tl.multiple_of(off, 16)
    else:
        off = slot * STRIDE
    return ptr + off


@triton.jit
def _bases(w_ptr, s_ptr, g_ptr, z_ptr, slot, W_STRIDE: tl.constexpr, S_STRIDE: tl.constexpr, G_STRIDE: tl.constexpr,
           Z_STRIDE: tl.constexpr, host_ptr, HOST: tl.constexpr):
    return (_expert(w_ptr, slot, W_STRIDE, host_ptr, 0, HOST), _expert(s_ptr, slot, S_STRIDE, host_ptr, 1, HOST),
            _expert(g_ptr, slot, G_STRIDE, host_ptr, 2, HOST), _expert(z_ptr, slot, Z_STRIDE, host_ptr, 3, HOST))


@triton.jit
def _w13_act_kernel(x_ptr, ids_ptr, w_ptr, s_ptr, g_ptr, b_ptr, h_ptr, alpha, limit, z_ptr, host_ptr,
                    W_STRIDE: tl.constexpr, S_STRIDE: tl.constexpr, G_STRIDE: tl.constexpr, B_STRIDE: tl.constexpr,
                    Z_STRIDE: tl.constexpr,
                    H: tl.constexpr, I: tl.constexpr, TOPK: tl.constexpr, ACT: tl.constexpr, MXFP4: tl.constexpr,
                    QF: tl.constexpr, QA: tl.constexpr, QB: tl.constexpr,
                    HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GGUF: tl.constexpr,
                    HOST: tl.constexpr):
    pair = tl.program_id(0)
    slot = tl.load(ids_ptr + pair).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] columns of h
    nmask = n < I
    gate_rows, up_rows = gate_up_rows(n, I, ACT)
    # one pass over gate and up rows together: [BN, 2] -> [2 BN] (interleaved = contiguous rows)
    rows = tl.reshape(tl.join(gate_rows, up_rows), [2 * BLOCK_N])
    rmask = tl.reshape(tl.join(nmask, nmask), [2 * BLOCK_N])
    x_row = x_ptr + (pair // TOPK) * H
    wb, sb, gb, zb = _bases(w_ptr, s_ptr, g_ptr, z_ptr, slot, W_STRIDE, S_STRIDE, G_STRIDE, Z_STRIDE, host_ptr, HOST)
    acc = _rows_dot(wb, sb, gb, zb, rows, rmask, x_row, H, 2 * BLOCK_N, I, MXFP4, QF, QA, QB, BLOCK_K, GGUF)
    if HAS_BIAS:
        acc += tl.load(_expert(b_ptr, slot, B_STRIDE, host_ptr, 4, HOST) + rows, mask=rmask, other=0.0).to(tl.float32)
    # round like the reference, which holds gate_up in the compute dtype
    acc = acc.to(h_ptr.dtype.element_ty).to(tl.float32)
    gate, up = tl.split(tl.reshape(acc, [BLOCK_N, 2]))
    h = moe_act(gate, up, alpha, limit, ACT)
    tl.store(h_ptr + pair * I + n, h.to(h_ptr.dtype.element_ty), mask=nmask)


@triton.jit
def _w2_kernel(h_ptr, ids_ptr, w_ptr, s_ptr, g_ptr, b_ptr, topk_w_ptr, y_ptr, z_ptr, host_ptr,
               W_STRIDE: tl.constexpr, S_STRIDE: tl.constexpr, G_STRIDE: tl.constexpr, B_STRIDE: tl.constexpr,
               Z_STRIDE: tl.constexpr,
               H: tl.constexpr, I: tl.constexpr, MXFP4: tl.constexpr, QF: tl.constexpr, QA: tl.constexpr,
               QB: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               GGUF: tl.constexpr, HOST: tl.constexpr):
    pair = tl.program_id(0)
    slot = tl.load(ids_ptr + pair).to(tl.int64)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] output features
    rmask = rows < H
    wb, sb, gb, zb = _bases(w_ptr, s_ptr, g_ptr, z_ptr, slot, W_STRIDE, S_STRIDE, G_STRIDE, Z_STRIDE, host_ptr, HOST)
    acc = _rows_dot(wb, sb, gb, zb, rows, rmask, h_ptr + pair * I, I, BLOCK_N, H, MXFP4, QF, QA, QB, BLOCK_K, GGUF)
    if HAS_BIAS:
        acc += tl.load(_expert(b_ptr, slot, B_STRIDE, host_ptr, 4, HOST) + rows, mask=rmask, other=0.0).to(tl.float32)
    acc *= tl.load(topk_w_ptr + pair).to(tl.float32)
    tl.store(y_ptr + pair * H + rows, acc, mask=rmask)


def fused_moe_decode(fmt: str, banks: Banks, x: torch.Tensor, topk_ids: torch.Tensor, topk_w: torch.Tensor,
                     kind: str, alpha: float, limit: float, host: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, H], topk_ids/topk_w [T, K] -> [T, H] in x.dtype. Inputs are validated by the caller.
    host: `moe_common.host_tables` of these banks and the layer's host bank; an id -1 - e then names
    expert e of the host bank, which the kernels read over the link themselves."""
    if not triton_reads(fmt):
        raise ValueError(f"no Triton kernel for expert format {fmt!r}; have {sorted(TRITON_FORMATS)} and the "
                         f"families {', '.join(TRITON_FAMILIES)}")
    _, hidden, inter = get_format(fmt).dims(banks)
    t, k = topk_ids.shape
    x = x.contiguous()
    ids = topk_ids.reshape(-1).contiguous()  # [P] slot of each pair
    tw = topk_w.reshape(-1).contiguous()  # [P]
    w13, w2 = kernel_bank(fmt, banks, "w13", x), kernel_bank(fmt, banks, "w2", x)
    tables = (ids, ids) if host is None else (host[0], host[1])  # unread without host
    # slot strides in elements of each tensor (contiguous banks: the size of one expert)
    st13, st2 = (dict(zip(("W_STRIDE", "S_STRIDE", "B_STRIDE"), p.strides), G_STRIDE=p.g_stride, Z_STRIDE=p.z_stride)
                 for p in (w13, w2))
    h = torch.empty(t * k, inter, dtype=x.dtype, device=x.device)  # [P, I]
    # GGUF: the w13 and w2 types' codes, "gguf:<w13>:<w2>"; 0 for other formats
    gguf_codes = [type_code(name) for name in fmt.split(":")[1:]] if fmt.startswith("gguf:") else [0, 0]
    common = dict(MXFP4=fmt == "mxfp4", **quant_params(fmt), HAS_BIAS=w13.has_bias, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
                  HOST=host is not None, num_warps=NUM_WARPS)
    _w13_act_kernel[(t * k, triton.cdiv(inter, BLOCK_N))](
        x, ids, w13.w, w13.s, w13.g, w13.b, h, float(alpha), float(limit), w13.z, tables[0], **st13,
        H=hidden, I=inter, TOPK=k, ACT=ACT_KINDS[kind], GGUF=gguf_codes[0], **common)
    y = torch.empty(t * k, hidden, dtype=torch.float32, device=x.device)  # [P, H]
    _w2_kernel[(t * k, triton.cdiv(hidden, BLOCK_N))](
        h, ids, w2.w, w2.s, w2.g, w2.b, tw, y, w2.z, tables[1], **st2, H=hidden, I=inter, GGUF=gguf_codes[1],
        **common)
    return y.view(t, k, hidden).sum(dim=1).to(x.dtype)  # [T, H]
