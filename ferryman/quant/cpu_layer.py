"""One MoE layer's experts on the CPU in one call of the C kernel (quant/cpu_kernel.py): `LayerJob`.

A format the kernel covers names its banks here (`BANKS`: weights, and scales or None, of w13 and w2;
`PACKED_BANKS` per family of the packed formats, with zeros) and its decoders in csrc/cpu_experts.c
(`KERNEL_FORMATS` and `packed_codes` in cpu_kernel.py give its codes). `kernel_reads` says whether a
layer's banks go through the kernel.
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch

from ferryman.quant.base import get_format
from ferryman.quant.cpu_kernel import (ACTIVATIONS, ISAS, Pairs, available, format_code, need_library, packed_codes,
                                       product_code, threads)

# format -> (w13 weights, w13 scales, w2 weights, w2 scales); the weights' leading dims are [E, rows]
BANKS = {"mxfp4": ("w13_blocks", "w13_scales", "w2_blocks", "w2_scales"), "dense": ("w13", None, "w2", None)}
# family of the packed formats (cpu_kernel.packed_codes) -> (w13 weights, scales, zeros, w2 weights,
# scales, zeros; nvfp4: global scales for zeros); a bank absent from a layer (symmetric int: no zeros)
# is passed as NULL
PACKED_BANKS = {"gguf": ("w13_q", None, None, "w2_q", None, None),
                "int4": ("w13_qweight", "w13_scales", "w13_zeros", "w2_qweight", "w2_scales", "w2_zeros"),
                "int8": ("w13_qweight", "w13_scales", "w13_zeros", "w2_qweight", "w2_scales", "w2_zeros"),
                "fp8": ("w13", "w13_scale", None, "w2", "w2_scale", None),
                "nvfp4": ("w13_packed", "w13_scale", "w13_gscale", "w2_packed", "w2_scale", "w2_gscale"),
                "nvfp4-ct": ("w13_packed", "w13_scale", "w13_gscale", "w2_packed", "w2_scale", "w2_gscale")}
BankNames = tuple[str | None, str | None, str | None, str | None, str | None, str | None]


def bank_names(fmt: str) -> BankNames | None:
    """(w13 weights, scales, zeros, w2 weights, scales, zeros) of a format the kernel reads, else None."""
    if fmt in BANKS:
        w13, s13, w2, s2 = BANKS[fmt]
        return w13, s13, None, w2, s2, None
    return PACKED_BANKS[fmt.partition(":")[0]] if packed_codes(fmt) is not None else None


def kernel_reads(fmt: str, banks: dict[str, torch.Tensor]) -> bool:
    """Whether the C kernel computes a layer of format `fmt` held in `banks` (when it is built)."""
    names = bank_names(fmt)
    return names is not None and names[0] in banks and available(fmt, banks[names[0]].dtype)


def layer_dims(fmt: str, banks: dict[str, torch.Tensor]) -> tuple[int, int]:
    """(hidden H, FFN width I) of a layer's banks in format `fmt`."""
    if fmt not in BANKS:  # packed: the format's own reading of its banks
        return get_format(fmt).dims(banks)[1:]
    w13 = banks[BANKS[fmt][0]]
    hidden = w13.shape[2] * 32 if fmt == "mxfp4" else w13.shape[2]
    return hidden, w13.shape[1] // 2


class LayerJob:
    """Several experts of one layer, each on its own tokens, weighted and summed in fp32 (the math of
    fused_moe) in one kernel call, `run`, which holds no Python lock while it computes; the arguments
    are prepared here, on the caller's thread. x: [T, H]; pairs: `pairs_of`; fmt: the banks' format;
    bias: fp32 copies of the bias rows by (layer, expert, bank), kept by a caller that runs the same
    layers again (None: converted for this job only)."""

    def __init__(self, x: torch.Tensor, banks: dict[str, torch.Tensor], layer: int, pairs: Pairs, kind: str,
                 alpha: float, limit: float, bias: dict[tuple[int, int, str], torch.Tensor] | None = None,
                 fmt: str = "mxfp4") -> None:
        if kind not in ACTIVATIONS:
            raise ValueError(f"LayerJob: activation must be one of {', '.join(ACTIVATIONS)}, got {kind!r}")
        names = bank_names(fmt)
        if names is None or format_code(fmt, banks[names[0]].dtype) is None:
            raise ValueError(f"LayerJob: no CPU kernel for {fmt} experts")
        self.lib = need_library(None)
        packed = packed_codes(fmt)
        code = product_code(fmt, banks[names[0]].dtype, x.dtype, self.lib)
        self.code13, self.code2, self.group = packed if packed is not None else (code, code, 0)
        self.x = x.float().contiguous()  # [T, H]
        hidden, self.inter = layer_dims(fmt, banks)
        if self.x.dim() != 2 or self.x.shape[1] != hidden:
            raise ValueError(f"LayerJob: x {tuple(x.shape)} does not match the experts' hidden size {hidden}")
        _check_w2(fmt, banks, names, hidden, self.inter)
        bias = {} if bias is None else bias
        experts = sorted(pairs)
        self.n = len(experts)
        self.keep: list[torch.Tensor] = []  # what the pointers below point into, alive until run
        arrays = ("w13", "s13", "z13", "w2", "s2", "z2", "b13", "b2")
        self.arrays = {name: (ctypes.c_void_p * max(1, self.n))() for name in arrays}
        for name, bank in zip(arrays[:6], names):
            if bank is not None and bank in banks:
                self.arrays[name][:self.n] = self._pointers(banks[bank], experts)
        for i, e in enumerate(experts):
            for name, bank in (("b13", "w13_bias"), ("b2", "w2_bias")):
                if bank in banks:
                    if (layer, e, bank) not in bias:
                        bias[(layer, e, bank)] = banks[bank][e].float().contiguous()
                    self.keep.append(bias[(layer, e, bank)])  # the caller's dict may be this call's only
                    self.arrays[name][i] = self._pointer(self.keep[-1])
        # numpy arrays, their addresses passed on (the kernel reads them during run)
        self.offsets = np.zeros(self.n + 1, dtype=np.int64)
        self.offsets[1:] = np.cumsum([len(pairs[e][0]) for e in experts], dtype=np.int64)
        self.num_pairs = int(self.offsets[-1])
        self.tokens = np.concatenate([np.asarray(pairs[e][0], dtype=np.int64) for e in experts] or [[0]])
        self.weights = np.concatenate([np.asarray(pairs[e][1], dtype=np.float32) for e in experts] or [[0.0]])
        self.kind, self.alpha, self.limit = ACTIVATIONS[kind], alpha, limit
        self.threads = threads()

    def _pointers(self, bank: torch.Tensor, experts: list[int]) -> list[int]:
        """Addresses of bank[e] for each e of experts: by stride arithmetic when an expert's slice is
        one contiguous block (every bank the stores make), else through `_pointer` (a copy each)."""
        if bank.device.type != "cpu":
            raise ValueError(f"LayerJob: expert banks must be in host memory, got {bank.device}")
        if bank.is_contiguous() or bank.shape[0] and bank[0].is_contiguous():  # the first test costs no view
            base, step = bank.data_ptr(), bank.stride(0) * bank.element_size()
            return [base + e * step for e in experts]
        return [self._pointer(bank[e]) for e in experts]

    def _pointer(self, t: torch.Tensor) -> int:
        """Address of t's data, copied first if it is not one contiguous block on the host."""
        if t.device.type != "cpu":
            raise ValueError(f"LayerJob: expert banks must be in host memory, got {t.device}")
        if not t.is_contiguous():
            t = t.contiguous()
            self.keep.append(t)
        return t.data_ptr()

    def run(self, isa: str = "avx512bf16") -> torch.Tensor:
        """The [T, H] fp32 sum of the experts' weighted outputs. isa: the most the kernel may use
        (tests compare the instruction sets)."""
        out = torch.zeros_like(self.x)
        a = self.arrays
        rc = self.lib.ferryman_cpu_experts(
            self.code13, self.code2, self.group, self.x.data_ptr(), self.x.shape[0], self.x.shape[1], self.inter,
            self.n, a["w13"], a["s13"], a["z13"], a["b13"], a["w2"], a["s2"], a["z2"], a["b2"],
            self.offsets.ctypes.data, self.tokens.ctypes.data, self.weights.ctypes.data, self.kind, self.alpha,
            self.limit, out.data_ptr(), self.threads, ISAS[isa])
        if rc != 0:
            raise RuntimeError(f"CPU experts kernel failed (code {rc}: -1 out of memory or bad sizes, -2 a token "
                               "out of range)")
        return out


def _check_w2(fmt: str, banks: dict[str, torch.Tensor], names: BankNames, hidden: int, inter: int) -> None:
    """ValueError unless every bank of the layer has the shape hidden and inter give it."""
    if fmt in BANKS:
        w2 = banks[BANKS[fmt][2]]
        if w2.shape[1] != hidden or layer_dims(fmt, {BANKS[fmt][0]: w2})[0] != inter:
            raise ValueError(f"LayerJob: {BANKS[fmt][2]} {tuple(w2.shape)} does not match hidden {hidden} and "
                             f"FFN {inter}")
        return
    num = banks[names[0]].shape[0]
    for name, spec in get_format(fmt).weight_specs(num, hidden, inter, torch.float32).items():
        got = banks.get(name)
        if got is not None and (tuple(got.shape[1:]) != tuple(spec.shape[1:]) or got.dtype != spec.dtype):
            raise ValueError(f"LayerJob: {name} {tuple(got.shape)} {got.dtype} does not match hidden {hidden} and "
                             f"FFN {inter} ({fmt}: expected {tuple(spec.shape)} {spec.dtype})")
