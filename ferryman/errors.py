"""User-facing errors. The CLI prints `str(err)` (one line) and exits with `err.exit_code`.

Anything that is not a FerrymanError is a bug and keeps its traceback.
"""

from __future__ import annotations

from collections.abc import Sequence


class FerrymanError(Exception):
    """Base of the errors a user can fix; the message is a single line."""

    exit_code: int = 2

    def __init__(self, message: str) -> None:
        # Invariant: one line, so the CLI and log parsers can print it as is.
        super().__init__(" ".join(str(message).split()))


class ConfigError(FerrymanError, ValueError):
    """A bad option, environment variable or config field."""


class InvalidParameterError(FerrymanError, ValueError):
    """A bad request parameter; `param` names it (the HTTP server's 400 names the same field)."""

    def __init__(self, param: str, message: str) -> None:
        self.param = param
        super().__init__(message)


class ModelLoadError(FerrymanError):
    """The model folder or checkpoint cannot be loaded."""


class UnsupportedModelError(ModelLoadError):
    """The architecture or quantisation is not one ferryman runs."""


def _shape(shape: Sequence[int] | None) -> str:
    return "?" if shape is None else "[" + ", ".join(str(int(s)) for s in shape) + "]"


class WeightError(ModelLoadError):
    """A checkpoint tensor is missing, unexpected or of the wrong shape."""

    def __init__(
        self,
        tensor: str,
        file: str,
        expected: Sequence[int] | None = None,
        actual: Sequence[int] | None = None,
        reason: str = "shape mismatch",
    ) -> None:
        self.tensor, self.file = tensor, file
        self.expected = None if expected is None else tuple(int(s) for s in expected)
        self.actual = None if actual is None else tuple(int(s) for s in actual)
        message = f"weight {tensor!r} in {file}: {reason}"
        if expected is not None or actual is not None:
            message += f" (expected shape {_shape(expected)}, got {_shape(actual)})"
        super().__init__(message)


class PromptTooLongError(FerrymanError, ValueError):
    """A prompt does not fit the model's context (`max_model_len`)."""

    def __init__(self, prompt_len: int, max_len: int) -> None:
        self.prompt_len, self.max_len = prompt_len, max_len
        super().__init__(
            f"prompt is {prompt_len} tokens long; the limit is {max_len} tokens (max_model_len)"
        )


class EngineDeadError(FerrymanError, RuntimeError):
    """The engine stopped (a worker died or a step raised); no further request is served."""

    def __init__(self, reason: str = "") -> None:
        super().__init__("engine is dead" + (f": {reason}" if reason else ""))
