"""A preset (or model folder) with fewer layers, for benchmarks of models bigger than the machine.

    from fewer_layers import fewer_layers
    folder = fewer_layers("glm-4.5-air", 12)   # a folder holding that config.json, for load_format="dummy"

Per-layer figures (decode time per layer, link limit) do not depend on the layer count; the
benchmark states the count it ran.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from ferryman.models.registry import read_config_json
from ferryman.weights.presets import get_preset, is_preset


def fewer_layers(model: str, layers: int) -> str:
    """A temporary folder with `model`'s config cut to its first `layers` layers."""
    cfg: dict[str, Any] = get_preset(model) if is_preset(model) else read_config_json(model)
    text = cfg.get("text_config")
    target = text if isinstance(text, dict) else cfg  # vision-language layouts keep the text model's fields apart
    if layers >= target["num_hidden_layers"]:
        raise ValueError(f"{model} has {target['num_hidden_layers']} layers; asked for {layers}")
    target["num_hidden_layers"] = layers
    for key in ("layer_types", "mlp_only_layers"):
        if isinstance(target.get(key), list):
            kept = target[key][:layers] if key == "layer_types" else [i for i in target[key] if i < layers]
            target[key] = kept
    target.pop("num_nextn_predict_layers", None)
    folder = Path(tempfile.mkdtemp(prefix=f"{Path(model).name}-{layers}l-"))
    (folder / "config.json").write_text(json.dumps(cfg, indent=1))
    return str(folder)
