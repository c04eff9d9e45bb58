"""The environment variables ferryman reads: debugging aids and escape hatches, never settings,
and one secret (FERRYMAN_API_KEY, the server's API key, which a command line would show in `ps`).

    from ferryman.envs import envs
    if envs.KERNELS == "torch": ...

The six variables are read together, once: at the first `envs.X` of the process (the CLI reads
them at start). An unset or empty variable gives the default; a bad value raises ConfigError
naming the variable and the value, and so does a secret set but blank (its value is never shown).
Tests that change one either call `envs.reload()` after setting the environment, or
`monkeypatch.setattr(envs, "X", value)`. docs/configuration.md lists
them; every user choice is a field of `EngineConfig` instead (config.py).
"""

from __future__ import annotations

import logging
import os
from typing import Any, Generic, NoReturn, TypeVar

from ferryman.errors import ConfigError

T = TypeVar("T", bool, str)

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


class EnvVar(Generic[T]):
    """One typed variable: its name, type, default and, for strings, the allowed choices."""

    def __init__(self, name: str, type_: type[T], default: T, choices: tuple[str, ...] | None = None,
                 secret: bool = False) -> None:
        if type_ not in (bool, str):
            raise ValueError(f"EnvVar {name}: type must be bool or str, not {type_!r}")
        if choices is not None and (type_ is not str or default not in choices):
            raise ValueError(f"EnvVar {name}: choices need type str and a default among them")
        self.name, self.type, self.default, self.choices = name, type_, default, choices
        self.secret = secret  # taken as is, never shown; set but blank is an error (no silent "no key")

    def parse(self, raw: str) -> T:
        """Value of the raw string `raw`; ConfigError naming the variable if it is invalid."""
        word = raw.strip()
        if self.secret:
            if not word:
                raise ConfigError(f"environment variable {self.name} is set but empty; unset it or give a value")
            return word  # type: ignore[return-value]
        if self.type is bool:
            if word.lower() not in _TRUE + _FALSE:
                self._invalid(raw, f"expected one of {'/'.join(_TRUE + _FALSE)}")
            return word.lower() in _TRUE  # type: ignore[return-value]
        for choice in self.choices or (word,):  # choices match case-insensitively, canonical spelling
            if choice.lower() == word.lower():
                return choice  # type: ignore[return-value]
        self._invalid(raw, f"expected one of {'|'.join(self.choices or ())}")

    def _invalid(self, raw: str, detail: str) -> NoReturn:
        raise ConfigError(f"environment variable {self.name}={raw!r} is invalid: {detail}")

    def get(self) -> T:
        """The value in os.environ now (the default when unset or empty)."""
        raw = os.environ.get(self.name)
        if raw is None or (not raw.strip() and not self.secret):
            return self.default
        return self.parse(raw)


VARS: dict[str, EnvVar[Any]] = {
    "LOG_LEVEL": EnvVar("FERRYMAN_LOG_LEVEL", str, "INFO", ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")),
    "DEBUG": EnvVar("FERRYMAN_DEBUG", bool, False),  # as the CLI's --debug
    "CACHE_DIR": EnvVar("FERRYMAN_CACHE_DIR", str, ""),  # built CPU kernels ("": ~/.cache/ferryman)
    "KERNELS": EnvVar("FERRYMAN_KERNELS", str, "auto", ("auto", "torch", "triton")),
    "CPU_KERNEL": EnvVar("FERRYMAN_CPU_KERNEL", bool, True),  # 0: MXFP4 on the CPU without the C kernel
    "API_KEY": EnvVar("FERRYMAN_API_KEY", str, "", secret=True),  # `ferryman serve`'s key ("": none)
}


class Envs:
    """`envs.LOG_LEVEL`, `envs.DEBUG`, `envs.CACHE_DIR`, `envs.KERNELS`, `envs.CPU_KERNEL`,
    `envs.API_KEY`: the values read at the first access (or the last `reload`)."""

    LOG_LEVEL: str
    DEBUG: bool
    CACHE_DIR: str
    KERNELS: str
    CPU_KERNEL: bool
    API_KEY: str

    def reload(self) -> None:
        """Read all six from os.environ again (every one is parsed before any is kept); warn
        about other FERRYMAN_* variables set, which ferryman does not read."""
        self.__dict__.update({attr: var.get() for attr, var in VARS.items()})
        known = {var.name for var in VARS.values()}
        unread = sorted(k for k in os.environ if k.startswith("FERRYMAN_") and k not in known)
        if unread:
            logging.getLogger("ferryman").warning(
                "ignoring %s: ferryman reads only %s; settings are flags and LLM(...) arguments "
                "(docs/configuration.md)", ", ".join(unread), ", ".join(sorted(known)))

    def __getattr__(self, attr: str) -> Any:  # only for names not yet in the instance dict
        if attr in VARS:
            self.reload()
            return self.__dict__[attr]
        raise AttributeError(f"ferryman reads no environment variable FERRYMAN_{attr}")


envs = Envs()
