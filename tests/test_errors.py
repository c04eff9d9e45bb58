"""User-facing errors: one-line messages that carry the facts, and the expected hierarchy."""

from __future__ import annotations

import pytest
import torch

from ferryman.errors import (
    ConfigError,
    EngineDeadError,
    FerrymanError,
    ModelLoadError,
    PromptTooLongError,
    UnsupportedModelError,
    WeightError,
)


def test_weight_error_message() -> None:
    err = WeightError("model.layers.3.mlp.router.weight", "model-00002.safetensors",
                      expected=(32, 2880), actual=torch.Size([32, 2048]))
    assert str(err) == (
        "weight 'model.layers.3.mlp.router.weight' in model-00002.safetensors: shape mismatch "
        "(expected shape [32, 2880], got [32, 2048])"
    )
    assert (err.expected, err.actual) == ((32, 2880), (32, 2048))
    missing = WeightError("lm_head.weight", "model.safetensors.index.json", reason="missing")
    assert str(missing) == "weight 'lm_head.weight' in model.safetensors.index.json: missing"


def test_prompt_too_long_carries_both_numbers() -> None:
    err = PromptTooLongError(5000, 4096)
    assert "5000" in str(err) and "4096" in str(err)
    assert (err.prompt_len, err.max_len) == (5000, 4096)
    assert isinstance(err, ValueError)


def test_messages_are_one_line_and_exit_code_is_2() -> None:
    err = ConfigError("bad value\n  for --max-model-len")
    assert str(err) == "bad value for --max-model-len"
    for cls in (ConfigError, ModelLoadError, UnsupportedModelError):
        assert cls("x").exit_code == 2
    assert EngineDeadError().exit_code == 2
    assert str(EngineDeadError("worker 0 exited with code -9")) == (
        "engine is dead: worker 0 exited with code -9"
    )


@pytest.mark.parametrize(
    "err, bases",
    [
        (ConfigError("x"), (FerrymanError, ValueError)),
        (UnsupportedModelError("x"), (ModelLoadError, FerrymanError)),
        (WeightError("t", "f"), (ModelLoadError, FerrymanError)),
        (EngineDeadError(), (FerrymanError, RuntimeError)),
    ],
)
def test_hierarchy(err: Exception, bases: tuple[type, ...]) -> None:
    assert all(isinstance(err, b) for b in bases)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(moe_strategy="hybrids"), "moe_strategy"),
        (dict(moe_strategy="layers:x"), "moe_strategy"),
        (dict(moe_strategy="cpu:2"), "moe_strategy"),
        (dict(gpu_memory="lots"), "gpu_memory"),
        (dict(expert_cache="150%"), "expert_cache"),
        (dict(load_format="ggml"), "load_format"),
        (dict(max_model_len=0), "max_model_len"),
        (dict(kv_cache_tokens=0), "kv_cache_tokens"),
        (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization"),
        (dict(kv_cache_dtype="int4"), "kv_cache_dtype"),
        (dict(device="tpu"), "device"),
    ],
)
def test_engine_config_names_the_bad_field(kwargs: dict, field: str) -> None:
    from ferryman.config import EngineConfig

    with pytest.raises(ConfigError, match=field):
        EngineConfig(model="m", **kwargs)


def test_offload_settings_reach_the_offload_config() -> None:
    from ferryman.config import EngineConfig, OffloadConfig

    ecfg = EngineConfig(model="m", gpu_memory="8GiB", expert_cache=64, moe_strategy="layers:3", decode_prefetch=False)
    assert ecfg.offload == OffloadConfig(gpu_memory="8GiB", expert_cache=64, moe_strategy="layers:3",
                                         decode_prefetch=False)
    with pytest.raises(ConfigError, match="moe_strategy"):
        OffloadConfig(moe_strategy="sometimes")
