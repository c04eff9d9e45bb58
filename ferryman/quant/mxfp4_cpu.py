"""MXFP4 experts multiplied on the CPU without dequantising them first: `mxfp4_matmul`.

torch has no MXFP4 kernel for the CPU, and dequantising an expert to bf16 before a GEMV moves
~4x its bytes through memory at a few hundred MB/s (11 gpt-oss experts/s on the dev VM). The C
kernel (csrc/mxfp4_cpu.c: AVX-512 where the compiler targets it, a portable loop elsewhere, rows
split over OpenMP threads) reads each weight once and dequantises it in registers.

It is built at first use with the system C compiler (`$CC`, else `cc`) into the cache directory
(FERRYMAN_CACHE_DIR, else $XDG_CACHE_HOME/ferryman or ~/.cache/ferryman), keyed by the source, the
flags and the machine, and loaded with ctypes (no Python API, so one build serves every Python).
No compiler, or a failed build: a warning saying why, once, and callers keep the torch path.
FERRYMAN_CPU_KERNEL=0 turns it off.
"""

from __future__ import annotations

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

import torch

log = logging.getLogger("ferryman.quant")

SOURCE = Path(__file__).parent / "csrc" / "mxfp4_cpu.c"
# tried in order: the first that builds is used (no OpenMP: one thread; no -march: no AVX-512)
FLAG_SETS = (
    ("-O3", "-march=native", "-fopenmp"),
    ("-O3", "-march=native"),
    ("-O3",),
)


def cache_dir() -> Path:
    from ferryman.envs import envs

    if envs.CACHE_DIR:
        return Path(envs.CACHE_DIR)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "ferryman"


def _compile(cc: str, flags: tuple[str, ...], out: Path) -> str | None:
    """Build the library at `out` (atomically); None on success, else the compiler's complaint."""
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    cmd = [cc, *flags, "-shared", "-fPIC", "-o", tmp, str(SOURCE), "-lm"]
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


def _library_path(cc: str, flags: tuple[str, ...]) -> Path:
    key = hashlib.sha256(SOURCE.read_bytes() + repr((cc, flags, platform.machine(), platform.node())).encode())
    return cache_dir() / f"mxfp4_cpu-{key.hexdigest()[:16]}.so"


def build(portable_only: bool = False) -> tuple[ctypes.CDLL | None, str]:
    """(the loaded library or None, how it was built or why not). portable_only: build without
    -march=native (tests of the portable loop)."""
    cc = os.environ.get("CC") or "cc"
    if shutil.which(cc) is None:
        return None, f"no C compiler ({cc!r} is not on PATH; set CC)"
    errors = []
    for flags in FLAG_SETS:
        if portable_only and "-march=native" in flags:
            continue
        path = _library_path(cc, flags)
        error = None if path.exists() else _compile(cc, flags, path)
        if error is None:
            lib = ctypes.CDLL(str(path))
            _declare(lib)
            return lib, f"{cc} {' '.join(flags)}"
        errors.append(error)
    return None, "the build failed: " + " | ".join(errors)


def _declare(lib: ctypes.CDLL) -> None:
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.ferryman_mxfp4_matmul.argtypes = [ptr, i64, i64, ptr, ptr, i64, ptr, ctypes.c_int, ctypes.c_int]
    lib.ferryman_mxfp4_matmul.restype = ctypes.c_int
    lib.ferryman_mxfp4_expert.argtypes = [ptr, i64, i64, i64, ptr, ptr, ptr, ptr, ptr, ptr, ctypes.c_int,
                                          ctypes.c_float, ctypes.c_float, ptr, ctypes.c_int, ctypes.c_int]
    lib.ferryman_mxfp4_expert.restype = ctypes.c_int
    pp = ctypes.POINTER(ctypes.c_void_p)
    lib.ferryman_mxfp4_experts.argtypes = [ptr, i64, i64, i64, i64, pp, pp, pp, pp, pp, pp, ptr, ptr, ptr,
                                           ctypes.c_int, ctypes.c_float, ctypes.c_float, ptr, ctypes.c_int, ctypes.c_int]
    lib.ferryman_mxfp4_experts.restype = ctypes.c_int
    lib.ferryman_mxfp4_has_avx512.restype = ctypes.c_int
    lib.ferryman_mxfp4_has_openmp.restype = ctypes.c_int


@lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    try:
        lib, how = build()
    except OSError as e:  # an unwritable cache directory, a library that does not load
        lib, how = None, f"{type(e).__name__}: {e}"
    if lib is None:
        log.warning("CPU MXFP4 kernel unavailable (%s): MXFP4 experts on the CPU use the slower torch path", how)
    else:
        log.info("CPU MXFP4 kernel built (%s; AVX-512 %s, OpenMP %s)", how,
                 "yes" if lib.ferryman_mxfp4_has_avx512() else "no", "yes" if lib.ferryman_mxfp4_has_openmp() else "no")
    return lib


def available() -> bool:
    """Whether MXFP4 products on the CPU go through the C kernel (FERRYMAN_CPU_KERNEL and a build)."""
    from ferryman.envs import envs

    return envs.CPU_KERNEL and _library() is not None


def _threads() -> int:
    """FERRYMAN_CPU_THREADS, else torch's thread count, less one when this process drives a GPU:
    its thread needs a core, and one preempted OpenMP thread stalls the whole product (on the H200
    host, measured together with the link's copies: 664 experts/s with 16 of 16 cores)."""
    from ferryman.envs import envs

    if envs.CPU_THREADS > 0:
        return envs.CPU_THREADS
    n = torch.get_num_threads()
    return n - 1 if n > 2 and torch.cuda.is_initialized() else n


def _check(x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor) -> None:
    if x.dim() != 2 or x.dtype != torch.float32:
        raise ValueError(f"mxfp4_matmul: x must be a float32 [T, K] tensor, got {tuple(x.shape)} {x.dtype}")
    if blocks.dim() != 3 or blocks.shape[-1] != 16 or blocks.dtype != torch.uint8:
        raise ValueError(f"mxfp4_matmul: blocks must be uint8 [N, K/32, 16], got {tuple(blocks.shape)} {blocks.dtype}")
    if scales.shape != blocks.shape[:2] or scales.dtype != torch.uint8:
        raise ValueError(f"mxfp4_matmul: scales must be uint8 {tuple(blocks.shape[:2])}, got "
                         f"{tuple(scales.shape)} {scales.dtype}")
    if x.shape[1] != blocks.shape[1] * 32:
        raise ValueError(f"mxfp4_matmul: x has K={x.shape[1]} inputs, the weights {blocks.shape[1] * 32}")
    for name, t in (("x", x), ("blocks", blocks), ("scales", scales)):
        if t.device.type != "cpu":
            raise ValueError(f"mxfp4_matmul: {name} must be on the CPU, got {t.device}")


def mxfp4_matmul(x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor, portable: bool = False,
                 lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """x [T, K] fp32 @ W^T with W = (blocks [N, K/32, 16], scales [N, K/32]) -> [T, N] fp32.
    portable: the portable loop even where AVX-512 is built in; lib: a specific build (tests)."""
    _check(x, blocks, scales)
    lib = lib or _library()
    if lib is None:
        raise RuntimeError("the CPU MXFP4 kernel is unavailable (see the warning logged when it was built)")
    x, blocks, scales = x.contiguous(), blocks.contiguous(), scales.contiguous()
    y = torch.empty(x.shape[0], blocks.shape[0], dtype=torch.float32)  # [T, N]
    rc = lib.ferryman_mxfp4_matmul(x.data_ptr(), x.shape[0], x.shape[1], blocks.data_ptr(), scales.data_ptr(),
                                   blocks.shape[0], y.data_ptr(), _threads(), int(portable))
    if rc != 0:
        raise MemoryError(f"mxfp4_matmul: the kernel could not allocate its [{x.shape[0]}, {x.shape[1]}] buffer")
    return y


ACTIVATIONS = {"silu": 0, "swiglu_oai": 1}


def _bias(banks: dict[str, torch.Tensor], name: str, slot: int) -> torch.Tensor | None:
    bank = banks.get(name)
    return None if bank is None else bank[slot].float().contiguous()


def mxfp4_expert(x: torch.Tensor, banks: dict[str, torch.Tensor], slot: int, kind: str, alpha: float,
                 limit: float, portable: bool = False) -> torch.Tensor:
    """One MXFP4 expert of `banks` (slot `slot`) on x [T, H] fp32 -> [T, H] fp32, in one call:
    act(x @ W13^T + b13) @ W2^T + b2, everything in fp32 (ferryman/layers/fused_moe.py's math)."""
    b13, s13 = banks["w13_blocks"][slot], banks["w13_scales"][slot]  # [2I, H/32, 16], [2I, H/32]
    b2, s2 = banks["w2_blocks"][slot], banks["w2_scales"][slot]  # [H, I/32, 16], [H, I/32]
    _check(x, b13, s13)
    inter = b13.shape[0] // 2
    if tuple(b2.shape[:2]) != (x.shape[1], inter // 32):
        raise ValueError(f"mxfp4_expert: w2 blocks {tuple(b2.shape)} do not match hidden {x.shape[1]}, FFN {inter}")
    if kind not in ACTIVATIONS:
        raise ValueError(f"mxfp4_expert: activation must be one of {', '.join(ACTIVATIONS)}, got {kind!r}")
    lib = _library()
    if lib is None:
        raise RuntimeError("the CPU MXFP4 kernel is unavailable (see the warning logged when it was built)")
    x = x.contiguous()
    parts = [t.contiguous() for t in (b13, s13, b2, s2)]
    bias13, bias2 = _bias(banks, "w13_bias", slot), _bias(banks, "w2_bias", slot)
    y = torch.empty_like(x)  # [T, H]
    ptr = lambda t: None if t is None else t.data_ptr()  # noqa: E731
    rc = lib.ferryman_mxfp4_expert(x.data_ptr(), x.shape[0], x.shape[1], inter, ptr(parts[0]), ptr(parts[1]),
                                   ptr(bias13), ptr(parts[2]), ptr(parts[3]), ptr(bias2), ACTIVATIONS[kind],
                                   alpha, limit, y.data_ptr(), _threads(), int(portable))
    if rc != 0:
        raise MemoryError(f"mxfp4_expert: the kernel could not allocate its scratch for {x.shape[0]} tokens")
    return y


class LayerJob:
    """One layer's CPU experts as one kernel call (`run`, which holds no Python lock while it
    computes): every argument is prepared here, on the caller's thread, from host tensors.

    pairs: expert id -> (token indices, routing weights) of the pairs routed to it; x: [T, H];
    bias: fp32 copies of the bias rows, by (layer, expert), kept by the caller between steps."""

    def __init__(self, x: torch.Tensor, banks: dict[str, torch.Tensor], layer: int,
                 pairs: dict[int, tuple[list[int], list[float]]], kind: str, alpha: float, limit: float,
                 bias: dict[tuple[int, int, str], torch.Tensor]) -> None:
        if kind not in ACTIVATIONS:
            raise ValueError(f"LayerJob: activation must be one of {', '.join(ACTIVATIONS)}, got {kind!r}")
        self.lib = _library()
        if self.lib is None:
            raise RuntimeError("the CPU MXFP4 kernel is unavailable (see the warning logged when it was built)")
        self.x = x.float().contiguous()  # [T, H]
        experts = sorted(pairs)
        n = len(experts)
        self.inter = banks["w13_blocks"].shape[1] // 2
        arrays = {name: (ctypes.c_void_p * n)() for name in ("w13b", "w13s", "b13", "w2b", "w2s", "b2")}
        for i, e in enumerate(experts):
            arrays["w13b"][i] = banks["w13_blocks"][e].data_ptr()
            arrays["w13s"][i] = banks["w13_scales"][e].data_ptr()
            arrays["w2b"][i] = banks["w2_blocks"][e].data_ptr()
            arrays["w2s"][i] = banks["w2_scales"][e].data_ptr()
            for name, bank in (("b13", "w13_bias"), ("b2", "w2_bias")):
                if bank in banks:
                    key = (layer, e, bank)
                    if key not in bias:
                        bias[key] = banks[bank][e].float().contiguous()
                    arrays[name][i] = bias[key].data_ptr()
        self.arrays = arrays
        tokens = [t for e in experts for t in pairs[e][0]]
        self.offsets = torch.tensor([0, *itertools.accumulate(len(pairs[e][0]) for e in experts)], dtype=torch.int64)
        self.tokens = torch.tensor(tokens, dtype=torch.int64)
        self.weights = torch.tensor([w for e in experts for w in pairs[e][1]], dtype=torch.float32)
        self.n, self.kind, self.alpha, self.limit = n, ACTIVATIONS[kind], alpha, limit
        self.threads = _threads()

    def run(self) -> torch.Tensor:
        """The [T, H] fp32 sum of the experts' weighted outputs."""
        out = torch.zeros_like(self.x)
        a = self.arrays
        rc = self.lib.ferryman_mxfp4_experts(
            self.x.data_ptr(), self.x.shape[0], self.x.shape[1], self.inter, self.n, a["w13b"], a["w13s"], a["b13"],
            a["w2b"], a["w2s"], a["b2"], self.offsets.data_ptr(), self.tokens.data_ptr(), self.weights.data_ptr(),
            self.kind, self.alpha, self.limit, out.data_ptr(), self.threads, 0)
        if rc != 0:
            raise RuntimeError(f"mxfp4 experts kernel failed (code {rc}: -1 out of memory, -2 a token out of range)")
        return out
