"""The environment variables ferryman reads: debugging aids and escape hatches, never settings,
and one secret (FERRYMAN_API_KEY, the server's API key, which a command line would show in `ps`).

    from ferryman.envs import envs
    if envs.KERNELS == "torch": ...

The three variables are read together, once: at the first `envs.X` of the process (the CLI reads
them at start). An unset or empty variable gives the default; a bad value raises ConfigError
naming the variable and the value, and so does a secret set but blank (its value is never shown).
Tests that change one either call `envs.reload()` after setting the environment, or
`monkeypatch.setattr(envs, "X", value)`. docs/configuration.md lists
them; every user choice is a field of `EngineConfig` instead (config.py).
"""

from __future__ import annotations

import logging
import os
from typing import Any, NoReturn

from ferryman.errors import ConfigError



class EnvVar:
    """One string variable: its name, default and the allowed choices (None: any value)."""

    def __init__(self, name: str, default: str, choices: tuple[str, ...] | None = None,
                 secret: bool = False) -> None:
        if choices is not None and default not in choices:
            raise ValueError(f"EnvVar {name}: the default {default!r} is not among its choices {choices}")
        self.name, self.default, self.choices = name, default, choices
        self.secret = secret  # taken as is, never shown; set but blank is an error (no silent "no key")

    def parse(self, raw: str) -> str:
        """Value of the raw string `raw`; ConfigError naming the variable if it is invalid."""
        word = raw.strip()
        if self.secret:
            if not word:
                raise ConfigError(f"environment variable {self.name} is set but empty; unset it or give a value")
            return word
        for choice in self.choices or (word,):  # choices match case-insensitively, canonical spelling
            if choice.lower() == word.lower():
                return choice
        self._invalid(raw, f"expected one of {'|'.join(self.choices or ())}")

    def _invalid(self, raw: str, detail: str) -> NoReturn:
        raise ConfigError(f"environment variable {self.name}={raw!r} is invalid: {detail}")

    def get(self) -> str:
        """The value in os.environ now (the default when unset or empty)."""
        raw = os.environ.get(self.name)
        if raw is None or (not raw.strip() and not self.secret):
            return self.default
        return self.parse(raw)


VARS: dict[str, EnvVar] = {
    # DEBUG also does what the CLI's --debug does: full tracebacks
    "LOG_LEVEL": EnvVar("FERRYMAN_LOG_LEVEL", "INFO", ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")),
    # torch: the torch paths everywhere (no Triton kernels, no CPU expert kernel)
    "KERNELS": EnvVar("FERRYMAN_KERNELS", "auto", ("auto", "torch", "triton")),
    "API_KEY": EnvVar("FERRYMAN_API_KEY", "", secret=True),  # `ferryman serve`'s key ("": none)
}


class Envs:
    """`envs.LOG_LEVEL`, `envs.KERNELS`, `envs.API_KEY`: the values read at the first access (or
    the last `reload`)."""

    LOG_LEVEL: str
    KERNELS: str
    API_KEY: str

    def reload(self) -> None:
        """Read all three from os.environ again (every one is parsed before any is kept); warn
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
