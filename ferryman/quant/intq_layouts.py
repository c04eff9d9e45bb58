"""The checkpoint layouts of integer weights, repacked losslessly into the canonical int layout of
quant/intq.py (one linear [out, K] at a time):

- compressed-tensors `pack-quantized`: `weight_packed` int32 [out, ceil(K/P)], input k at bits
  (k % P) * bits of word k // P, codes = value + 2^(bits-1); `weight_scale` [out, G] (channel:
  [out, 1]); asym `weight_zero_point` int32 [ceil(out/P), G] packed the same way along the output
  dim; `weight_shape` [2] = (out, K); optional `weight_g_idx` [K].
- AWQ GEMM: `qweight` int32 [K, out/8] packed along the output dim in AWQ's nibble order (nibble i
  of word j holds output 8j + AWQ_ORDER[i]); `qzeros` [G, out/8] the same; `scales` [G, out].
- GPTQ: `qweight` int32 [K/P, out] packed along the input dim in order; `qzeros` [G, out/P] packed
  along the output dim in order, stored minus one (checkpoint_format "gptq"; "gptq_v2": as they
  are); `scales` [G, out]; `g_idx` [K] the group of each input (act-order: any order).
w = (code - zero) * scale everywhere. Each function checks every shape against the weight and
raises ValueError naming the tensor.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ferryman.quant.intq import (CODE_RMS, IntParams, dequant_int, pack_codes, random_gidx, random_words,
                                 unpack_codes)

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ word holds output 8j + AWQ_ORDER[i]
AWQ_UNDO = tuple(AWQ_ORDER.index(c) for c in range(8))  # output 8j + c sits in nibble AWQ_UNDO[c]

Get = Callable[[str], torch.Tensor]  # a checkpoint tensor by its full name


@dataclass(frozen=True)
class PackedInt:
    """One linear's weights in the canonical layout (quant/intq.py)."""

    params: IntParams
    qweight: torch.Tensor  # [out, K/P] int32
    scales: torch.Tensor  # [out, G] fp32
    zeros: torch.Tensor | None  # [out, G] uint8 (asym)
    gidx: torch.Tensor | None  # [K] int32 (act)

    @property
    def shape(self) -> tuple[int, int]:
        """(out, K) of the linear (of each one, for a stack [E, out, ...] of all experts)."""
        return self.qweight.shape[-2], self.qweight.shape[-1] * self.params.per_word

    def dequant(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[out, K] in `dtype` (dense layers are dequantised at load)."""
        out, k = self.shape
        groups = self.params.group_size(k) if self.gidx is None else self.gidx.long().expand(out, k)
        return dequant_int(unpack_codes(self.qweight, self.params.bits), self.scales, self.zeros, groups,
                           self.params.bits, dtype)


def _expect(t: torch.Tensor, name: str, shape: tuple[int, ...], dtypes: tuple[torch.dtype, ...]) -> None:
    if tuple(t.shape) != tuple(shape) or t.dtype not in dtypes:
        want = "/".join(str(d).removeprefix("torch.") for d in dtypes)
        raise ValueError(f"{name}: expected {tuple(shape)} {want}, got {tuple(t.shape)} "
                         f"{str(t.dtype).removeprefix('torch.')} (it contradicts the packed weight)")


_FLOATS = (torch.float16, torch.bfloat16, torch.float32)


def _groups_of(params: IntParams, k: int, name: str) -> int:
    params.check_k(k, f"{name}: input dim")
    return params.groups(k)


def _trivial_gidx(params: IntParams, k: int, device: torch.device) -> torch.Tensor:
    return (torch.arange(k, device=device) // params.group_size(k)).to(torch.int32)


def _act_gidx(params: IntParams, g_idx: torch.Tensor | None, k: int, groups: int, name: str) -> torch.Tensor | None:
    """The group index kept for act formats (checked), None otherwise (then it must be k // group)."""
    if g_idx is None:
        if params.act:
            raise ValueError(f"{name}: missing (the format keeps a group index per input)")
        return None
    _expect(g_idx, name, (k,), (torch.int32, torch.int64, torch.int16))
    if params.act:
        if k and (int(g_idx.min()) < 0 or int(g_idx.max()) >= groups):
            raise ValueError(f"{name}: group indices must lie in [0, {groups}), got {int(g_idx.min())}.."
                             f"{int(g_idx.max())}")
        return g_idx.to(torch.int32)
    if not torch.equal(g_idx.to(torch.int32), _trivial_gidx(params, k, g_idx.device)):
        raise ValueError(f"{name}: inputs are not in group order (act-order) but the scheme keeps no group "
                     f"index (desc_act / actorder)")
    return None


def _sym_zeros(params: IntParams, zeros: torch.Tensor, name: str) -> torch.Tensor | None:
    """Zeros of a symmetric scheme must all be 2^(bits-1): dropped; asym: uint8 as they are."""
    if not params.sym:
        return zeros.to(torch.uint8)
    mid = 1 << (params.bits - 1)
    if not bool((zeros == mid).all()):
        raise ValueError(f"{name}: a symmetric scheme has zero points {mid}, got others")
    return None


def from_compressed_tensors(params: IntParams, prefix: str, get: Get, names: set[str]) -> PackedInt:
    """`prefix`.weight_packed / weight_scale / weight_zero_point / weight_shape / weight_g_idx."""
    shape_t = get(prefix + "weight_shape")
    if shape_t.numel() != 2:
        raise ValueError(f"{prefix}weight_shape: expected 2 values (out, in), got {tuple(shape_t.shape)}")
    out, k = (int(v) for v in shape_t.tolist())
    per = params.per_word
    packed = get(prefix + "weight_packed")
    _expect(packed, prefix + "weight_packed", (out, -(-k // per)), (torch.int32,))
    g = _groups_of(params, k, prefix + "weight_packed")
    scales = get(prefix + "weight_scale")
    _expect(scales, prefix + "weight_scale", (out, g), _FLOATS)
    zeros = None
    if not params.sym:
        zp = get(prefix + "weight_zero_point")
        _expect(zp, prefix + "weight_zero_point", (-(-out // per), g), (torch.int32,))
        zeros = unpack_codes(zp.T.contiguous(), params.bits)[:, :out].T.to(torch.uint8)  # [out, G]
    elif prefix + "weight_zero_point" in names:
        zp = get(prefix + "weight_zero_point")
        if bool((zp != 0).any()):
            raise ValueError(f"{prefix}weight_zero_point: a symmetric scheme has zero points 0, got others")
    g_idx = get(prefix + "weight_g_idx") if prefix + "weight_g_idx" in names else None
    gidx = _act_gidx(params, g_idx, k, g, prefix + "weight_g_idx")
    return PackedInt(params, packed.contiguous(), scales.float(), zeros, gidx)


def from_awq(params: IntParams, prefix: str, get: Get) -> PackedInt:
    """`prefix`.qweight [K, out/8] / qzeros [G, out/8] / scales [G, out], AWQ's nibble order."""
    if params.bits != 4 or params.sym:
        raise ValueError(f"{prefix}qweight: AWQ GEMM weights are 4-bit with zero points, not {params.name}")
    qweight = get(prefix + "qweight")
    if qweight.dim() != 2 or qweight.dtype != torch.int32:
        raise ValueError(f"{prefix}qweight: expected a 2-d int32 tensor, got {tuple(qweight.shape)} {qweight.dtype}")
    k, out = qweight.shape[0], qweight.shape[1] * 8
    g = _groups_of(params, k, prefix + "qweight")
    qzeros, scales = get(prefix + "qzeros"), get(prefix + "scales")
    _expect(qzeros, prefix + "qzeros", (g, out // 8), (torch.int32,))
    _expect(scales, prefix + "scales", (g, out), _FLOATS)
    undo = torch.tensor(AWQ_UNDO)

    def natural(words: torch.Tensor) -> torch.Tensor:  # [R, out/8] AWQ words -> [R, out] codes
        nib = unpack_codes(words, 4).unflatten(-1, (-1, 8))  # [R, out/8, 8] in nibble order
        return nib[..., undo].flatten(-2)

    codes = natural(qweight).T.contiguous()  # [out, K]
    zeros = natural(qzeros).T.to(torch.uint8).contiguous()  # [out, G]
    return PackedInt(params, pack_codes(codes, 4), scales.T.float().contiguous(), zeros, None)


def from_gptq(params: IntParams, prefix: str, get: Get, names: set[str], zeros_minus_one: bool) -> PackedInt:
    """`prefix`.qweight [K/P, out] / qzeros [G, out/P] / scales [G, out] / g_idx [K]."""
    qweight = get(prefix + "qweight")
    if qweight.dim() != 2 or qweight.dtype != torch.int32:
        raise ValueError(f"{prefix}qweight: expected a 2-d int32 tensor, got {tuple(qweight.shape)} {qweight.dtype}")
    per = params.per_word
    k, out = qweight.shape[0] * per, qweight.shape[1]
    g = _groups_of(params, k, prefix + "qweight")
    qzeros, scales = get(prefix + "qzeros"), get(prefix + "scales")
    if out % per:
        raise ValueError(f"{prefix}qweight: {out} outputs do not pack into qzeros words of {per}")
    _expect(qzeros, prefix + "qzeros", (g, out // per), (torch.int32,))
    _expect(scales, prefix + "scales", (g, out), _FLOATS)
    zeros = unpack_codes(qzeros, params.bits).T + int(zeros_minus_one)  # [out, G]
    g_idx = get(prefix + "g_idx") if prefix + "g_idx" in names else None
    gidx = _act_gidx(params, g_idx, k, g, prefix + "g_idx")
    return PackedInt(params, qweight.T.contiguous(), scales.T.float().contiguous(),
                     _sym_zeros(params, zeros, prefix + "qzeros"), gidx)


def random_packed(params: IntParams, out: int, k: int, generator: torch.Generator | None = None,
                  device: torch.device | str = "cpu", lead: tuple[int, ...] = ()) -> PackedInt:
    """A valid random linear [out, K] (dummy weights), or a stack [*lead, out, K] of them: codes from
    intq.random_words (symmetric about the midpoint), values of std ~ 1/sqrt(K)."""
    params.check_k(k, "input dim")
    gdev = generator.device if generator is not None else torch.device(device)
    g = params.groups(k)
    q = random_words((*lead, out, k // params.per_word), params.bits, generator, gdev)
    jitter = torch.randint(-1, 2, (*lead, out, g), generator=generator, device=gdev).float()
    s = torch.exp2(jitter) / (CODE_RMS[params.bits] * math.sqrt(k))
    mid = 1 << (params.bits - 1)
    z = None if params.sym else torch.randint(mid - 1, mid + 2, (*lead, out, g), generator=generator, device=gdev,
                                              dtype=torch.uint8)
    gidx = None
    if params.act:
        gidx = torch.stack([random_gidx(k, params.group, generator, gdev) for _ in range(math.prod(lead))])
        gidx = gidx.view(*lead, k)
    to = lambda t: None if t is None else t.to(device)  # noqa: E731
    return PackedInt(params, to(q), to(s), to(z), to(gidx))
