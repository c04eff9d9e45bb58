"""Architectures by Hugging Face `model_type`, and `model_config`: a config.json -> ModelConfig."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ferryman.config import ModelConfig
from ferryman.errors import ConfigError, UnsupportedModelError
from ferryman.models.base import Architecture
from ferryman.models.deepseek_v3 import DeepseekV3, KimiK2
from ferryman.models.glm4_moe import Glm4Moe
from ferryman.models.gpt_oss import GptOss
from ferryman.models.mixtral import Mixtral
from ferryman.models.olmoe import Olmoe
from ferryman.models.qwen3_5_moe import Qwen3_5Moe, Qwen3_5MoeText
from ferryman.models.qwen3_moe import Qwen3Moe
from ferryman.models.qwen3_next import Qwen3Next
from ferryman.quant.base import get_format

ARCHITECTURES: dict[str, Architecture] = {
    a.model_type: a for a in (DeepseekV3(), Glm4Moe(), GptOss(), KimiK2(), Mixtral(), Olmoe(), Qwen3Moe(), Qwen3Next(),
                              Qwen3_5MoeText(), Qwen3_5Moe())
}


def get_architecture(model_type: str) -> Architecture:
    if model_type not in ARCHITECTURES:
        raise UnsupportedModelError(
            f"unsupported model_type {model_type!r}; supported: {', '.join(sorted(ARCHITECTURES))}"
        )
    return ARCHITECTURES[model_type]


def model_config(source: str | Path | dict[str, Any]) -> ModelConfig:
    """The ModelConfig of a model folder, a config.json path, or an already-parsed dict."""
    hf = source if isinstance(source, dict) else read_config_json(source)
    model_type = hf.get("model_type")
    if not model_type:
        raise ConfigError("config.json has no 'model_type'")
    try:
        cfg = get_architecture(model_type).parse_config(hf)
    except KeyError as e:
        raise ConfigError(f"config.json of a {model_type} model lacks the field {e.args[0]!r}") from None
    if cfg.quant is not None and cfg.num_experts:  # the experts' format can hold these dims
        try:
            get_format(cfg.expert_format).bank_specs(1, cfg.hidden_size, cfg.moe_intermediate_size, False, cfg.dtype)
        except ValueError as e:
            raise ConfigError(f"quantization_config: {e}") from None
    return cfg


def read_config_json(source: str | Path) -> dict[str, Any]:
    path = Path(source)
    if path.is_dir():
        path = path / "config.json"
    if not path.parent.exists():
        raise ConfigError(f"model folder {path.parent} does not exist")
    if not path.exists():
        raise ConfigError(f"no config.json in {path.parent}")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path} is not valid JSON: {e}") from None
