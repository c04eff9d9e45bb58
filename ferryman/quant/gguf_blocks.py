"""GGUF (ggml) block types: sizes, the torch reference dequantiser and valid random blocks.

A row of K values of type T is K / block_size(T) blocks of type_size(T) bytes, back to back; each
block's layout is ggml's (ggml-common.h). `dequant_rows` returns, bit for bit, what gguf-py's
`gguf.quants.dequantize` returns: every value is a product of a fp16 scale and small integers,
exact in fp32, minus/plus at most one other exact product (one rounding), so the order of the
operations (and any fused multiply-add a kernel uses) cannot change a bit.
"""

from __future__ import annotations

import math
import warnings
from functools import lru_cache

import numpy as np
import torch

QK_K = 256
# type -> (values per block, bytes per block), as gguf.constants.GGML_QUANT_SIZES
BLOCK_SIZES: dict[str, tuple[int, int]] = {
    "f32": (1, 4), "f16": (1, 2), "bf16": (1, 2),
    "q8_0": (32, 34), "q4_0": (32, 18), "q4_1": (32, 20), "q5_0": (32, 22), "q5_1": (32, 24),
    "q2_k": (256, 84), "q3_k": (256, 110), "q4_k": (256, 144), "q5_k": (256, 176), "q6_k": (256, 210),
    "iq4_nl": (32, 18), "iq4_xs": (256, 136), "mxfp4": (32, 17),
}
GGUF_TYPES = tuple(BLOCK_SIZES)
IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
MXFP4_VALUES2 = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)  # e2m1 values x 2


def check_type(gtype: str) -> str:
    """The lower-case ggml type name, or a ValueError naming it."""
    name = gtype.lower()
    if name not in BLOCK_SIZES:
        raise ValueError(f"unsupported GGUF tensor type {gtype!r}; supported: {', '.join(GGUF_TYPES)}")
    return name


def block_size(gtype: str) -> int:
    return BLOCK_SIZES[check_type(gtype)][0]


def type_size(gtype: str) -> int:
    return BLOCK_SIZES[check_type(gtype)][1]


def row_bytes(gtype: str, k: int, what: str = "input dim") -> int:
    """Bytes of a row of k values of `gtype`; ValueError unless k is a whole number of blocks."""
    bs, ts = BLOCK_SIZES[check_type(gtype)]
    if k <= 0 or k % bs:
        raise ValueError(f"{what} {k} is not a positive multiple of the {gtype} block size {bs}")
    return k // bs * ts


def rows_from_numpy(data: np.ndarray, gtype: str) -> torch.Tensor:
    """A GGUF tensor's data as gguf-py reads it ([..., K] for float types, [..., bytes] for block
    types, usually a read-only memory map) -> uint8 [rows, row_bytes] sharing its memory (no copy)."""
    raw = data.view(np.uint8)
    last = raw.shape[-1] if raw.ndim else raw.size
    if last % type_size(gtype):
        raise ValueError(f"GGUF {gtype} data: {last} bytes per row is not a multiple of {type_size(gtype)}")
    raw = raw.reshape(-1, last)
    if not raw.flags.c_contiguous:
        raise ValueError(f"GGUF {gtype} data is not contiguous")
    with warnings.catch_warnings():  # a read-only map: ferryman only reads it (and copies out)
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(raw)


def _f16(b: torch.Tensor, off: int) -> torch.Tensor:
    """fp16 field at byte `off` of each block [N, TS] -> fp32 [N, 1]."""
    return b[:, off:off + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """bytes [N, ..., n] -> [N, ..., 2n] uint8: the n low nibbles, then the n high nibbles."""
    return torch.cat((qs & 0xF, qs >> 4), dim=-1)


@lru_cache(maxsize=32)
def _shifts(values: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """uint8 shift amounts [len(values)] on `device` (the decoders stay in uint8: CPU-fast)."""
    return torch.tensor(values, dtype=torch.uint8, device=device)


def _byte_bits(b: torch.Tensor) -> torch.Tensor:
    """bytes [N, ..., n] -> uint8 [N, ..., 8, n]: bit i of every byte at index i."""
    return (b.unsqueeze(-2) >> _shifts(tuple(range(8)), b.device)[:, None]) & 1


def _bits(b: torch.Tensor, count: int) -> torch.Tensor:
    """little-endian bit i of bytes [N, count/8] for i < count -> uint8 [N, count]."""
    q = b[:, :, None] >> _shifts(tuple(range(8)), b.device)
    return (q & 1).reshape(b.shape[0], count)


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    return _f16(b, 0) * (_nibbles(b[:, 2:18]).float() - 8)


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    # d x q + m: d x q is exact, so a fused multiply-add rounds as the two operations do
    return torch.addcmul(_f16(b, 2), _f16(b, 0), _nibbles(b[:, 4:20]).float())


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    q = _nibbles(b[:, 6:22]) | (_bits(b[:, 2:6], 32) << 4)
    return _f16(b, 0) * (q.float() - 16)


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    q = _nibbles(b[:, 8:24]) | (_bits(b[:, 4:8], 32) << 4)
    return torch.addcmul(_f16(b, 2), _f16(b, 0), q.float())


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    return _f16(b, 0) * b[:, 2:34].contiguous().view(torch.int8).float()


def _crumbs(qs: torch.Tensor, n: int) -> torch.Tensor:
    """2-bit fields: bytes [N, n*32] -> uint8 [N, n*128]; 32-byte chunk c, shift s -> values
    (c*4 + s/2)*32 .. +32 (ggml's order)."""
    q = qs.reshape(qs.shape[0], n, 1, 32) >> _shifts((0, 2, 4, 6), qs.device)[:, None]
    return (q & 3).reshape(qs.shape[0], n * 128)


def _q2_k(b: torch.Tensor) -> torch.Tensor:
    n, sc = b.shape[0], b[:, 0:16]
    dl = (_f16(b, 80) * (sc & 0xF).float()).reshape(n, 16, 1)
    ml = (_f16(b, 82) * (sc >> 4).float()).reshape(n, 16, 1)
    q = _crumbs(b[:, 16:80], 2).reshape(n, 16, 16).float()
    return torch.addcmul(-ml, dl, q).reshape(n, QK_K)


def _q3_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    low = _nibbles(b[:, 96:104])  # [N, 16] scale bits 0..3
    high = b[:, None, 104:108] >> _shifts((0, 2, 4, 6), b.device)[:, None]  # [N, 4, 4]
    sc = low | ((high.reshape(n, 16) & 3) << 4)  # [N, 16]
    dl = (_f16(b, 108) * (sc.float() - 32)).reshape(n, 16, 1)
    hbit = _byte_bits(b[:, 0:32]).reshape(n, 16, 16)  # [N, 8, 32] bit i of byte l
    q = _crumbs(b[:, 32:96], 2).reshape(n, 16, 16).float() - ((hbit ^ 1) << 2).float()
    return (dl * q).reshape(n, QK_K)


def k_scale_min(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K 12 scale bytes [N, 12] -> (scales [N, 8], mins [N, 8]) int32, 6 bits each."""
    s = s.to(torch.int32)
    d, m, md = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat((d & 0x3F, (md & 0xF) | ((d >> 2) & 0x30)), dim=1)
    mn = torch.cat((m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)), dim=1)
    return sc, mn


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    sc, mn = k_scale_min(b[:, 4:16])
    d = (_f16(b, 0) * sc.float()).reshape(n, 8, 1)
    dm = (_f16(b, 2) * mn.float()).reshape(n, 8, 1)
    q = _nibbles(b[:, 16:144].reshape(n, 4, 32)).reshape(n, 8, 32).float()
    return torch.addcmul(-dm, d, q).reshape(n, QK_K)


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    sc, mn = k_scale_min(b[:, 4:16])
    d = (_f16(b, 0) * sc.float()).reshape(n, 8, 1)
    dm = (_f16(b, 2) * mn.float()).reshape(n, 8, 1)
    hm = _byte_bits(b[:, 16:48])  # [N, 8, 32] bit i of byte l: element 32 i + l's 5th bit
    q = _nibbles(b[:, 48:176].reshape(n, 4, 32)).reshape(n, 8, 32) | (hm << 4)
    return torch.addcmul(-dm, d, q.float()).reshape(n, QK_K)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d = (_f16(b, 208) * b[:, 192:208].contiguous().view(torch.int8).float()).reshape(n, 16, 1)
    ql = _nibbles(b[:, 0:128].reshape(n, 2, 64)).reshape(n, 8, 32)
    qh = _crumbs(b[:, 128:192], 2).reshape(n, 8, 32)
    q = (ql | (qh << 4)).reshape(n, 16, 16).float() - 32
    return (d * q).reshape(n, QK_K)


@lru_cache(maxsize=16)
def _lut(values: tuple[int, ...], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device)


def _iq4_nl(b: torch.Tensor) -> torch.Tensor:
    return _f16(b, 0) * _lut(IQ4_VALUES, b.device)[_nibbles(b[:, 2:18]).long()]


def _iq4_xs(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    hi = b[:, 2:4].contiguous().view(torch.int16).to(torch.int32) & 0xFFFF  # [N, 1]
    hi = (hi >> torch.arange(0, 16, 2, device=b.device)[None, :]) & 3  # [N, 8]
    lo = b[:, 4:8].to(torch.int32)
    lo = torch.stack((lo & 0xF, lo >> 4), dim=-1).reshape(n, 8)
    dl = (_f16(b, 0) * ((lo | (hi << 4)) - 32).float()).reshape(n, 8, 1)
    q = _nibbles(b[:, 8:136].reshape(n, 8, 16)).long()  # [N, 8, 32]
    return (dl * _lut(IQ4_VALUES, b.device)[q]).reshape(n, QK_K)


def e8m0_half(e: torch.Tensor) -> torch.Tensor:
    """ggml_e8m0_to_fp32_half: e8m0 bytes (int32) -> 2^(e-128) in fp32, exactly (from its bits)."""
    bits = torch.where(e < 2, 0x00200000 << e, (e - 1) << 23)
    return bits.to(torch.int32).view(torch.float32)


def _mxfp4(b: torch.Tensor) -> torch.Tensor:
    d = e8m0_half(b[:, 0:1].to(torch.int32))
    return d * _lut(MXFP4_VALUES2, b.device)[_nibbles(b[:, 1:17]).long()]


_DEQUANT = {"q4_0": _q4_0, "q4_1": _q4_1, "q5_0": _q5_0, "q5_1": _q5_1, "q8_0": _q8_0, "q2_k": _q2_k,
            "q3_k": _q3_k, "q4_k": _q4_k, "q5_k": _q5_k, "q6_k": _q6_k, "iq4_nl": _iq4_nl,
            "iq4_xs": _iq4_xs, "mxfp4": _mxfp4}


def dequant_rows(raw: torch.Tensor, gtype: str) -> torch.Tensor:
    """raw uint8 [..., nbytes] (whole blocks of `gtype`) -> fp32 [..., K], as gguf-py dequantises."""
    bs, ts = BLOCK_SIZES[check_type(gtype)]
    if raw.dtype != torch.uint8 or raw.dim() == 0 or raw.shape[-1] % ts:
        raise ValueError(f"GGUF {gtype} rows: expected uint8 [..., a multiple of {ts} bytes], "
                         f"got {tuple(raw.shape)} {raw.dtype}")
    lead, nbytes = raw.shape[:-1], raw.shape[-1]
    raw = raw.contiguous()
    if gtype.lower() in ("f32", "f16", "bf16"):
        vals = raw.view({"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}[gtype.lower()])
        return vals.float()
    blocks = raw.reshape(-1, ts)  # [N, TS]
    return _DEQUANT[gtype.lower()](blocks).reshape(*lead, nbytes // ts * bs)


# fp16 fields of a block: (byte offset, value relative to d); the second one (dmin, m) centres the
# random values on zero: q4_1/q5_1 add m = -d x mean code, K-quants subtract dmin x mean code x min
_FP16_FIELDS: dict[str, tuple[tuple[int, float], ...]] = {
    "q4_0": ((0, 1.0),), "q5_0": ((0, 1.0),), "q8_0": ((0, 1.0),), "iq4_nl": ((0, 1.0),),
    "q4_1": ((0, 1.0), (2, -7.5)), "q5_1": ((0, 1.0), (2, -15.5)), "q2_k": ((80, 1.0), (82, 1.5)),
    "q3_k": ((108, 1.0),), "q4_k": ((0, 1.0), (2, 7.5)), "q5_k": ((0, 1.0), (2, 15.5)),
    "q6_k": ((208, 1.0),), "iq4_xs": ((0, 1.0),),
}


def _set_scales(blocks: torch.Tensor, gtype: str, d: torch.Tensor) -> None:
    """Write d [N] (and its related fields) into blocks [N, TS] as fp16, in place."""
    for off, rel in _FP16_FIELDS[gtype]:
        blocks[:, off:off + 2] = (d * rel).to(torch.float16).view(torch.uint8).reshape(-1, 2)


@lru_cache(maxsize=None)
def _unit_rms(gtype: str) -> float:
    """rms of the values of random blocks whose d is 1 (a fixed sample of 256 blocks)."""
    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (256, type_size(gtype)), generator=gen, dtype=torch.uint8)
    _set_scales(blocks, gtype, torch.ones(256))
    return dequant_rows(blocks, gtype).pow(2).mean().sqrt().item()


def random_rows(gtype: str, shape: tuple[int, ...] | torch.Size, generator: torch.Generator | None = None,
                device: torch.device | str = "cpu") -> torch.Tensor:
    """Valid random rows of logical `shape` [..., K] -> uint8 [..., row_bytes]: uniform codes and
    sub-scales, finite fp16 scales (jittered by 2^[-1/2, 1/2) per block) giving values of std about
    1/sqrt(K), centred on zero; float types: randn / sqrt(K)."""
    gtype = check_type(gtype)
    *lead, k = shape
    nbytes = row_bytes(gtype, k, "row length")
    gen_device = generator.device if generator is not None else torch.device(device)
    if gtype in ("f32", "f16", "bf16"):
        w = torch.randn((*lead, k), generator=generator, device=gen_device) / math.sqrt(k)
        w = w.to({"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}[gtype])
        return w.view(torch.uint8).to(device)
    bs, ts = BLOCK_SIZES[gtype]
    n = math.prod(lead) * (k // bs)
    blocks = torch.randint(0, 256, (n, ts), generator=generator, dtype=torch.uint8, device=gen_device)
    jitter = torch.exp2(torch.rand(n, generator=generator, device=gen_device) - 0.5)
    if gtype == "mxfp4":  # e8m0 exponent: 2^(e-127) x e2m1 code
        rms = _unit_rms_mxfp4() * math.sqrt(k)
        blocks[:, 0] = (127 - torch.round(torch.log2(rms / jitter))).clamp(1, 254).to(torch.uint8)
    else:
        _set_scales(blocks, gtype, jitter / (math.sqrt(k) * _unit_rms(gtype)))
    return blocks.reshape(*lead, nbytes).to(device)


def _unit_rms_mxfp4() -> float:
    return math.sqrt(sum((v / 2) ** 2 for v in MXFP4_VALUES2) / 16)


def ggml_mxfp4_to_blocks_scales(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ggml MXFP4 rows uint8 [..., G*17] (per block: e8m0 byte, then 16 bytes whose low nibbles are
    elements 0..15 and high nibbles 16..31) -> ferryman `mxfp4` (blocks [..., G, 16] with elements
    2j, 2j+1 in byte j's low, high nibble; scales [..., G]). Lossless: both read code c of block
    exponent e as e2m1(c) x 2^(e-127)."""
    if raw.dtype != torch.uint8 or raw.dim() == 0 or raw.shape[-1] % 17:
        raise ValueError(f"GGML MXFP4 rows: expected uint8 [..., a multiple of 17 bytes], got "
                         f"{tuple(raw.shape)} {raw.dtype}")
    b = raw.reshape(*raw.shape[:-1], raw.shape[-1] // 17, 17)  # [..., G, 17]
    scales = b[..., 0].contiguous()
    qs = b[..., 1:]
    codes = torch.cat((qs & 0xF, qs >> 4), dim=-1)  # [..., G, 32] element order
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks.contiguous(), scales
