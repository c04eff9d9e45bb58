"""The calibration file: rates measured on this machine for one expert geometry.

A file holds what `ferryman bench bw` (or the quick measurement at engine start) measured:

    key        the expert's shape, format and dtype (`expert_key`): never the format alone, so two
               models in one format but with different expert sizes never share a verdict
    machine    CPU model, logical CPUs, torch threads, GPU name, torch version (`machine_info`):
               a file measured elsewhere, or with another thread count, is not used
    rates      host read GB/s; experts/s over the link (pinned host -> device), of host -> host
               copies (the "link" when the CPU is the device), of the CPU computing experts;
               on CUDA also the link and the CPU measured running at the same time, and the
               device's compute (`DeviceCompute`, calibrate/device.py): a prefill's MoE layer and GEMMs

Default place: `$XDG_CACHE_HOME/ferryman/calibration-<fingerprint>.json` (~/.cache otherwise).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from ferryman.config import ModelConfig
from ferryman.quant.base import get_format

VERSION = 1


@dataclass(frozen=True)
class Rate:
    """One measured rate: experts per second, and the expert bytes that moves per second."""

    experts_per_s: float
    gbps: float  # 1e9 bytes of expert weights per second
    reps: int  # repetitions behind the median (or the count of a timed run)

    @staticmethod
    def of(seconds_per_expert: float, expert_bytes: int, reps: int) -> "Rate":
        if seconds_per_expert <= 0:
            raise ValueError(f"a measured time must be positive, got {seconds_per_expert}")
        return Rate(1.0 / seconds_per_expert, expert_bytes / seconds_per_expert / 1e9, reps)


CPU_SLOPE_TOKENS = 4  # tokens per expert of the second CPU rate (cpu_tokens), which gives the slope


def token_slope(one: float, many: float, tokens: int = CPU_SLOPE_TOKENS) -> float:
    """The extra cost of each token past the first, in 1-token experts, from the CPU's rates at 1
    and at `tokens` tokens per expert (experts/s, measured alone); 0 when unmeasured."""
    if one <= 0 or many <= 0 or tokens <= 1:
        return 0.0
    return max(0.0, (one / many - 1.0) / (tokens - 1))


@dataclass(frozen=True)
class DeviceCompute:
    moe: tuple[tuple[int, float], ...]  # (tokens, seconds of one MoE layer), tokens ascending
    matmul_flops: float  # flop/s of a large GEMM in the model's dtype
    experts: int  # the layer's routed experts the tokens were spread over (not in the key: one geometry, many counts)

    def __post_init__(self) -> None:
        tokens = [t for t, _ in self.moe]
        if len(tokens) < 2 or tokens != sorted(set(tokens)) or any(s <= 0 for _, s in self.moe):
            raise ValueError(f"device MoE times need >= 2 ascending token counts with positive seconds, got {self.moe}")
        if self.matmul_flops <= 0:
            raise ValueError(f"matmul flop/s must be positive, got {self.matmul_flops}")

    def moe_seconds(self, tokens: int) -> float:
        """One MoE layer's seconds for `tokens` tokens: linear between the measured points and below
        the first (down to 0 seconds), the last two's slope beyond them."""
        pts = self.moe
        if tokens <= pts[0][0]:
            (t0, s0), (t1, s1) = pts[0], pts[1]
            return min(s0, max(0.0, s0 - (s1 - s0) * (t0 - tokens) / (t1 - t0)))
        for (t0, s0), (t1, s1) in zip(pts, pts[1:]):
            if tokens <= t1:
                return s0 + (s1 - s0) * (tokens - t0) / (t1 - t0)
        (t0, s0), (t1, s1) = pts[-2], pts[-1]
        return s1 + max(0.0, (s1 - s0) / (t1 - t0)) * (tokens - t1)

    @staticmethod
    def from_json(data: dict[str, Any]) -> "DeviceCompute":
        return DeviceCompute(tuple((int(t), float(s)) for t, s in data["moe"]), float(data["matmul_flops"]),
                             int(data["experts"]))


@dataclass
class Calibration:
    key: dict[str, Any]
    machine: dict[str, Any]
    cpu_compute: Rate  # fused_moe on the CPU, 1 token x top-k experts
    host_copy: Rate  # host -> host copies of one expert
    h2d: Rate | None = None  # pinned host -> device copies of one expert (None without CUDA)
    host_read_gbps: float | None = None  # torch.sum over a large buffer, all threads
    overlapped: dict[str, Rate] | None = None  # {"link", "cpu"} measured running together (CUDA)
    quick: bool = False  # measured in a few hundred ms at engine start, not by `bench bw`
    notes: dict[str, str] = field(default_factory=dict)
    cpu_tokens: Rate | None = None  # as cpu_compute, with CPU_SLOPE_TOKENS tokens per expert (None: older file)
    device: DeviceCompute | None = None  # the device's prefill compute (CUDA, `bench bw`; None: older file)

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.key)

    def to_json(self) -> dict[str, Any]:
        return {"version": VERSION, "fingerprint": self.fingerprint, **asdict(self)}

    @staticmethod
    def from_json(data: dict[str, Any]) -> "Calibration":
        if data.get("version") != VERSION:
            raise ValueError(f"calibration file version {data.get('version')!r}, expected {VERSION}")
        rate = lambda d: None if d is None else Rate(**d)
        overlapped = data.get("overlapped")
        return Calibration(
            key=data["key"], machine=data["machine"], cpu_compute=Rate(**data["cpu_compute"]),
            host_copy=Rate(**data["host_copy"]), h2d=rate(data.get("h2d")),
            host_read_gbps=data.get("host_read_gbps"),
            overlapped=None if overlapped is None else {k: Rate(**v) for k, v in overlapped.items()},
            quick=bool(data.get("quick", False)), notes=dict(data.get("notes") or {}),
            cpu_tokens=rate(data.get("cpu_tokens")),
            device=None if data.get("device") is None else DeviceCompute.from_json(data["device"]),
        )


def expert_key(cfg: ModelConfig, dtype: torch.dtype) -> dict[str, Any]:
    """What the rates depend on: the expert's geometry, format, dtype, activation and top-k."""
    from ferryman.planner import slot_bytes

    fmt = get_format(cfg.expert_format)
    return {
        "format": cfg.expert_format,
        "hidden": cfg.hidden_size,
        "inter": cfg.moe_intermediate_size,
        "bias": cfg.expert_bias,
        "dtype": str(dtype).removeprefix("torch."),
        "act": cfg.expert_act,
        "top_k": cfg.top_k,
        "expert_bytes": fmt.expert_bytes(cfg.hidden_size, cfg.moe_intermediate_size, cfg.expert_bias, dtype),
        "row_bytes": slot_bytes(cfg, dtype),
    }


def fingerprint(key: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def machine_info() -> dict[str, Any]:
    """The machine the rates belong to (a change in any field means: measure again)."""
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return {"cpu": _cpu_model(), "cpus": os.cpu_count(), "threads": torch.get_num_threads(),
            "gpu": gpu, "torch": torch.__version__}


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def default_path(key: dict[str, Any]) -> Path:
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return root / "ferryman" / f"calibration-{fingerprint(key)}.json"


def save(cal: Calibration, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(cal.to_json(), indent=2))
    tmp.replace(path)  # readers never see half a file


def load(path: Path) -> Calibration:
    """The calibration in `path`; ValueError naming the file if it is not one."""
    try:
        return Calibration.from_json(json.loads(path.read_text()))
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{path} is not a ferryman calibration file: {e}") from None


def load_matching(key: dict[str, Any], path: Path | None = None) -> tuple[Calibration | None, str]:
    """(calibration, why) for `key` on this machine: None with the reason when there is no file,
    it is for another expert geometry, or was measured on another machine or thread count."""
    path = path or default_path(key)
    if not path.exists():
        return None, f"no calibration file {path}"
    cal = load(path)
    if cal.key != key:
        return None, f"{path} is for another expert geometry ({cal.key}, not {key})"
    here = machine_info()
    if cal.machine != here:
        changed = sorted(k for k in here if cal.machine.get(k) != here[k])
        return None, f"{path} was measured on another machine or setup (differs in {', '.join(changed)})"
    return cal, f"read {path}"
