"""Tools for multi-turn agent RL: parse the tool calls a model writes, run them, return results.

    calls = tool_parser("hermes")(response_text)          # [ToolCall(name, arguments, error)]
    toolbox = Toolbox(["python_exec", "my_tools.py:search"], timeout_s=10)
    prompt = tokenizer.apply_chat_template(messages, tools=toolbox.schemas, ...)
    results = [toolbox.call(c) for c in calls]            # [ToolResult(name, text, status)]

A malformed call (bad JSON, no name, a `<tool_call>` cut off at the end of the response) is a
`ToolCall` whose `error` says what is wrong; `Toolbox.call` turns it, an unknown tool, arguments
that do not fit the function, an exception or a timeout into a result the model reads (status
"error" or "timeout"), never into a crash: the model learns from its mistakes. `tool_counts`
gives the numbers of each status for the step metrics. A parser is a registered name (`PARSERS`,
built-in "hermes"; `register_tool_parser`) or a `file.py:fn` / `module:fn` reference.

Tools are typed functions with a docstring (Args section), named by built-in name ("python_exec")
or by reference, `file.py:fn` / `module:fn`; their schemas are `transformers.utils.get_json_schema`'s.
Argument types are not checked: a function receives the JSON values the model wrote.
"""

from __future__ import annotations

import difflib
import inspect
import json
import logging
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

from transformers.utils import DocstringParsingException, TypeHintParsingException, get_json_schema

from raygraph.algos.user_code import UserCodeError, is_code_ref, load_function

__all__ = ["ToolCall", "ToolResult", "ToolParser", "STATUSES", "PARSERS", "BUILTIN_TOOLS", "register_tool_parser",
           "tool_parser", "parse_hermes", "Toolbox", "tool_counts"]

log = logging.getLogger(__name__)

STATUSES = ("ok", "error", "timeout")

# Built-in tools by name -> reference; a tool's module is imported only when a Toolbox asks for it.
BUILTIN_TOOLS = {"python_exec": "raygraph.agents.sandbox:python_exec",
                 "calculator": "raygraph.agents.calculator:calculator"}


@dataclass(frozen=True)
class ToolCall:
    """One tool call as the model wrote it; `error` (shown to the model) is set when it is malformed."""

    name: str
    arguments: dict
    error: str | None = None


@dataclass(frozen=True)
class ToolResult:
    """What one tool call returned: `text` is what the model reads, `status` one of `STATUSES`."""

    name: str
    text: str
    status: str

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"tool result status {self.status!r} is not one of {', '.join(STATUSES)}")


ToolParser = Callable[[str], list[ToolCall]]

_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_HERMES_SHAPE = '{"name": ..., "arguments": {...}}'


def parse_hermes(text: str) -> list[ToolCall]:
    """Every `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` block of `text`, in order
    (the format of Hermes and Qwen chat templates).

    `arguments` may be an object or a JSON string holding one, and may be left out (no arguments).
    A block that is not such an object, and a `<tool_call>` never closed (the response was cut),
    give a `ToolCall` with `error` set; text outside the blocks is ignored.
    """
    calls, pos = [], 0
    while (start := text.find(_OPEN, pos)) != -1:
        end = text.find(_CLOSE, start)
        if end == -1:
            calls.append(ToolCall("", {}, f"{_OPEN} is never closed by {_CLOSE} (the response was cut)"))
            break
        calls.append(_hermes_call(text[start + len(_OPEN):end]))
        pos = end + len(_CLOSE)
    return calls


def _hermes_call(body: str) -> ToolCall:
    try:
        call = json.loads(body)
    except json.JSONDecodeError as exc:
        return ToolCall("", {}, f"invalid JSON in {_OPEN}: {exc}")
    if not isinstance(call, dict):
        return ToolCall("", {}, f"a tool call must be a JSON object {_HERMES_SHAPE}, got {type(call).__name__}")
    name = call.get("name")
    if not isinstance(name, str) or not name:
        return ToolCall("", {}, f'a tool call needs a "name" (a non-empty string): {_HERMES_SHAPE}')
    extra = sorted(set(call) - {"name", "arguments"})
    if extra:
        return ToolCall(name, {}, f"unexpected keys {', '.join(extra)} in a tool call: {_HERMES_SHAPE}")
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as exc:
            return ToolCall(name, {}, f'invalid JSON in the "arguments" string: {exc}')
    if not isinstance(arguments, dict):
        return ToolCall(name, {}, f'"arguments" must be a JSON object, got {type(arguments).__name__}')
    return ToolCall(name, arguments)


PARSERS: dict[str, ToolParser] = {"hermes": parse_hermes}


def register_tool_parser(name: str, parser: ToolParser) -> None:
    """Register `parser` as `name` (registering the same object again is a no-op).

    Raises:
        ValueError: if `name` is taken by another parser or is not a non-empty string without ':'.
    """
    if not isinstance(name, str) or not name or is_code_ref(name):
        raise ValueError(f"tool parser name {name!r} must be a non-empty string without ':'")
    if PARSERS.get(name, parser) is not parser:
        raise ValueError(f"tool parser {name!r} is already registered (to {PARSERS[name]!r})")
    PARSERS[name] = parser


def tool_parser(name_or_ref: str) -> ToolParser:
    """The parser registered as `name_or_ref`, or referenced as `file.py:fn` / `module:fn`.

    Raises:
        UserCodeError: for an unknown name (listing the known ones) or a reference that fails.
    """
    if name_or_ref in PARSERS:
        return PARSERS[name_or_ref]
    if is_code_ref(name_or_ref):
        return load_function(name_or_ref)
    raise UserCodeError(f"unknown tool parser {name_or_ref!r}{_did_you_mean(name_or_ref, PARSERS)}; "
                        f"known: {', '.join(sorted(PARSERS))} (or a reference to your own: file.py:function)")


def _did_you_mean(name: str, known: Iterable[str]) -> str:
    close = difflib.get_close_matches(name, list(known), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


class Toolbox:
    """The tools a model may call, their schemas for the chat template, and a safe `call`.

    Each call runs in a fresh daemon thread and is given up after `timeout_s` (status "timeout").
    A thread cannot be killed: a timed-out call keeps running in the background until it returns.
    A tool that may hang or run untrusted code must run in a subprocess itself, as `python_exec` does.

    Args:
        refs: built-in tool names (`BUILTIN_TOOLS`) or `file.py:fn` / `module:fn` references to
            typed functions with a docstring that documents every argument.
        timeout_s: seconds a call may run before its result is "timeout".
        max_result_chars: cut a result's text to this many characters (a guard against a tool
            printing megabytes; the caller truncates by tokens); None keeps it whole.

    Raises:
        UserCodeError: for an unknown name, a function transformers cannot describe (no
            docstring, a missing type hint, ...) or two tools with one name.
    """

    def __init__(self, refs: Sequence[str], *, timeout_s: float = 10.0, max_result_chars: int | None = None):
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if max_result_chars is not None and max_result_chars < 1:
            raise ValueError(f"max_result_chars must be >= 1 or None, got {max_result_chars}")
        self.timeout_s = timeout_s
        self.max_result_chars = max_result_chars
        self.names: list[str] = []
        self.schemas: list[dict] = []
        self._functions: dict[str, Callable] = {}
        self._timeout_logged = False
        for ref in refs:
            fn, schema = _load_tool(ref)
            name = schema["function"]["name"]
            if name in self._functions:
                raise UserCodeError(f"two tools are named {name!r} (the second is {ref!r}); tool names must differ")
            self.names.append(name)
            self.schemas.append(schema)
            self._functions[name] = fn

    def call(self, call: ToolCall) -> ToolResult:
        """Run one call; every failure becomes a result the model reads (see the module docstring)."""
        if call.error is not None:
            return ToolResult(call.name, f"error: {call.error}", "error")
        fn = self._functions.get(call.name)
        if fn is None:
            return ToolResult(call.name, f"error: unknown tool {call.name!r}{_did_you_mean(call.name, self.names)}; "
                                         f"available tools: {', '.join(self.names)}", "error")
        signature = inspect.signature(fn)
        try:
            bound = signature.bind(**call.arguments)
        except TypeError as exc:
            return ToolResult(call.name, f"error: {call.name}{signature}: {exc}", "error")
        try:
            text = _as_text(_run_with_timeout(fn, bound, self.timeout_s))
        except FutureTimeout:
            if not self._timeout_logged:   # said once; every timeout is counted by `tool_counts`
                log.warning("tool %r did not finish within %g s; its thread keeps running in the background "
                            "(later timeouts are not logged)", call.name, self.timeout_s)
                self._timeout_logged = True
            return ToolResult(call.name, f"error: {call.name} did not finish within {self.timeout_s:g} s", "timeout")
        except (Exception, SystemExit) as exc:  # noqa: BLE001 - user code: any failure goes back to the model
            return ToolResult(call.name, f"error: {type(exc).__name__}: {exc}", "error")
        if self.max_result_chars is not None and len(text) > self.max_result_chars:
            text = text[:self.max_result_chars] + f"\n[... {len(text) - self.max_result_chars} more characters cut]"
        return ToolResult(call.name, text, "ok")


def _load_tool(ref: str) -> tuple[Callable, dict]:
    if ref in BUILTIN_TOOLS:
        fn = load_function(BUILTIN_TOOLS[ref])
    elif is_code_ref(ref):
        fn = load_function(ref)
    else:
        raise UserCodeError(f"unknown tool {ref!r}{_did_you_mean(ref, BUILTIN_TOOLS)}; built-in tools: "
                            f"{', '.join(sorted(BUILTIN_TOOLS))} (or a reference to your own: file.py:function)")
    try:
        return fn, get_json_schema(fn)
    except (DocstringParsingException, TypeHintParsingException) as exc:
        raise UserCodeError(f"tool {ref!r} cannot be described to the model: {exc}. A tool must have type "
                            "hints on every argument and a docstring with an Args section") from None


def _run_with_timeout(fn: Callable, bound: inspect.BoundArguments, timeout_s: float):
    """`fn(*bound.args, **bound.kwargs)` in a daemon thread (which never blocks interpreter exit,
    unlike a ThreadPoolExecutor's); raises `FutureTimeout` after `timeout_s`."""
    future: Future = Future()

    def run() -> None:
        try:
            future.set_result(fn(*bound.args, **bound.kwargs))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller, which reports it
            future.set_exception(exc)

    threading.Thread(target=run, name=f"tool-{fn.__name__}", daemon=True).start()
    return future.result(timeout=timeout_s)


def _as_text(result: object) -> str:
    if isinstance(result, str):
        return result
    if isinstance(result, (dict, list)):
        return json.dumps(result, ensure_ascii=False)
    return str(result)


def tool_counts(results: Iterable[ToolResult]) -> dict[str, int]:
    """How many results have each status: {"ok": n, "error": n, "timeout": n} (every key present)."""
    counts = Counter(result.status for result in results)
    return {status: counts[status] for status in STATUSES}
