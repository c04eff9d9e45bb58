"""Architecture registry, keyed by Hugging Face `model_type`."""

from __future__ import annotations

from ferryman.errors import UnsupportedModelError
from ferryman.models.base import Architecture

_REGISTRY: dict[str, Architecture] = {}


def register(arch: Architecture) -> Architecture:
    _REGISTRY[arch.model_type] = arch
    return arch


def supported_model_types() -> list[str]:
    _load_builtin()
    return sorted(_REGISTRY)


def get_architecture(model_type: str) -> Architecture:
    _load_builtin()
    if model_type not in _REGISTRY:
        raise UnsupportedModelError(
            f"unsupported model_type {model_type!r}; supported: {', '.join(sorted(_REGISTRY))}"
        )
    return _REGISTRY[model_type]


def _load_builtin() -> None:
    # importing the modules registers them
    from ferryman.models import gpt_oss, mixtral, olmoe, qwen3_moe  # noqa: F401
