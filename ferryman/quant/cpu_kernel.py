"""Routed experts multiplied on the CPU straight from their packed bytes: `LayerJob` (several experts
of one layer in one call: fused_moe's CPU path, the hybrid split's CPU part, the `cpu` and `layers`
strategies) and `matmul` (one product x @ W^T: tests and benchmarks).

The C kernel (csrc/cpu_experts.c) has decoders per format (`KERNEL_FORMATS`: MXFP4, and dense
bf16 / fp32 / fp16 banks; `packed_codes`: GGUF q8_0 / q4_k / q6_k, int4 / int8 with group scales, fp8,
nvfp4) and one OpenMP region per layer, rows of all the layer's experts split between the threads. It
picks AVX-512, AVX2 or its portable loop at run time from CPUID, so one build runs anywhere. It is
built at first use with `$CC` (else `cc`) into the cache directory, keyed by the sources, the flags
and the machine, and loaded with ctypes. No compiler or a failed build: one warning saying why, and
callers keep the torch path. FERRYMAN_KERNELS=torch turns it off.
"""

from __future__ import annotations

from collections.abc import Sequence

import ctypes
import hashlib
import itertools
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch

from ferryman.envs import envs
from ferryman.quant.gguf_blocks import block_size, type_size
from ferryman.quant.intq import parse_name

log = logging.getLogger("ferryman.quant")

CSRC = Path(__file__).parent / "csrc"
SOURCE = CSRC / "cpu_experts.c"
# tried in order: the first that builds is used (no OpenMP: one thread)
FLAG_SETS = (("-O3", "-fopenmp"), ("-O3",))
# at most this instruction set (the CPU's own decides); avx512bf16 adds vdpbf16ps for bf16 x bf16
ISAS = {"avx512bf16": 3, "avx512": 2, "avx2": 1, "portable": 0}
# (format name, bank dtype or None for any) -> the C kernel's format code
KERNEL_FORMATS = {("mxfp4", None): 0, ("dense", torch.bfloat16): 1, ("dense", torch.float32): 2,
                  ("dense", torch.float16): 3}
BF16_TIMES_BF16 = 4  # dense bf16 weights times activations that were bf16: AVX512-BF16's dot product
# packed formats (tile decoders: csrc/cpu_experts_packed.h; row decoders: cpu_experts_rows512.h, rows256.h, fp256.h)
GGUF_CODES = {"q8_0": 5, "q4_k": 6, "q6_k": 7}
INT_CODES = {4: 8, 8: 9}
FP8_CODE = 10  # e4m3 with a scale per row or per square block
NVFP4_CODES = {"nvfp4": 11, "nvfp4-ct": 12}  # code x (scale x g), code x (scale / g)


@lru_cache(maxsize=None)  # a pure function of the name, asked on every CPU MoE call
def packed_codes(fmt: str) -> tuple[int, int, int] | None:
    """(w13 code, w2 code, inputs per scale group; 0: one group per row) of a packed format name the
    kernel reads: `gguf:<t13>:<t2>` of GGUF_CODES types, `int4|int8:<g<n>|ch>:<sym|asym>` (act-order
    ones, with a group index per input, keep the torch path), `fp8:channel` and `fp8:<b>x<b>` (square
    blocks; others keep the torch path), `nvfp4` and `nvfp4-ct`; None for any other."""
    if fmt in NVFP4_CODES:
        return NVFP4_CODES[fmt], NVFP4_CODES[fmt], 0
    family, _, rest = fmt.partition(":")
    if family == "gguf":
        t13, _, t2 = rest.partition(":")
        return (GGUF_CODES[t13], GGUF_CODES[t2], 0) if t13 in GGUF_CODES and t2 in GGUF_CODES else None
    if family in ("int4", "int8"):
        try:
            params = parse_name(fmt)
        except ValueError:
            return None
        return None if params.act else (INT_CODES[params.bits], INT_CODES[params.bits], params.group)
    if family == "fp8":
        bn, _, bk = rest.partition("x")
        if rest == "channel":
            return FP8_CODE, FP8_CODE, 0
        return (FP8_CODE, FP8_CODE, int(bn)) if bn.isdigit() and bn == bk and int(bn) > 0 else None
    return None


def product_code(fmt: str, dtype: torch.dtype, x_dtype: torch.dtype, lib: ctypes.CDLL | None = None) -> int | None:
    """The kernel's code for experts of `fmt` (weight bank `dtype`) times activations of `x_dtype`:
    bf16 x bf16 goes through vdpbf16ps where the CPU has it (rounding bf16 values to bf16 is exact),
    else as format_code says."""
    if (fmt, dtype, x_dtype) == ("dense", torch.bfloat16, torch.bfloat16) and isa_name(lib) == "avx512bf16":
        return BF16_TIMES_BF16
    return format_code(fmt, dtype)


def format_code(fmt: str, dtype: torch.dtype) -> int | None:
    """The C kernel's code for experts of format `fmt` whose weight bank has `dtype` (None: not covered);
    packed formats: their w13 code (`packed_codes`)."""
    packed = packed_codes(fmt)
    if packed is not None:
        return packed[0]
    return KERNEL_FORMATS.get((fmt, None), KERNEL_FORMATS.get((fmt, dtype)))


def cache_dir() -> Path:
    """Where built kernels are kept: $XDG_CACHE_HOME/ferryman, or ~/.cache/ferryman."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "ferryman"


def _sources(csrc: Path) -> bytes:
    return b"".join(p.read_bytes() for p in sorted(csrc.glob("cpu_experts*")))


def _compile(cc: str, flags: tuple[str, ...], out: Path, csrc: Path) -> str | None:
    """Build the library at `out` (atomically); None on success, else the compiler's complaint."""
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    cmd = [cc, *flags, "-shared", "-fPIC", "-o", tmp, str(csrc / SOURCE.name), "-lm"]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    except (OSError, subprocess.TimeoutExpired) as e:
        os.unlink(tmp)
        return f"{' '.join(cmd)}: {e}"
    if done.returncode != 0:
        os.unlink(tmp)
        return f"{' '.join(cmd)}: {done.stderr.strip()[-400:]}"
    os.replace(tmp, out)  # concurrent builders each write their own file; the last rename wins
    return None


def _library_path(cc: str, flags: tuple[str, ...], csrc: Path) -> Path:
    key = hashlib.sha256(_sources(csrc) + repr((cc, flags, platform.machine(), platform.node())).encode())
    return cache_dir() / f"cpu_experts-{key.hexdigest()[:16]}.so"


def build(openmp: bool = True, csrc: Path = CSRC) -> tuple[ctypes.CDLL | None, str]:
    """(the loaded library or None, how it was built or why not). openmp False: the one-thread build;
    csrc: the folder of the sources (benchmarks build another tree's kernel beside this one)."""
    cc = os.environ.get("CC") or "cc"
    if shutil.which(cc) is None:
        return None, f"no C compiler ({cc!r} is not on PATH; set CC)"
    errors = []
    for flags in FLAG_SETS:
        if not openmp and "-fopenmp" in flags:
            continue
        path = _library_path(cc, flags, csrc)
        error = None if path.exists() else _compile(cc, flags, path, csrc)
        if error is None:
            lib = ctypes.CDLL(str(path))
            _declare(lib)
            return lib, f"{cc} {' '.join(flags)}"
        errors.append(error)
    return None, "the build failed: " + " | ".join(errors)


def _declare(lib: ctypes.CDLL) -> None:
    i64, ptr, c_int, c_float = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_float
    pp = ctypes.POINTER(ctypes.c_void_p)
    lib.ferryman_cpu_matmul.argtypes = [c_int, i64, ptr, i64, i64, ptr, ptr, ptr, i64, ptr, c_int, c_int]
    lib.ferryman_cpu_matmul.restype = c_int
    lib.ferryman_cpu_experts.argtypes = [c_int, c_int, i64, ptr, i64, i64, i64, i64, pp, pp, pp, pp, pp, pp, pp, pp,
                                         ptr, ptr, ptr, c_int, c_float, c_float, ptr, c_int, c_int]
    lib.ferryman_cpu_experts.restype = c_int
    lib.ferryman_cpu_isa.restype = c_int
    lib.ferryman_cpu_has_openmp.restype = c_int


@lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    try:
        lib, how = build()
    except OSError as e:  # an unwritable cache directory, a library that does not load
        lib, how = None, f"{type(e).__name__}: {e}"
    if lib is None:
        log.warning("CPU expert kernel unavailable (%s): experts on the CPU use the slower torch path", how)
    else:
        log.info("CPU expert kernel built (%s; %s, OpenMP %s)", how, isa_name(lib),
                 "yes" if lib.ferryman_cpu_has_openmp() else "no")
    return lib


def isa_name(lib: ctypes.CDLL | None = None) -> str:
    """The instruction set the kernel runs here: avx512bf16, avx512, avx2 or portable ("none": not built)."""
    lib = lib or (_library() if envs.KERNELS != "torch" else None)
    if lib is None:
        return "none"
    return {v: k for k, v in ISAS.items()}[lib.ferryman_cpu_isa()]


def available(fmt: str = "mxfp4", dtype: torch.dtype = torch.uint8) -> bool:
    """Whether experts of format `fmt` (weight bank dtype `dtype`) on the CPU go through the C kernel."""
    return format_code(fmt, dtype) is not None and envs.KERNELS != "torch" and _library() is not None


def threads() -> int:
    """torch's thread count, less one when this process drives a GPU: its thread needs a core, and
    one preempted OpenMP thread stalls the whole product."""
    n = torch.get_num_threads()
    return n - 1 if n > 2 and torch.cuda.is_initialized() else n


def need_library(lib: ctypes.CDLL | None) -> ctypes.CDLL:
    lib = lib or _library()
    if lib is None:
        raise RuntimeError("the CPU expert kernel is unavailable (see the warning logged when it was built)")
    return lib


def matmul(x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor | None = None, fmt: str = "mxfp4",
           isa: str = "avx512bf16", lib: ctypes.CDLL | None = None, x_bf16: bool = False,
           zeros: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, K] fp32 @ W^T -> [T, N] fp32. mxfp4: w = blocks [N, K/32, 16] uint8, scales [N, K/32];
    dense: w = [N, K] bf16/fp32/fp16; packed formats (`packed_codes`; their w13 code): one matrix of
    the format's w13 banks (gguf: rows of blocks [N, bytes] uint8; int: words [N, K/P] int32, scales
    [N, G] fp32, zeros [N, G] uint8 for asym; nvfp4: zeros = the global scales [parts], each for N / parts
    rows). isa: the most the kernel may use (tests compare them);
    x_bf16: bf16 weights times x's values as bf16 (BF16_TIMES_BF16, x must hold bf16 values)."""
    code = BF16_TIMES_BF16 if x_bf16 and (fmt, w.dtype) == ("dense", torch.bfloat16) else format_code(fmt, w.dtype)
    if code is None:
        raise ValueError(f"matmul: no CPU kernel for {fmt} weights of {w.dtype}")
    if x.dim() != 2 or x.dtype != torch.float32 or x.device.type != "cpu":
        raise ValueError(f"matmul: x must be a float32 [T, K] host tensor, got {tuple(x.shape)} {x.dtype} {x.device}")
    packed = packed_codes(fmt)
    k = w.shape[1] * 32 if fmt == "mxfp4" else w.shape[1] if packed is None else packed_inputs(fmt, w)
    if fmt == "mxfp4":
        _check_mxfp4(w, scales, "matmul")
    if x.shape[1] != k:
        raise ValueError(f"matmul: x has K={x.shape[1]} inputs, the weights {k}")
    x, w = x.contiguous(), w.contiguous()
    s = scales.contiguous() if scales is not None else None
    y = torch.empty(x.shape[0], w.shape[0], dtype=torch.float32)  # [T, N]
    z = zeros.contiguous() if zeros is not None else None
    group = packed[2] if packed else 0
    if fmt in NVFP4_CODES:
        if z is None or z.dtype != torch.float32 or w.shape[0] % z.numel():
            raise ValueError(f"matmul: {fmt} needs its fp32 global scales (zeros=), one per equal share of rows")
        group = w.shape[0] // z.numel()
    rc = need_library(lib).ferryman_cpu_matmul(code, group, x.data_ptr(), x.shape[0], k,
                                                w.data_ptr(), s.data_ptr() if s is not None else None,
                                                z.data_ptr() if z is not None else None, w.shape[0], y.data_ptr(),
                                                threads(), ISAS[isa])
    if rc != 0:
        raise MemoryError(f"matmul: the kernel failed (code {rc}) on x {tuple(x.shape)}, W {tuple(w.shape)}")
    return y


def packed_inputs(fmt: str, w: torch.Tensor) -> int:
    """K of one matrix w of a packed format's w13 banks (gguf rows of blocks, int words)."""
    family, _, rest = fmt.partition(":")
    if family == "gguf":
        gtype = rest.partition(":")[0]
        return w.shape[-1] // type_size(gtype) * block_size(gtype)
    if family == "fp8":
        return w.shape[-1]
    if fmt in NVFP4_CODES:
        return w.shape[-1] * 2
    return w.shape[-1] * (32 // parse_name(fmt).bits)


def _check_mxfp4(blocks: torch.Tensor, scales: torch.Tensor | None, who: str) -> None:
    if blocks.dim() != 3 or blocks.shape[-1] != 16 or blocks.dtype != torch.uint8:
        raise ValueError(f"{who}: blocks must be uint8 [N, K/32, 16], got {tuple(blocks.shape)} {blocks.dtype}")
    if scales is None or scales.shape != blocks.shape[:2] or scales.dtype != torch.uint8:
        got = None if scales is None else (tuple(scales.shape), scales.dtype)
        raise ValueError(f"{who}: scales must be uint8 {tuple(blocks.shape[:2])}, got {got}")


ACTIVATIONS = {"silu": 0, "swiglu_oai": 1}
# expert -> (token indices, routing weights): lists, or int64 and float32 arrays
Pairs = dict[int, tuple[Sequence[int], Sequence[float]]]
SMALL_PAIRS = 256  # pairs_of builds lists up to this many pairs, numpy arrays beyond


def pairs_of(ids: torch.Tensor, w: torch.Tensor, experts: list[int] | None = None) -> Pairs:
    """The (token, k) pairs routed to each expert of `experts` (default: every expert in ids), each
    expert's tokens ascending. ids, w: [T, K] on the host. Beyond SMALL_PAIRS, one stable sort of the
    pair ids by expert (a 1,500-token job: 279 us against 1,309 us through lists, bench_layer_job.py)."""
    if ids.numel() <= SMALL_PAIRS:  # decode: a few pairs, Python lists beat numpy's calls
        out: Pairs = {e: ([], []) for e in experts} if experts is not None else {}
        for t, (row, weights) in enumerate(zip(ids.tolist(), w.float().tolist())):
            for e, wt in zip(row, weights):
                if experts is None or e in out:
                    tokens, ws = out.setdefault(e, ([], []))
                    tokens.append(t)
                    ws.append(wt)
        return out
    k = ids.shape[-1]
    flat = ids.reshape(-1).to(torch.int64).numpy()
    wf = w.reshape(-1).float().numpy()
    order = np.argsort(flat, kind="stable")  # [P] pair ids by expert, ties in token order
    uniq, starts, counts = np.unique(flat[order], return_index=True, return_counts=True)
    wanted = None if experts is None else set(experts)
    out = {}
    for e, s, c in zip(uniq.tolist(), starts.tolist(), counts.tolist()):
        if wanted is None or e in wanted:
            pair = order[s : s + c]
            out[e] = (pair // k, wf[pair])
    for e in experts or ():
        if e not in out:
            out[e] = (np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.float32))
    return out
