"""Every environment variable ferryman reads, typed, in one place.

    from ferryman.envs import envs
    if envs.MOE_BACKEND == "triton": ...

Reading `envs.X` parses `os.environ` at that moment (so tests can monkeypatch it); an unset or
empty variable gives the default; a bad value raises ConfigError naming the variable and value.
"""

from __future__ import annotations

import os
from typing import Any, Generic, TypeVar, overload

from ferryman.errors import ConfigError

T = TypeVar("T", bool, int, float, str)

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _parse_bool(raw: str) -> bool:
    word = raw.strip().lower()
    if word in _TRUE or word in _FALSE:
        return word in _TRUE
    raise ValueError(f"expected one of {'/'.join(_TRUE + _FALSE)}")


def _parse(type_: type, raw: str) -> Any:
    if type_ is bool:
        return _parse_bool(raw)
    if type_ in (int, float):
        return type_(raw.strip())
    return raw.strip()


class EnvVar(Generic[T]):
    """One typed environment variable; a descriptor when used as a class attribute."""

    def __init__(
        self,
        name: str,
        type_: type[T],
        default: T,
        help: str,
        choices: tuple[str, ...] | None = None,
    ) -> None:
        if type_ not in (bool, int, float, str):
            raise ValueError(f"EnvVar {name}: type must be bool, int, float or str, not {type_!r}")
        if choices is not None and (type_ is not str or default not in choices):
            raise ValueError(f"EnvVar {name}: choices need type str and a default among them")
        self.name, self.type, self.default, self.help = name, type_, default, help
        self.choices = choices

    def parse(self, raw: str) -> T:
        """Value of the raw string `raw`; ConfigError naming the variable if it is invalid."""
        try:
            value = _parse(self.type, raw)
        except ValueError as e:
            detail = str(e) if self.type is bool else f"expected {self.type.__name__}"
            raise ConfigError(f"environment variable {self.name}={raw!r} is invalid: {detail}") from None
        return self._check_choice(raw, value) if self.choices else value

    def _check_choice(self, raw: str, value: str) -> str:
        # Choices match case-insensitively and come back in their canonical spelling.
        for choice in self.choices or ():
            if choice.lower() == value.lower():
                return choice
        raise ConfigError(
            f"environment variable {self.name}={raw!r} is invalid: "
            f"expected one of {'|'.join(self.choices or ())}"
        )

    def is_set(self) -> bool:
        return os.environ.get(self.name, "").strip() != ""

    def get(self) -> T:
        raw = os.environ.get(self.name, "")
        return self.parse(raw) if raw.strip() else self.default

    def kind(self) -> str:
        """Type or choices as shown by `describe`, e.g. `bool` or `auto|torch|triton`."""
        return "|".join(self.choices) if self.choices else self.type.__name__

    @overload
    def __get__(self, obj: None, owner: type) -> EnvVar[T]: ...
    @overload
    def __get__(self, obj: object, owner: type) -> T: ...
    def __get__(self, obj: object | None, owner: type) -> EnvVar[T] | T:
        return self if obj is None else self.get()

    def __repr__(self) -> str:
        return f"EnvVar({self.name}: {self.kind()} = {self.default!r})"


_BACKENDS = ("auto", "torch", "triton")
_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


class Envs:
    """The registry: every EnvVar class attribute here is a variable ferryman reads."""

    KERNELS = EnvVar(
        "FERRYMAN_KERNELS", str, "auto",
        "escape hatch for the MoE and attention kernels: auto = Triton on CUDA, torch otherwise",
        choices=_BACKENDS,
    )
    # LEGACY: every variable below KERNELS except LOG_LEVEL, DEBUG, CACHE_DIR and CPU_KERNEL goes
    # (the redesign issue): code stops reading them; the registry entries are deleted at the end.
    MOE_BACKEND = EnvVar(
        "FERRYMAN_MOE_BACKEND", str, "auto",
        "fused-MoE kernels: auto = triton on CUDA, torch otherwise", choices=_BACKENDS,
    )
    ATTN_BACKEND = EnvVar(
        "FERRYMAN_ATTN_BACKEND", str, "auto",
        "paged-attention kernels: auto = triton on CUDA, torch otherwise", choices=_BACKENDS,
    )
    MOE_PREFILL = EnvVar(
        "FERRYMAN_MOE_PREFILL", str, "auto",
        "MoE of prefill-sized batches on CUDA: auto (grouped for unquantised experts, batched for quantised "
        "ones: the faster of the two for each, measured by benchmarks/bench_prefill_moe.py), batched (groups of "
        "experts dequantised together + batched GEMM), reference (per expert: dequantise + cuBLAS) or grouped "
        "(one Triton grouped GEMM per projection, weights dequantised in the kernel)",
        choices=("auto", "reference", "grouped", "batched"),
    )
    MOE_PREFILL_GROUP = EnvVar(
        "FERRYMAN_MOE_PREFILL_GROUP", int, 8,
        "experts per dequantise + batched GEMM on the batched prefill path (the planner counts them)",
    )
    MOE_DECODE_TILES = EnvVar(
        "FERRYMAN_MOE_DECODE_TILES", str, "",
        "tuning: MoE decode kernel tiles block_n,block_k,num_warps,impl[,fusek] (empty: the defaults)",
    )
    LOG_LEVEL = EnvVar(
        "FERRYMAN_LOG_LEVEL", str, "INFO", "log level of the ferryman loggers", choices=_LOG_LEVELS,
    )
    DISABLE_CUDA_GRAPHS = EnvVar(
        "FERRYMAN_DISABLE_CUDA_GRAPHS", bool, False, "run decode eagerly, without CUDA graphs",
    )
    SEGMENT_GRAPHS = EnvVar(
        "FERRYMAN_SEGMENT_GRAPHS", bool, True,
        "offloaded experts: decode with each layer's dense part as a CUDA graph (the MoE kernel too with "
        "FERRYMAN_MOE_GRAPHS)",
    )
    PREFILL_LOOKAHEAD = EnvVar(
        "FERRYMAN_PREFILL_LOOKAHEAD", int, 1,
        "offloaded experts, prefill streaming: how many layers ahead a chunk's experts start copying "
        "(1: the next layer; 2: also the one after; on the H200 gpt-oss-120b prefilled 2635 tok/s with 2 "
        "against 2738 with 1)",
    )
    HOST_EMBEDDING = EnvVar(
        "FERRYMAN_HOST_EMBEDDING", bool, True,
        "offloaded experts: keep the token-embedding table in host RAM (a row gather + copy per step), "
        "its GPU bytes going to expert slots",
    )
    WINDOW_KV = EnvVar(
        "FERRYMAN_WINDOW_KV", bool, True,
        "models mixing sliding-window and full-attention layers (gpt-oss): the window layers keep only "
        "their window's KV, in a small pool of their own (0: every layer's KV sized for the context)",
    )
    EXPANDABLE_SEGMENTS = EnvVar(
        "FERRYMAN_EXPANDABLE_SEGMENTS", bool, True,
        "CUDA: turn on the caching allocator's expandable segments (unless PYTORCH_CUDA_ALLOC_CONF or "
        "PYTORCH_ALLOC_CONF already says), so fragmentation does not eat the GPU budget: on the H200, "
        "gpt-oss-20b at 8 GiB reserved 7.78 GiB for 7.28 GiB allocated without, 7.37 GiB with",
    )
    PREFETCH_AFTER_KERNELS = EnvVar(
        "FERRYMAN_PREFETCH_AFTER_KERNELS", bool, True,
        "offloaded experts: start a layer's guessed copies (prefill streaming, decode prefetch) after its "
        "kernels and their small host -> device inputs are issued, so those inputs never queue behind "
        "the large copies on a copy engine (0: right after the layer's own misses, as before)",
    )
    PREFETCH_BEFORE_GROUPS = EnvVar(
        "FERRYMAN_PREFETCH_BEFORE_GROUPS", bool, True,
        "offloaded experts, prefill streaming: start the next layer's copies once this layer's MoE inputs are "
        "issued, before the batched path launches its groups (the host spends ~12 ms per gpt-oss-120b layer "
        "on those launches, and the link idled meanwhile; 0: after the launches)",
    )
    INPUTS_ON_COPY_STREAM = EnvVar(
        "FERRYMAN_INPUTS_ON_COPY_STREAM", str, "prefill",
        "offloaded experts: which steps send a layer's small inputs (slot ids, pair layout) to the device on the "
        "expert copy stream, ahead of the next layer's copies: prefill (streaming chunks; measured), all (decode "
        "steps too; not measured yet) or off (the compute stream, where a copy engine could serve them after "
        "the next layer's copies: a 26 ms wait per layer in a gpt-oss-120b prefill)",
        choices=("prefill", "all", "off"),
    )
    STREAM_EVEN = EnvVar(
        "FERRYMAN_STREAM_EVEN", bool, True,
        "offloaded experts, prefill streaming: keep the same number of experts of every layer cached from "
        "one chunk to the next, so every layer has copies to overlap (0: keep what the first chunks filled "
        "the cache with, often whole layers, during which the link idled)",
    )
    MOE_GRAPHS = EnvVar(
        "FERRYMAN_MOE_GRAPHS", bool, True,
        "offloaded experts, layer-graph decode: run each layer's MoE kernel as a CUDA graph on static slot ids "
        "(0: eagerly between the segment graphs, as before; on the H200, gpt-oss-20b at 8 GiB decoded 44.7 "
        "tok/s with them against 36.9 without)",
    )
    DECODE_PREFETCH = EnvVar(
        "FERRYMAN_DECODE_PREFETCH", str, "early",
        "offloaded experts, decode: copy the next layer's guessed experts ahead. early (default) = the next "
        "router on this layer's MoE input, in decode steps of at most FERRYMAN_DECODE_PREFETCH_MAX_SEQS "
        "sequences (gpt-oss-20b at 8 GiB on an H200, one engine: 53.0 tok/s against 49.2 off at 1 sequence, "
        "115.3 against 112.3 at 16); late = on the residual after this layer's MoE (20b: 47-48 tok/s "
        "against 46-49 off, inside the spread); late2 = late for the next two MoE layers, held until used, the "
        "far one on a second copy stream (20b: 43-44 tok/s; 120b: 23.2 against 22.2). Prefill streaming is on "
        "either way",
        choices=("off", "early", "late", "late2"),
    )
    DECODE_PREFETCH_MAX_SEQS = EnvVar(
        "FERRYMAN_DECODE_PREFETCH_MAX_SEQS", int, 0,
        "early decode prefetch guesses only in decode steps of at most this many sequences (late guesses are not "
        "limited). 0 (default): 16. gpt-oss-20b at 8 GiB on an H200, 16 users in one process: 115.3 tok/s "
        "guessing against 112.3 not; with the hybrid split 116.5 against 109.1 guessing up to 4 sequences",
    )
    DECODE_GAP_GUESS = EnvVar(
        "FERRYMAN_DECODE_GAP_GUESS", int, 1,
        "offloaded experts, one-sequence decode with FERRYMAN_DECODE_PREFETCH=early: in layers whose full "
        "guess the precision gate turned off, still copy this many of the guessed experts (most likely "
        "first), to fill the window in which the link idles between layers (experts/prefetch.py). 0: off; "
        "1 (default) measured 27.8 against 25.5 tok/s on gpt-oss-120b at 16 GiB (docs/benchmarks.md)",
    )
    PREFETCH_AVOID_BUSY = EnvVar(
        "FERRYMAN_PREFETCH_AVOID_BUSY", bool, True,
        "offloaded experts, decode steps: a guess's copies take last the slots whose reading kernel may "
        "still be pending (one such slot holds the whole batch of copies back until that kernel ends); "
        "prefill streams never (measured slower there)",
    )
    PREFETCH_SPLIT_BUSY = EnvVar(
        "FERRYMAN_PREFETCH_SPLIT_BUSY", bool, False,
        "offloaded experts: issue a guess's copies into slots no pending kernel reads before the others "
        "(same victims and bytes; aimed at the prefill stream, where a few such slots held a whole "
        "layer's copies back). Opt-in until measured on a GPU (tools/gpu_suite.sh splitab)",
    )
    DECODE_WRAP_GUESS = EnvVar(
        "FERRYMAN_DECODE_WRAP_GUESS", bool, True,
        "offloaded experts, decode with FERRYMAN_DECODE_PREFETCH=early: the last MoE layer also copies "
        "what the first used in this step, for the next step (its copies fill the link's idle time "
        "between steps; graded like the full guesses). 16 users in one process on the H200: 122.5 "
        "against 120.4 tok/s (docs/benchmarks.md, session 14)",
    )
    DECODE_PREFETCH_TOPK = EnvVar(
        "FERRYMAN_DECODE_PREFETCH_TOPK", int, 0,
        "experts per token the early decode guess takes in steps of several sequences (0: the model's "
        "top-k). Wider guesses copy more experts that go unused but leave fewer misses to copy after "
        "the layer's sync; the precision gate scales with the width. Not measured on a GPU yet",
    )
    DECODE_PREFETCH_SOLO_TOPK = EnvVar(
        "FERRYMAN_DECODE_PREFETCH_SOLO_TOPK", int, 0,
        "experts per token the early decode guess copies in one-sequence steps (0: adaptive per layer: "
        "half the model's top-k from top-4 up, all of it where the rest of the guess, graded without "
        "being copied, is right at least 0.85 of the time). gpt-oss-120b at 16 GiB on the H200 "
        "(session 16): copying 2 of 4, 30.9 against 29.1 tok/s, 0.85-0.86 of the link limit over "
        "needed bytes against 0.80-0.82",
    )
    ZERO_COPY = EnvVar(
        "FERRYMAN_ZERO_COPY", bool, False,
        "offloaded experts, experimental: decode kernels read uncached experts straight from pinned host "
        "memory (no per-layer sync, whole-step CUDA graphs); prefill still fills the cache",
    )
    ZERO_COPY_STAGE = EnvVar(
        "FERRYMAN_ZERO_COPY_STAGE", int, 0,
        "with FERRYMAN_ZERO_COPY=1: staging rows (taken from the expert slots) into which one kernel copies "
        "a decode layer's uncached experts before the decode kernel reads them from device memory (steps of "
        "at most this many (token, k) pairs; 0: the decode kernel reads host rows directly). Experimental, "
        "not measured on a GPU yet",
    )
    CPU_KERNEL = EnvVar(
        "FERRYMAN_CPU_KERNEL", bool, True,
        "CPU: multiply MXFP4 experts with the C kernel (ferryman/quant/csrc/mxfp4_cpu.c, built at first use "
        "with the system C compiler) instead of dequantising them to torch tensors first (0: the torch path)",
    )
    CPU_THREADS = EnvVar(
        "FERRYMAN_CPU_THREADS", int, 0,
        "threads of the CPU MXFP4 kernel (0: torch.get_num_threads())",
    )
    HYBRID_MIN_CPU = EnvVar(
        "FERRYMAN_HYBRID_MIN_CPU", int, 2,
        "--cpu-experts: a layer step sends misses to the CPU only if the split gives it at least this many "
        "(a CPU job costs a device -> host copy of x and a hand-off per layer; on the H200, gpt-oss-20b at one "
        "sequence decoded 40.0 tok/s splitting every layer against 48.1 without)",
    )
    CACHE_DIR = EnvVar(
        "FERRYMAN_CACHE_DIR", str, "",
        "where built CPU kernels are kept (default: $XDG_CACHE_HOME/ferryman or ~/.cache/ferryman)",
    )
    DEBUG = EnvVar(
        "FERRYMAN_DEBUG", bool, False, "as the CLI's --debug: full tracebacks, and DEBUG logs",
    )


envs = Envs()


def all_vars() -> list[EnvVar[Any]]:
    """The registered variables, in declaration order."""
    return [v for v in vars(Envs).values() if isinstance(v, EnvVar)]


def snapshot() -> dict[str, Any]:
    """Current value of every variable by name; raises ConfigError on the first bad one."""
    return {v.name: v.get() for v in all_vars()}


def describe() -> str:
    """One line per variable for `--help`: name, type or choices, default, help, current value."""
    rows = [(v.name, v.kind(), f"default {v.default}", v.help, v) for v in all_vars()]
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = ["environment variables:"]
    for name, kind, default, help_, var in rows:
        cells = [c.ljust(w) for c, w in zip((name, kind, default), widths)]
        now = f" [set: {os.environ[var.name].strip()}]" if var.is_set() else ""
        lines.append("  " + "  ".join(cells) + "  " + help_ + now)
    return "\n".join(lines)
