"""Sizes and shares as users write them ('16GiB', '10%'), parsed into bytes and fractions.

config.py re-exports these; they live apart to keep config.py to its dataclasses.
"""

from __future__ import annotations

import re

from ferryman.errors import ConfigError

GiB = 1 << 30
MiB = 1 << 20
_UNITS = {"b": 1, "k": 1 << 10, "kb": 10**3, "kib": 1 << 10, "m": MiB, "mb": 10**6, "mib": MiB,
          "g": GiB, "gb": 10**9, "gib": GiB, "t": 1 << 40, "tb": 10**12, "tib": 1 << 40}


def parse_bytes(value: str | int, name: str = "gpu_memory") -> int:
    """'16GiB', '16G' (binary), '16GB' (decimal), '512MiB', '4096B' -> bytes; an int is bytes.

    A string needs its unit: '16' is refused, not read as 16 bytes (nor guessed as GiB). An int
    (the Python API, e.g. a figure from torch.cuda.mem_get_info) is bytes, and one below 1 MiB is
    refused the same way: no budget that small holds a model, so the unit was forgotten."""
    prefix = f"{name} " if name else ""
    if isinstance(value, int) and not isinstance(value, bool):
        if value < MiB:
            raise ConfigError(f"{prefix}{value}: give a unit, e.g. '{value}GiB' (an int is a number of bytes)")
        return value
    if not isinstance(value, str):
        raise ConfigError(f"{prefix}must be a size like '16GiB' or an int of bytes, got {value!r}")
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", value)
    if m is not None and not m.group(2):
        raise ConfigError(f"{prefix}{value.strip()}: give a unit, e.g. {value.strip()}GiB")
    if m is None or m.group(2).lower() not in _UNITS:
        raise ConfigError(f"{prefix}must be a size like '16GiB', '8G' or '512MiB', got {value!r}")
    n = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if n <= 0:
        raise ConfigError(f"{prefix}must be positive, got {value!r}")
    return n


def parse_expert_cache(value: str | int | float) -> float | int:
    """'10%' or 0.1 -> a fraction of all routed experts; '64' or 64 -> a number of slots."""
    if isinstance(value, bool):
        raise ConfigError(f"expert_cache must be a fraction, a percentage or a slot count, got {value!r}")
    if isinstance(value, str):
        text = value.strip()
        try:
            value = float(text[:-1]) / 100 if text.endswith("%") else int(text) if text.isdigit() else float(text)
        except ValueError:
            raise ConfigError(f"expert_cache must look like '10%', '0.1' or '64', got {value!r}") from None
    if isinstance(value, float) and 0 < value <= 1:
        return value
    if isinstance(value, (int, float)) and value >= 1 and float(value).is_integer():
        return int(value)
    raise ConfigError(f"expert_cache must be a fraction in (0, 1], a percentage or a slot count >= 1, got {value!r}")
