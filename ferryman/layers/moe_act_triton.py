"""The MoE activation and the gate/up row map in Triton, shared by the decode and grouped kernels;
`bias_act`: the batched prefill path's bias and activation in one kernel; `rank_sum`: its weighting
and per-token sums in one kernel."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

ACT_KINDS = {"silu": 0, "swiglu_oai": 1}  # MoEActivation.kind -> the kernels' ACT constexpr


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
def _bias_act_kernel(gu_ptr, b_ptr, rows_ptr, h_ptr, alpha, limit, M, I: tl.constexpr, ACT: tl.constexpr,
                     HAS_BIAS: tl.constexpr, HAS_ROWS: tl.constexpr, BN: tl.constexpr):
    # program (row r of G*M rows, column tile): h[r, n] = act(gate + b_gate, up + b_up) in fp32,
    # rounded once; the row's expert is e = r // M, its bias row e (or rows[e] of a bank), rounded to
    # gate_up's dtype first (the torch path's `.to(x.dtype)`)
    r = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    nm = n < I
    gi, ui = gate_up_rows(n, I, ACT)
    gate = tl.load(gu_ptr + r * 2 * I + gi, mask=nm, other=0.0).to(tl.float32)
    up = tl.load(gu_ptr + r * 2 * I + ui, mask=nm, other=0.0).to(tl.float32)
    if HAS_BIAS:
        e = r // M
        if HAS_ROWS:
            e = tl.load(rows_ptr + e).to(tl.int64)
        dt = gu_ptr.dtype.element_ty
        gate += tl.load(b_ptr + e * 2 * I + gi, mask=nm, other=0.0).to(dt).to(tl.float32)
        up += tl.load(b_ptr + e * 2 * I + ui, mask=nm, other=0.0).to(dt).to(tl.float32)
    h = moe_act(gate, up, alpha, limit, ACT)
    tl.store(h_ptr + r * I + n, h.to(h_ptr.dtype.element_ty), mask=nm)


def bias_act(gate_up: torch.Tensor, bias: torch.Tensor | None, kind: str, alpha: float, limit: float,
             rows: torch.Tensor | None = None) -> torch.Tensor:
    """gate_up [G, M, 2I] (contiguous), bias [G, 2I] or None -> act(gate_up + bias) [G, M, I] in
    gate_up's dtype, one launch: the batched prefill path's bias and activation (torch: 4-8 kernels
    of full-size temporaries). rows [G]: bias is a bank [S, 2I] and expert g's row is rows[g] (no
    gather of the group's biases)."""
    G, M, two_i = gate_up.shape
    want = (G, two_i) if rows is None else (two_i,)
    if two_i % 2 or not gate_up.is_contiguous() or (bias is not None and tuple(bias.shape)[-len(want):] != want) \
            or (rows is not None and rows.numel() != G):
        raise ValueError(f"bias_act: gate_up {tuple(gate_up.shape)} (contiguous {gate_up.is_contiguous()}), "
                         f"bias {None if bias is None else tuple(bias.shape)}, "
                         f"rows {None if rows is None else tuple(rows.shape)}")
    inter = two_i // 2
    h = torch.empty((G, M, inter), dtype=gate_up.dtype, device=gate_up.device)
    if h.numel() == 0:
        return h
    BN = min(1024, triton.next_power_of_2(inter))
    b = gate_up if bias is None else bias.contiguous()
    _bias_act_kernel[(G * M, triton.cdiv(inter, BN))](gate_up, b, b if rows is None else rows, h, float(alpha),
                                                      float(limit), M, I=inter, ACT=ACT_KINDS[kind],
                                                      HAS_BIAS=bias is not None, HAS_ROWS=rows is not None, BN=BN)
    return h


@triton.jit
def _rank_term(y_ptr, w_ptr, pair_ptr, b_ptr, e_ptr, s, H, cols, m, HAS_BIAS: tl.constexpr):
    # padded row s's term: (y[s] (+ its expert's w2 bias, rounded)) x its pair's weight, rounded
    y = tl.load(y_ptr + s * H + cols, mask=m, other=0.0)
    v = y.to(tl.float32)
    if HAS_BIAS:  # rounded to y's dtype first (the torch path's `.to(x.dtype)`), then added and rounded
        b = tl.load(b_ptr + tl.load(e_ptr + s).to(tl.int64) * H + cols, mask=m, other=0.0)
        v = (v + b.to(y.dtype).to(tl.float32)).to(y.dtype).to(tl.float32)
    w = tl.load(w_ptr + tl.load(pair_ptr + s)).to(tl.float32)
    return (v * w).to(y.dtype)


@triton.jit
def _rank_sum_kernel(y_ptr, w_ptr, pair_ptr, src_ptr, b_ptr, e_ptr, out_ptr, H, K: tl.constexpr,
                     HAS_BIAS: tl.constexpr, BH: tl.constexpr):
    # program (token t, column tile): out[t] = its K terms in rank order, term r from padded row
    # src[t K + r], each partial sum rounded to out's dtype (torch's adds, in sum_ranked's order)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BH + tl.arange(0, BH)
    m = cols < H
    acc = _rank_term(y_ptr, w_ptr, pair_ptr, b_ptr, e_ptr, tl.load(src_ptr + t * K), H, cols, m, HAS_BIAS)
    for r in tl.static_range(1, K):
        v = _rank_term(y_ptr, w_ptr, pair_ptr, b_ptr, e_ptr, tl.load(src_ptr + t * K + r), H, cols, m, HAS_BIAS)
        acc = (acc.to(tl.float32) + v.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + t * H + cols, acc, mask=m)


def rank_sum(y: torch.Tensor, topk_w: torch.Tensor, pair: torch.Tensor, src: torch.Tensor, k: int,
             bias: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """The batched prefill path's w2 bias, weighting and per-token sums in one kernel: y [R, H] (padded
    rows' outputs), topk_w [T, K], pair [R] (the pair t*K + k of each padded row), src [T*K] (the
    padded row of token t's r-th term at t*K + r, terms in ascending slot order), bias: (w2 biases
    [S, H], each padded row's row of them [R]) or None -> [T, H] in y's dtype. The same roundings,
    in the same order, as `y[rows] += bias; y[rows] *= w`, then index_copy_ and
    `batched_moe.sum_ranked`: bit for bit their result."""
    R, H = y.shape
    if src.numel() % k or topk_w.numel() != src.numel() or pair.numel() != R or not y.is_contiguous() or \
            (bias is not None and (bias[0].shape[1:] != (H,) or bias[1].numel() != R)):
        raise ValueError(f"rank_sum: y {tuple(y.shape)} (contiguous {y.is_contiguous()}), topk_w "
                         f"{tuple(topk_w.shape)}, pair {tuple(pair.shape)}, src {tuple(src.shape)}, k {k}, "
                         f"bias {None if bias is None else (tuple(bias[0].shape), tuple(bias[1].shape))}")
    T = src.numel() // k
    out = torch.empty((T, H), dtype=y.dtype, device=y.device)
    if T == 0:
        return out
    BH = min(1024, triton.next_power_of_2(H))
    # no fused multiply-adds: in fp32 a term's product and the running sum would round once, not twice
    b, e = (y, pair) if bias is None else (bias[0].contiguous(), bias[1])
    _rank_sum_kernel[(T, triton.cdiv(H, BH))](y, topk_w.contiguous(), pair, src, b, e, out, H, K=k,
                                               HAS_BIAS=bias is not None, BH=BH, enable_fp_fusion=False)
    return out
