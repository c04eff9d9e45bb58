"""MXFP4 experts multiplied on the CPU without dequantising them first: `LayerJob` (several experts
of one layer in one call: fused_moe's CPU path, the hybrid split's CPU part) and `mxfp4_matmul` (one
product x @ W^T: tests and benchmarks).

The C kernel (csrc/mxfp4_cpu.c: AVX-512 where the compiler targets it, a portable loop elsewhere,
rows split over OpenMP threads) reads each weight once and dequantises it in registers. It is built
at first use with `$CC` (else `cc`) into the cache directory, keyed by the source, the flags and the
machine, and loaded with ctypes. No compiler or a failed build: one warning saying why, and callers
keep the torch path. FERRYMAN_CPU_KERNEL=0 turns it off.
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

from ferryman.envs import envs

log = logging.getLogger("ferryman.quant")

SOURCE = Path(__file__).parent / "csrc" / "mxfp4_cpu.c"
# tried in order: the first that builds is used (no OpenMP: one thread; no -march: no AVX-512)
FLAG_SETS = (
    ("-O3", "-march=native", "-fopenmp"),
    ("-O3", "-march=native"),
    ("-O3",),
)


def cache_dir() -> Path:
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
    return envs.CPU_KERNEL and _library() is not None


def _threads() -> int:
    """torch's thread count, less one when this process drives a GPU: its thread needs a core, and
    one preempted OpenMP thread stalls the whole product."""
    n = torch.get_num_threads()
    return n - 1 if n > 2 and torch.cuda.is_initialized() else n


def _check(x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor, who: str = "mxfp4_matmul") -> None:
    if x.dim() != 2 or x.dtype != torch.float32:
        raise ValueError(f"{who}: x must be a float32 [T, K] tensor, got {tuple(x.shape)} {x.dtype}")
    if blocks.dim() != 3 or blocks.shape[-1] != 16 or blocks.dtype != torch.uint8:
        raise ValueError(f"{who}: blocks must be uint8 [N, K/32, 16], got {tuple(blocks.shape)} {blocks.dtype}")
    if scales.shape != blocks.shape[:2] or scales.dtype != torch.uint8:
        raise ValueError(f"{who}: scales must be uint8 {tuple(blocks.shape[:2])}, got "
                         f"{tuple(scales.shape)} {scales.dtype}")
    if x.shape[1] != blocks.shape[1] * 32:
        raise ValueError(f"{who}: x has K={x.shape[1]} inputs, the weights {blocks.shape[1] * 32}")
    for name, t in (("x", x), ("blocks", blocks), ("scales", scales)):
        if t.device.type != "cpu":
            raise ValueError(f"{who}: {name} must be on the CPU, got {t.device}")


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
Pairs = dict[int, tuple[list[int], list[float]]]  # expert -> (token indices, routing weights)


def pairs_of(ids: torch.Tensor, w: torch.Tensor, experts: list[int] | None = None) -> Pairs:
    """The (token, k) pairs routed to each expert of `experts` (default: every expert in ids).
    ids, w: [T, K] on the host."""
    out: Pairs = {e: ([], []) for e in experts} if experts is not None else {}
    for t, (row, weights) in enumerate(zip(ids.tolist(), w.float().tolist())):
        for e, wt in zip(row, weights):
            if experts is None or e in out:
                tokens, ws = out.setdefault(e, ([], []))
                tokens.append(t)
                ws.append(wt)
    return out


class LayerJob:
    """Several MXFP4 experts of one layer, each on its own tokens, weighted and summed in fp32 (the
    math of fused_moe) in one kernel call, `run`, which holds no Python lock while it computes; the
    arguments are prepared here, on the caller's thread. x: [T, H]; pairs: `pairs_of`; bias: fp32
    copies of the bias rows by (layer, expert, bank), kept by a caller that runs the same layers
    again (None: converted for this job only)."""

    def __init__(self, x: torch.Tensor, banks: dict[str, torch.Tensor], layer: int, pairs: Pairs, kind: str,
                 alpha: float, limit: float, bias: dict[tuple[int, int, str], torch.Tensor] | None = None) -> None:
        if kind not in ACTIVATIONS:
            raise ValueError(f"LayerJob: activation must be one of {', '.join(ACTIVATIONS)}, got {kind!r}")
        self.lib = _library()
        if self.lib is None:
            raise RuntimeError("the CPU MXFP4 kernel is unavailable (see the warning logged when it was built)")
        self.x = x.float().contiguous()  # [T, H]
        _check(self.x, banks["w13_blocks"][0], banks["w13_scales"][0], "LayerJob")
        self.inter = banks["w13_blocks"].shape[1] // 2
        if tuple(banks["w2_blocks"].shape[1:3]) != (x.shape[1], self.inter // 32):
            raise ValueError(f"LayerJob: w2_blocks {tuple(banks['w2_blocks'].shape)} do not match hidden "
                             f"{x.shape[1]} and FFN {self.inter}")
        bias = {} if bias is None else bias
        experts = sorted(pairs)
        self.n = len(experts)
        self.keep: list[torch.Tensor] = []  # what the pointers below point into, alive until run
        self.arrays = {name: (ctypes.c_void_p * self.n)() for name in ("w13b", "w13s", "b13", "w2b", "w2s", "b2")}
        for i, e in enumerate(experts):
            for name, bank in (("w13b", "w13_blocks"), ("w13s", "w13_scales"), ("w2b", "w2_blocks"),
                               ("w2s", "w2_scales")):
                self.arrays[name][i] = self._pointer(banks[bank][e])
            for name, bank in (("b13", "w13_bias"), ("b2", "w2_bias")):
                if bank in banks:
                    if (layer, e, bank) not in bias:
                        bias[(layer, e, bank)] = banks[bank][e].float().contiguous()
                    self.keep.append(bias[(layer, e, bank)])  # the caller's dict may be this call's only
                    self.arrays[name][i] = self._pointer(self.keep[-1])
        self.offsets = torch.tensor([0, *itertools.accumulate(len(pairs[e][0]) for e in experts)], dtype=torch.int64)
        self.tokens = torch.tensor([t for e in experts for t in pairs[e][0]], dtype=torch.int64)
        self.weights = torch.tensor([w for e in experts for w in pairs[e][1]], dtype=torch.float32)
        self.kind, self.alpha, self.limit = ACTIVATIONS[kind], alpha, limit
        self.threads = _threads()

    def _pointer(self, t: torch.Tensor) -> int:
        """Address of t's data, copied first if it is not one contiguous block on the host."""
        if t.device.type != "cpu":
            raise ValueError(f"LayerJob: expert banks must be in host memory, got {t.device}")
        if not t.is_contiguous():
            t = t.contiguous()
            self.keep.append(t)
        return t.data_ptr()

    def run(self, portable: bool = False) -> torch.Tensor:
        """The [T, H] fp32 sum of the experts' weighted outputs. portable: the portable loop even
        where AVX-512 is built in (tests)."""
        out = torch.zeros_like(self.x)
        a = self.arrays
        rc = self.lib.ferryman_mxfp4_experts(
            self.x.data_ptr(), self.x.shape[0], self.x.shape[1], self.inter, self.n, a["w13b"], a["w13s"], a["b13"],
            a["w2b"], a["w2s"], a["b2"], self.offsets.data_ptr(), self.tokens.data_ptr(), self.weights.data_ptr(),
            self.kind, self.alpha, self.limit, out.data_ptr(), self.threads, int(portable))
        if rc != 0:
            raise RuntimeError(f"mxfp4 experts kernel failed (code {rc}: -1 out of memory, -2 a token out of range)")
        return out
