"""Built-in model presets for `load_format="dummy"`: real Hugging Face configs, no weights.

Each preset is `ferryman/assets/presets/<name>.json`: the fields of the model's published
`config.json` that shape tensors or change the math, as the file spells them, so a dummy run
allocates exactly the tensors the real checkpoint has. `_name_or_path` is the Hugging Face repo id;
`get_preset` accepts either spelling.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

PRESET_DIR = Path(__file__).resolve().parent.parent / "assets" / "presets"
NAMES = tuple(sorted(p.stem for p in PRESET_DIR.glob("*.json")))

PRESETS: dict[str, dict[str, Any]] = {n: json.loads((PRESET_DIR / f"{n}.json").read_text()) for n in NAMES}
HF_REPO_IDS: dict[str, str] = {n: cfg["_name_or_path"] for n, cfg in PRESETS.items()}

_ALIASES: dict[str, str] = {
    **{name: name for name in PRESETS},
    **{repo.lower(): name for name, repo in HF_REPO_IDS.items()},
}


def _resolve(name: str) -> str | None:
    """Preset key for a preset name or HF repo id (case-insensitive), None if unknown."""
    return _ALIASES.get(name.strip().lower()) if isinstance(name, str) else None


def is_preset(name: str) -> bool:
    return _resolve(name) is not None


def get_preset(name: str) -> dict[str, Any]:
    """A fresh copy of the preset's config dict (callers may mutate it)."""
    key = _resolve(name)
    if key is None:
        raise ValueError(f"unknown model preset {name!r}; known presets: {', '.join(PRESETS)}")
    return copy.deepcopy(PRESETS[key])
