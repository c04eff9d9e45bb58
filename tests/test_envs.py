"""Typed environment variables: parsing, defaults, errors that name the variable and value."""

from __future__ import annotations

import pytest

from ferryman.envs import EnvVar, Envs, all_vars, describe, envs, snapshot
from ferryman.errors import ConfigError, FerrymanError

EXPECTED_NAMES = [
    "FERRYMAN_MOE_BACKEND",
    "FERRYMAN_ATTN_BACKEND",
    "FERRYMAN_MOE_PREFILL",
    "FERRYMAN_MOE_PREFILL_GROUP",
    "FERRYMAN_MOE_DECODE_TILES",
    "FERRYMAN_LOG_LEVEL",
    "FERRYMAN_DISABLE_CUDA_GRAPHS",
    "FERRYMAN_SEGMENT_GRAPHS",
    "FERRYMAN_PREFILL_LOOKAHEAD",
    "FERRYMAN_HOST_EMBEDDING",
    "FERRYMAN_WINDOW_KV",
    "FERRYMAN_EXPANDABLE_SEGMENTS",
    "FERRYMAN_PREFETCH_AFTER_KERNELS",
    "FERRYMAN_PREFETCH_BEFORE_GROUPS",
    "FERRYMAN_INPUTS_ON_COPY_STREAM",
    "FERRYMAN_STREAM_EVEN",
    "FERRYMAN_MOE_GRAPHS",
    "FERRYMAN_DECODE_PREFETCH",
    "FERRYMAN_DECODE_PREFETCH_MAX_SEQS",
    "FERRYMAN_DECODE_GAP_GUESS",
    "FERRYMAN_PREFETCH_AVOID_BUSY",
    "FERRYMAN_PREFETCH_SPLIT_BUSY",
    "FERRYMAN_DECODE_WRAP_GUESS",
    "FERRYMAN_DECODE_PREFETCH_TOPK",
    "FERRYMAN_DECODE_PREFETCH_SOLO_TOPK",
    "FERRYMAN_ZERO_COPY",
    "FERRYMAN_ZERO_COPY_STAGE",
    "FERRYMAN_CPU_KERNEL",
    "FERRYMAN_CPU_THREADS",
    "FERRYMAN_HYBRID_MIN_CPU",
    "FERRYMAN_CACHE_DIR",
    "FERRYMAN_DEBUG",
]


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in EXPECTED_NAMES + ["FERRYMAN_TEST_INT", "FERRYMAN_TEST_FLOAT"]:
        monkeypatch.delenv(name, raising=False)


def test_registry_and_defaults() -> None:
    assert [v.name for v in all_vars()] == EXPECTED_NAMES
    assert snapshot() == {
        "FERRYMAN_MOE_BACKEND": "auto",
        "FERRYMAN_ATTN_BACKEND": "auto",
        "FERRYMAN_MOE_PREFILL": "auto",
        "FERRYMAN_MOE_PREFILL_GROUP": 8,
        "FERRYMAN_MOE_DECODE_TILES": "",
        "FERRYMAN_LOG_LEVEL": "INFO",
        "FERRYMAN_DISABLE_CUDA_GRAPHS": False,
        "FERRYMAN_SEGMENT_GRAPHS": True,
        "FERRYMAN_PREFILL_LOOKAHEAD": 1,
        "FERRYMAN_HOST_EMBEDDING": True,
        "FERRYMAN_WINDOW_KV": True,
        "FERRYMAN_PREFETCH_AFTER_KERNELS": True,
        "FERRYMAN_EXPANDABLE_SEGMENTS": True,
        "FERRYMAN_PREFETCH_BEFORE_GROUPS": True,
        "FERRYMAN_INPUTS_ON_COPY_STREAM": "prefill",
        "FERRYMAN_STREAM_EVEN": True,
        "FERRYMAN_MOE_GRAPHS": True,
        "FERRYMAN_DECODE_PREFETCH": "early",
        "FERRYMAN_DECODE_PREFETCH_MAX_SEQS": 0,
        "FERRYMAN_DECODE_GAP_GUESS": 1,
        "FERRYMAN_PREFETCH_AVOID_BUSY": True,
        "FERRYMAN_PREFETCH_SPLIT_BUSY": False,
        "FERRYMAN_DECODE_WRAP_GUESS": True,
        "FERRYMAN_DECODE_PREFETCH_TOPK": 0,
        "FERRYMAN_DECODE_PREFETCH_SOLO_TOPK": 0,
        "FERRYMAN_ZERO_COPY": False,
        "FERRYMAN_ZERO_COPY_STAGE": 0,
        "FERRYMAN_CPU_KERNEL": True,
        "FERRYMAN_CPU_THREADS": 0,
        "FERRYMAN_HYBRID_MIN_CPU": 2,
        "FERRYMAN_CACHE_DIR": "",
        "FERRYMAN_DEBUG": False,
    }
    assert isinstance(Envs.MOE_BACKEND, EnvVar)  # class access gives the descriptor


@pytest.mark.parametrize(
    "raw, want",
    [("1", True), ("true", True), ("YES", True), (" on ", True),
     ("0", False), ("False", False), ("no", False), ("off", False), ("", False)],
)
def test_bool_parsing(monkeypatch: pytest.MonkeyPatch, raw: str, want: bool) -> None:
    monkeypatch.setenv("FERRYMAN_DISABLE_CUDA_GRAPHS", raw)
    assert envs.DISABLE_CUDA_GRAPHS is want


def test_choices_are_case_insensitive_and_canonical(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FERRYMAN_MOE_BACKEND", "Triton")
    monkeypatch.setenv("FERRYMAN_ATTN_BACKEND", " torch ")
    monkeypatch.setenv("FERRYMAN_LOG_LEVEL", "debug")
    assert (envs.MOE_BACKEND, envs.ATTN_BACKEND, envs.LOG_LEVEL) == ("triton", "torch", "DEBUG")


@pytest.mark.parametrize(
    "name, raw, hint",
    [
        ("FERRYMAN_MOE_BACKEND", "cutlass", "auto|torch|triton"),
        ("FERRYMAN_LOG_LEVEL", "loud", "DEBUG|INFO"),
        ("FERRYMAN_DEBUG", "maybe", "1/true/yes/on"),
    ],
)
def test_bad_values_name_variable_and_value(
    monkeypatch: pytest.MonkeyPatch, name: str, raw: str, hint: str
) -> None:
    monkeypatch.setenv(name, raw)
    var = next(v for v in all_vars() if v.name == name)
    with pytest.raises(ConfigError) as err:
        var.get()
    message = str(err.value)
    assert name in message and repr(raw) in message and hint in message
    assert "\n" not in message
    assert isinstance(err.value, ValueError) and isinstance(err.value, FerrymanError)
    with pytest.raises(ConfigError):
        snapshot()


def test_int_and_float(monkeypatch: pytest.MonkeyPatch) -> None:
    count = EnvVar("FERRYMAN_TEST_INT", int, 4, "a count")
    ratio = EnvVar("FERRYMAN_TEST_FLOAT", float, 0.5, "a ratio")
    assert (count.get(), ratio.get()) == (4, 0.5)
    monkeypatch.setenv("FERRYMAN_TEST_INT", " 12 ")
    monkeypatch.setenv("FERRYMAN_TEST_FLOAT", "1e-3")
    assert (count.get(), ratio.get()) == (12, 1e-3)
    monkeypatch.setenv("FERRYMAN_TEST_INT", "1.5")
    with pytest.raises(ConfigError, match=r"FERRYMAN_TEST_INT='1.5' is invalid: expected int"):
        count.get()


def test_bad_declarations() -> None:
    with pytest.raises(ValueError, match="FERRYMAN_X"):
        EnvVar("FERRYMAN_X", list, [], "no lists")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="FERRYMAN_Y"):
        EnvVar("FERRYMAN_Y", str, "fast", "default outside choices", choices=("a", "b"))


def test_describe_lists_every_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FERRYMAN_DEBUG", "1")
    lines = describe().splitlines()
    assert len(lines) == 1 + len(EXPECTED_NAMES)
    for name, line in zip(EXPECTED_NAMES, lines[1:]):
        assert line.split()[0] == name
    debug = lines[-1]
    assert "bool" in debug and "default False" in debug and "[set: 1]" in debug
    assert "auto|torch|triton" in lines[1] and "default auto" in lines[1]
