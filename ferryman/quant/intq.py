"""Weight-only integer expert formats (`int4:g128:sym`, `int4:g128:asym`, `int8:ch:sym`, ...): the one
packed layout that compressed-tensors' pack-quantized, AWQ and GPTQ checkpoints are repacked into,
losslessly, at load (quant/intq_layouts.py).

Name: `int{bits}:{g<size>|ch}:{sym|asym}[:act]`; ch = one group per row (channel strategy), act = a
group index per input (GPTQ act-order / compressed-tensors actorder: kept as it is, not permuted).

Banks of projection p (w13 [E, 2I, H], w2 [E, H, I]; K = the input dim, G = groups per row):
    p_qweight  int32  [E, out, K / (32 / bits)]  input k in word k // P at bits (k % P) * bits, codes
                                                 unsigned 0 .. 2^bits - 1 (P = 32 / bits)
    p_scales   fp32   [E, out, G]                the checkpoint's fp16/bf16 scales, exactly
    p_zeros    uint8  [E, out, G]                asym only; sym: the zero is 2^(bits-1)
    p_gidx     int32  [E, parts, K]              act only: the group of each input, per source tensor
                                                 (w13: gate rows, then up rows; w2: one part)
    w[o, k] = (code[o, k] - zero[o, g]) * scale[o, g],  g = gidx[part(o), k] (act) or k // group
computed in fp32 (exact: a code difference of <= 9 bits times a 16-bit float scale), then rounded
once to the compute dtype.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch

from ferryman.quant.base import (Banks, BankSpec, ExpertFormat, check_proj, register_family, triton_available)

_NAME = re.compile(r"^int(4|8):(?:g(\d+)|(ch)):(sym|asym)(:act)?$")


@dataclass(frozen=True)
class IntParams:
    """What a member of the family fixes: bits, group size (0: channel), zero points, group indices."""

    bits: int
    group: int
    sym: bool
    act: bool = False

    def __post_init__(self) -> None:
        if self.bits not in (4, 8):
            raise ValueError(f"int expert formats hold 4 or 8 bits, got {self.bits}")
        if self.group < 0 or (self.group and self.group % (32 // self.bits)):
            raise ValueError(f"int{self.bits} group size must be a multiple of {32 // self.bits}, got {self.group}")
        if self.act and not self.group:
            raise ValueError("a group index per input needs groups, not one scale per row")

    @property
    def name(self) -> str:
        g = f"g{self.group}" if self.group else "ch"
        return f"int{self.bits}:{g}:{'sym' if self.sym else 'asym'}{':act' if self.act else ''}"

    @property
    def per_word(self) -> int:
        return 32 // self.bits

    def groups(self, k: int) -> int:
        """Groups per row of k inputs."""
        return k // self.group if self.group else 1

    def group_size(self, k: int) -> int:
        return self.group or k

    def check_k(self, k: int, what: str) -> None:
        if k % self.per_word or (self.group and k % self.group):
            raise ValueError(f"{self.name}: {what} {k} must be a multiple of the group size "
                             f"{self.group or self.per_word}")


def parse_name(name: str) -> IntParams:
    m = _NAME.match(name)
    if m is None:
        raise ValueError(f"int expert format names read int<4|8>:<g<size>|ch>:<sym|asym>[:act], got {name!r}")
    return IntParams(int(m.group(1)), 0 if m.group(3) else int(m.group(2)), m.group(4) == "sym", bool(m.group(5)))


def quant_code(bits: int, group: int, asym: bool, act: bool) -> dict[str, int]:
    """The decode kernel's QF / QA / QB constexprs of an int format (layers/moe_common.py quant_params):
    QF 3, QA = bits | asym << 4 | act << 5, QB = the group size (0: one group per row)."""
    return dict(QF=3, QA=bits | int(asym) << 4 | int(act) << 5, QB=group)


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes [..., K] (0 .. 2^bits - 1, K % (32/bits) == 0) -> int32 words [..., K / (32/bits)]:
    input k in word k // P at bits (k % P) * bits."""
    p = 32 // bits
    c = codes.to(torch.int64).unflatten(-1, (-1, p))  # [..., W, P]
    shifts = torch.arange(p, device=codes.device, dtype=torch.int64) * bits
    words = (c << shifts).sum(-1)  # [..., W] in [0, 2^32)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def unpack_codes(words: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 words [..., W] -> codes [..., W * 32/bits] int32 (the inverse of pack_codes)."""
    p = 32 // bits
    shifts = torch.arange(p, device=words.device, dtype=torch.int32) * bits
    return ((words.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)).flatten(-2)


def dequant_int(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, groups: torch.Tensor | int,
                bits: int, dtype: torch.dtype) -> torch.Tensor:
    """codes [..., out, K], scales/zeros [..., out, G], groups: the group of each input ([..., out, K]
    int64) or the group size -> (code - zero) * scale in fp32, then `dtype`. zeros None: 2^(bits-1)."""
    if isinstance(groups, int):
        s = scales.float().repeat_interleave(groups, dim=-1)  # [..., out, K]
        z = None if zeros is None else zeros.repeat_interleave(groups, dim=-1)
    else:
        s = scales.float().gather(-1, groups)
        z = None if zeros is None else zeros.gather(-1, groups)
    q = codes.to(torch.int32) - (1 << (bits - 1) if z is None else z.to(torch.int32))
    return (q.float() * s).to(dtype)


def random_gidx(k: int, group: int, generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    """An act-order group index [k]: inputs in a random order, each consecutive `group` of that order
    one group (what GPTQ with desc_act writes)."""
    perm = torch.randperm(k, generator=generator, device=device)
    gidx = torch.empty(k, dtype=torch.int32, device=device)
    gidx[perm] = (torch.arange(k, device=device) // group).to(torch.int32)
    return gidx


# rms of (code - zero) over random_words' codes: uniform, but code 0 counted as the midpoint (value 0)
CODE_RMS = {b: math.sqrt(sum(v * v for v in range(-(1 << (b - 1)) + 1, 1 << (b - 1))) / (1 << b)) for b in (4, 8)}


def random_words(shape: tuple[int, ...], bits: int, generator: torch.Generator | None,
                 device: torch.device | str) -> torch.Tensor:
    """int32 words of random codes for dummy weights, symmetric about the midpoint: uniform codes, but
    code 0 (value -2^(bits-1), which has no positive twin) becomes the midpoint (value 0). Uniform codes
    alone average -0.5 (x the scale): in every weight of a matrix, about 0.11 of a 4-bit weight's
    spread, which added the same offset to every output and made a gpt-oss-120b dummy's tokens repeat
    (its decode used 11 of 128 experts a layer)."""
    words = torch.randint(-2**31, 2**31, shape, generator=generator, device=device, dtype=torch.int32)
    low = sum(1 << i for i in range(0, 32, bits))  # each code's lowest bit: 0x11111111 for 4 bits
    any_bit = words
    for b in range(1, bits):  # any bit of a code, gathered at its lowest bit (shifts stay within the code)
        any_bit = any_bit | (words >> b)
    zero = ~any_bit & low  # the lowest bit of each code that is 0
    return words | (zero << (bits - 1))  # those codes become the midpoint


class IntFormat(ExpertFormat):
    def __init__(self, params: IntParams) -> None:
        self.params = params
        self.name = params.name

    def _parts(self, proj: str) -> int:
        return 2 if proj == "w13" else 1

    def weight_specs(self, num_experts: int, hidden: int, inter: int, dtype: torch.dtype) -> dict[str, BankSpec]:
        p, e = self.params, num_experts
        p.check_k(hidden, "hidden size")
        p.check_k(inter, "expert FFN size")
        specs: dict[str, BankSpec] = {}
        for proj, out, k in (("w13", 2 * inter, hidden), ("w2", hidden, inter)):
            specs[f"{proj}_qweight"] = BankSpec((e, out, k // p.per_word), torch.int32)
            specs[f"{proj}_scales"] = BankSpec((e, out, p.groups(k)), torch.float32)
            if not p.sym:
                specs[f"{proj}_zeros"] = BankSpec((e, out, p.groups(k)), torch.uint8)
            if p.act:
                specs[f"{proj}_gidx"] = BankSpec((e, self._parts(proj), k), torch.int32)
        return specs

    def dims(self, banks: Banks) -> tuple[int, int, int]:
        e, two_i, words = self.bank(banks, "w13_qweight").shape
        return e, words * self.params.per_word, two_i // 2

    def random_weights(self, num_experts: int, hidden: int, inter: int, dtype: torch.dtype,
                       generator: torch.Generator | None, device: torch.device | str) -> Banks:
        """Codes from random_words; scales 1 / (rms(code) sqrt(K)) x 2^{-1,0,1}: values of std ~ 1/sqrt(K)."""
        p = self.params
        gdev = generator.device if generator is not None else torch.device(device)
        banks: Banks = {}
        for name, spec in self.weight_specs(num_experts, hidden, inter, dtype).items():
            k = hidden if name.startswith("w13") else inter
            if name.endswith("_qweight"):
                t = random_words(spec.shape, p.bits, generator, gdev)
            elif name.endswith("_scales"):
                jitter = torch.randint(-1, 2, spec.shape, generator=generator, device=gdev).float()
                t = torch.exp2(jitter) / (CODE_RMS[p.bits] * math.sqrt(k))
            elif name.endswith("_zeros"):
                mid = 1 << (p.bits - 1)
                t = torch.randint(mid - 1, mid + 2, spec.shape, generator=generator, device=gdev, dtype=torch.uint8)
            else:  # _gidx
                t = torch.stack([random_gidx(k, p.group, generator, gdev) for _ in range(math.prod(spec.shape[:2]))])
                t = t.view(spec.shape)
            banks[name] = t.to(device)
        return banks

    def input_groups(self, banks: Banks, proj: str, idx: torch.Tensor | slice, out: int, k: int) -> torch.Tensor | int:
        """The group of each input of each row [n, out, K] (act), else the group size."""
        p = self.params
        if not p.act:
            return p.group_size(k)
        gidx = self.bank(banks, f"{proj}_gidx")[idx].long()  # [n, parts, K]
        parts = gidx.shape[1]
        return gidx.repeat_interleave(out // parts, dim=1)  # [n, out, K]

    def dequant(self, banks: Banks, proj: str, idx: torch.Tensor | slice,
                dtype: torch.dtype | None = None) -> torch.Tensor:
        check_proj(proj)
        p = self.params
        qweight = self.bank(banks, f"{proj}_qweight")  # [E, out, K/P]
        scales = self.bank(banks, f"{proj}_scales")  # [E, out, G]
        zeros = None if p.sym else self.bank(banks, f"{proj}_zeros")
        gidx = banks.get(f"{proj}_gidx")
        dtype = dtype or self.model_dtype(banks)
        if qweight.is_cuda and triton_available():  # read in place, one launch (quant/intq_triton.py)
            from ferryman.quant.intq_triton import dequant_int_rows

            rows = idx if isinstance(idx, slice) else idx.to(qweight.device, non_blocking=True)
            return dequant_int_rows(p.bits, p.group, qweight, scales, zeros, gidx, rows, dtype)
        out, k = qweight.shape[1], qweight.shape[2] * p.per_word
        codes = unpack_codes(qweight[idx], p.bits)  # [n, out, K]
        zsel = None if zeros is None else zeros[idx]
        return dequant_int(codes, scales[idx], zsel, self.input_groups(banks, proj, idx, out, k), p.bits, dtype)

    def write_linear(self, banks: Banks, proj: str, expert: int | slice, rows: tuple[int, int] | None,
                     qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                     gidx: torch.Tensor | None) -> None:
        """One checkpoint linear of expert `expert` (canonical [out, ...] tensors, quant/intq_layouts.py
        `PackedInt`) into rows `rows` of its banks (w13: gate rows [0, I), up rows [I, 2I)); expert a
        slice: a stack of every expert's linear."""
        check_proj(proj)
        r0, r1 = rows if rows is not None else (0, self.bank(banks, f"{proj}_qweight").shape[1])
        parts = [("qweight", qweight), ("scales", scales)] + ([] if self.params.sym else [("zeros", zeros)])
        for name, t in parts:
            self.bank(banks, f"{proj}_{name}")[expert, r0:r1].copy_(t)
        if self.params.act:
            part = r0 // (r1 - r0)  # w13: 0 = gate rows, 1 = up rows
            self.bank(banks, f"{proj}_gidx")[expert, part].copy_(gidx)  # [K] ([E, K] for a stack)


def _factory(name: str) -> ExpertFormat:
    return IntFormat(parse_name(name))


register_family("int4", _factory)
register_family("int8", _factory)
