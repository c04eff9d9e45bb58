"""The three environment variables: parsing, defaults, errors naming the variable, read once."""

from __future__ import annotations

import pytest

from ferryman.envs import VARS, EnvVar, Envs, envs
from ferryman.errors import ConfigError, FerrymanError

FINAL = {
    "FERRYMAN_LOG_LEVEL": "INFO",
    "FERRYMAN_KERNELS": "auto",
    "FERRYMAN_API_KEY": "",
}


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch):
    for name in FINAL:
        monkeypatch.delenv(name, raising=False)
    yield
    monkeypatch.undo()
    envs.reload()  # later tests see the real environment again


def test_the_three_variables_and_their_defaults() -> None:
    assert {v.name: v.default for v in VARS.values()} == FINAL
    fresh = Envs()
    got = (fresh.LOG_LEVEL, fresh.KERNELS, fresh.API_KEY)
    assert got == tuple(FINAL.values())


def test_read_once_until_reload(monkeypatch: pytest.MonkeyPatch) -> None:
    fresh = Envs()
    monkeypatch.setenv("FERRYMAN_KERNELS", "torch")
    assert fresh.KERNELS == "torch"
    monkeypatch.setenv("FERRYMAN_KERNELS", "triton")
    monkeypatch.setenv("FERRYMAN_LOG_LEVEL", "DEBUG")
    assert (fresh.KERNELS, fresh.LOG_LEVEL) == ("torch", "INFO")  # all three were read at the first access
    fresh.reload()
    assert (fresh.KERNELS, fresh.LOG_LEVEL) == ("triton", "DEBUG")


def test_monkeypatching_an_attribute(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(envs, "KERNELS", "torch")
    assert envs.KERNELS == "torch"


def test_variables_ferryman_no_longer_reads_are_named_in_a_warning(monkeypatch: pytest.MonkeyPatch,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("FERRYMAN_ZERO_COPY", "1")
    with caplog.at_level("WARNING", logger="ferryman"):
        Envs().reload()
    assert "ignoring FERRYMAN_ZERO_COPY" in caplog.text and "FERRYMAN_KERNELS" in caplog.text
    monkeypatch.delenv("FERRYMAN_ZERO_COPY")
    caplog.clear()
    with caplog.at_level("WARNING", logger="ferryman"):
        Envs().reload()
    assert "ignoring" not in caplog.text


def test_unknown_names_are_attribute_errors() -> None:
    with pytest.raises(AttributeError, match="FERRYMAN_NO_SUCH"):
        getattr(Envs(), "NO_SUCH")


@pytest.mark.parametrize("name", ["FERRYMAN_DEBUG", "FERRYMAN_CACHE_DIR", "FERRYMAN_CPU_KERNEL"])
def test_retired_variables_are_named_in_the_warning(monkeypatch: pytest.MonkeyPatch, name: str,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    """Folded into FERRYMAN_LOG_LEVEL=DEBUG, $XDG_CACHE_HOME and FERRYMAN_KERNELS=torch."""
    monkeypatch.setenv(name, "1")
    with caplog.at_level("WARNING", logger="ferryman"):
        Envs().reload()
    assert f"ignoring {name}" in caplog.text


def test_choices_are_case_insensitive_and_canonical(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FERRYMAN_KERNELS", " Triton ")
    monkeypatch.setenv("FERRYMAN_LOG_LEVEL", "debug")
    fresh = Envs()
    assert (fresh.KERNELS, fresh.LOG_LEVEL) == ("triton", "DEBUG")


@pytest.mark.parametrize(
    "name, raw, hint",
    [
        ("FERRYMAN_KERNELS", "cutlass", "auto|torch|triton"),
        ("FERRYMAN_LOG_LEVEL", "loud", "DEBUG|INFO"),
    ],
)
def test_bad_values_name_variable_and_value(monkeypatch: pytest.MonkeyPatch, name: str, raw: str, hint: str) -> None:
    monkeypatch.setenv(name, raw)
    with pytest.raises(ConfigError) as err:
        Envs().reload()
    message = str(err.value)
    assert name in message and repr(raw) in message and hint in message
    assert "\n" not in message
    assert isinstance(err.value, ValueError) and isinstance(err.value, FerrymanError)


def test_bad_declarations() -> None:
    with pytest.raises(ValueError, match="FERRYMAN_Y"):
        EnvVar("FERRYMAN_Y", "fast", choices=("a", "b"))


def test_the_api_key_is_taken_as_is_and_never_blank(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FERRYMAN_API_KEY", " s3cret-Key ")
    assert Envs().API_KEY == "s3cret-Key"
    monkeypatch.setenv("FERRYMAN_API_KEY", "  ")
    with pytest.raises(ConfigError, match="FERRYMAN_API_KEY is set but empty") as err:
        Envs().reload()
    assert "'  '" not in str(err.value)
