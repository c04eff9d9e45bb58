"""Chat templates rendered under limits: a deadline for any template, a size bound for client ones.

The model's own template renders through transformers' `apply_chat_template` (an
`ImmutableSandboxedEnvironment`: no attribute escapes, no mutation of lists and dicts). A template
sent by a client (accepted only under `--trust-request-chat-template`) renders in `BoundedSandbox`,
the same sandbox with the same helpers, which also refuses any value larger than `max_chars`
(string or list repetition, `~` and `+`, filters and str methods whose output an argument sizes,
printf widths, huge powers) *before* building it, and stops its output at `max_chars`.

Time: `deadline(seconds)` traces the Python frames of the calling thread and raises
`TemplateLimitError` at the first template line (or any function call) run after the deadline, so
a template's loops (nested `range`s, loops over long strings) stop there. Rendering runs in a worker thread
(`state.PromptWorkers`), so the trace never slows the event loop.
"""

from __future__ import annotations

import functools
import json
import re
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime
from types import FrameType
from typing import Any

from jinja2 import nodes
from jinja2.compiler import CodeGenerator, Frame
from jinja2.exceptions import TemplateError
from jinja2.ext import Extension, loopcontrols
from jinja2.parser import Parser
from jinja2.sandbox import ImmutableSandboxedEnvironment

_WIDE_FORMAT = re.compile(r"\d{7,}")  # a printf / str.format width of a million or more
_MAX_POWER_BITS = 4096  # `a ** b` on ints: at most this many bits in the result
_ENTRY_COST = 4  # a list or dict entry's share of its repr: quotes, comma, space


class TemplateLimitError(TemplateError):
    """A template went over its time or size limit (the message says which)."""


@contextmanager
def deadline(seconds: float, what: str = "the chat template") -> Iterator[None]:
    """Raise TemplateLimitError in this thread's Python code once `seconds` have passed."""
    end = time.monotonic() + seconds
    previous = sys.gettrace()

    def trace(frame: FrameType, event: str, arg: Any) -> Any:
        if time.monotonic() > end:
            raise TemplateLimitError(f"{what} ran for more than {seconds:g} s")
        # line events only in compiled templates (their loops); other frames are checked as they start
        return trace if frame.f_code.co_filename == "<template>" else None

    sys.settrace(trace)
    try:
        yield
    finally:
        sys.settrace(previous)


def weight(value: Any, cap: int) -> int:
    """About how many characters `value` takes as text (its repr for containers); stops counting
    past `cap`, so the cost is bounded by the cap, not the value."""
    total, todo = 0, [value]
    while todo and total <= cap:
        v = todo.pop()
        if isinstance(v, (str, bytes)):
            total += len(v)
        elif isinstance(v, int):
            total += v.bit_length() // 3 + 1
        elif isinstance(v, dict):
            total += _ENTRY_COST * len(v)
            todo.extend(v.keys())
            todo.extend(v.values())
        elif isinstance(v, (list, tuple, set, frozenset)):
            total += _ENTRY_COST * len(v)
            todo.extend(v)
        else:
            total += 8
    return total


class _GenerationTag(Extension):
    """`{% generation %}...{% endgeneration %}` (assistant-token masks in some templates): rendered
    as its body, as transformers does when no mask is asked for."""

    tags = {"generation"}

    def parse(self, parser: Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body).set_lineno(lineno)


class _BoundedCodeGenerator(CodeGenerator):
    """`a ~ b` goes through `environment.bounded_concat`, which checks the size first."""

    def visit_Concat(self, node: nodes.Concat, frame: Frame) -> None:
        self.write("environment.bounded_concat((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    """transformers' `tojson`: no HTML escaping, json.dumps' options."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """transformers' chat-template sandbox, with every value and the output at most `max_chars`."""

    intercepted_binops = frozenset({"*", "+", "%", "**"})
    code_generator_class = _BoundedCodeGenerator

    def __init__(self, max_chars: int) -> None:
        super().__init__(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, _GenerationTag],
                         finalize=self._finalize)
        self.max_chars = max_chars
        self.filters["tojson"] = _tojson
        self.filters = {name: self._bounded_filter(name, f) for name, f in self.filters.items()}
        self.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)
        # lipsum(n) builds n paragraphs in Python code the deadline does not see line by line
        self.globals.pop("lipsum", None)

    # ---- checks --------------------------------------------------------------------------------
    def _refuse(self, what: str) -> None:
        raise TemplateLimitError(f"the chat template would build {what}; the limit is {self.max_chars} characters")

    def _check(self, value: Any, what: str = "a value") -> Any:
        if weight(value, self.max_chars) > self.max_chars:
            self._refuse(f"{what} over the limit")
        return value

    def _check_size(self, size: int, what: str) -> None:
        if size > self.max_chars:
            self._refuse(f"{what} of about {size} characters")

    def _check_args(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Sizes given as arguments (widths, counts) and printf formats, before anything is built."""
        for a in (*args, *kwargs.values()):
            if isinstance(a, int) and not isinstance(a, bool) and abs(a) > self.max_chars:
                self._refuse(f"a value sized by the argument {a}")

    def _check_builders(self, name: str, first: Any, args: tuple[Any, ...]) -> None:
        """join / replace / formats: their output size from their inputs' sizes."""
        cap = self.max_chars
        if name == "join" and isinstance(first, (list, tuple)):
            sep = args[0] if args and isinstance(args[0], str) else ""
            self._check_size(weight(first, cap) + len(sep) * len(first), "a join")
        elif name == "join" and isinstance(first, str) and args and isinstance(args[0], (list, tuple)):
            self._check_size(weight(args[0], cap) + len(first) * len(args[0]), "a join")
        elif name == "replace" and isinstance(first, str) and len(args) >= 2:
            old, new = str(args[0]), str(args[1])
            hits = first.count(old) if old else len(first) + 1
            self._check_size(len(first) + hits * len(new), "a replace")
        elif name in ("format", "format_map") and isinstance(first, str) and _WIDE_FORMAT.search(first):
            self._refuse("a formatted value with a width of a million or more")

    # ---- hooks ---------------------------------------------------------------------------------
    def _bounded_filter(self, name: str, f: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(f)  # keeps jinja's pass_context / pass_environment marks
        def bounded(*args: Any, **kwargs: Any) -> Any:
            self._check_args(args, kwargs)
            values = [a for a in args if not hasattr(a, "environment")]  # skip context / environment
            if values:
                self._check_builders(name, values[0], tuple(values[1:]))
            return self._check(f(*args, **kwargs), f"the output of the filter '{name}'")

        return bounded

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        __self._check_args(args, kwargs)
        owner = getattr(__obj, "__self__", None)
        if isinstance(owner, (str, list, tuple, dict)):  # a method of a value: 'x'.center(...), ...
            __self._check_builders(getattr(__obj, "__name__", ""), owner, args)
        result = super().call(__context, __obj, *args, **kwargs)
        return __self._check(result, "the result of a call")

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "*":
            self._check_repeat(left, right)
        elif operator == "**" and isinstance(left, int) and isinstance(right, int):
            if right > 0 and abs(left) > 1 and right * left.bit_length() > _MAX_POWER_BITS:
                self._refuse(f"the number {left} ** {right}")
        elif operator == "%" and isinstance(left, str) and _WIDE_FORMAT.search(left):
            self._refuse("a formatted value with a width of a million or more")
        elif operator == "+":
            self._check_size(weight(left, self.max_chars) + weight(right, self.max_chars), "a sum")
        return self._check(super().call_binop(context, operator, left, right), f"the result of '{operator}'")

    def _check_repeat(self, left: Any, right: Any) -> None:
        if isinstance(left, int) and isinstance(right, int):
            if left.bit_length() + right.bit_length() > _MAX_POWER_BITS:
                self._refuse("a number of more than 4096 bits")
            return
        seq, times = (left, right) if isinstance(right, int) else (right, left)
        if isinstance(times, int) and isinstance(seq, (str, list, tuple)):
            self._check_size(weight(seq, self.max_chars) * max(times, 0), "a repetition")

    def bounded_concat(self, parts: tuple[Any, ...]) -> str:
        texts = [str(self._check(p)) for p in parts]
        self._check_size(sum(map(len, texts)), "a '~' concatenation")
        return "".join(texts)

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        owner = getattr(value, "__self__", None)
        if isinstance(owner, str) and getattr(value, "__name__", "") in ("format", "format_map"):
            self._check_builders("format", owner, ())
        return super().wrap_str_format(value)

    def _finalize(self, value: Any) -> Any:
        return self._check(value, "an output value")

    # ---- rendering -----------------------------------------------------------------------------
    def render(self, source: str, variables: dict[str, Any]) -> str:
        """The template's text; TemplateLimitError once the output passes max_chars."""
        out: list[str] = []
        size = 0
        for piece in self.from_string(source).generate(**variables):
            size += len(piece)
            if size > self.max_chars:
                self._refuse("an output over the limit")
            out.append(piece)
        return "".join(out)
