"""Tool calls for agent RL: Hermes parsing, parser lookup, and a Toolbox that never crashes."""

from __future__ import annotations

import textwrap
import time

import pytest

from raygraph.agents import tools
from raygraph.agents.tools import Toolbox, ToolCall, ToolResult, parse_hermes, tool_counts, tool_parser
from raygraph.algos.user_code import UserCodeError

# ------------------------------------------------------------------------------------ hermes parser


def test_hermes_parses_one_call_and_ignores_the_text_around_it():
    text = 'Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\nDone.'
    assert parse_hermes(text) == [ToolCall("add", {"a": 1, "b": 2})]


def test_hermes_parses_two_calls_in_order():
    text = ('<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call> and '
            '<tool_call>{"name": "sleep", "arguments": {}}</tool_call>')
    assert parse_hermes(text) == [ToolCall("add", {"a": 1}), ToolCall("sleep", {})]


def test_hermes_decodes_arguments_given_as_a_json_string():
    text = '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}</tool_call>'
    assert parse_hermes(text) == [ToolCall("add", {"a": 1, "b": 2})]


def test_hermes_bad_json_is_a_malformed_call_with_the_json_error():
    [call] = parse_hermes('<tool_call>{"name": "add", "arguments": {"a": 1,}}</tool_call>')
    assert (call.name, call.arguments) == ("", {})
    assert call.error.startswith("invalid JSON in <tool_call>: ")
    assert "line 1 column" in call.error


def test_hermes_call_without_a_name_is_malformed():
    [call] = parse_hermes('<tool_call>{"arguments": {"a": 1}}</tool_call>')
    assert call.name == "" and '"name"' in call.error


@pytest.mark.parametrize("body, expected", [
    ('[1, 2]', "must be a JSON object"),
    ('{"name": "add", "arguments": [1, 2]}', '"arguments" must be a JSON object, got list'),
    ('{"name": "add", "arguments": "{oops"}', 'invalid JSON in the "arguments" string'),
    ('{"name": "add", "parameters": {"a": 1}}', "unexpected keys parameters"),
])
def test_hermes_other_malformed_calls_say_what_is_wrong(body, expected):
    [call] = parse_hermes(f"<tool_call>{body}</tool_call>")
    assert expected in call.error


def test_hermes_unclosed_tag_at_the_end_is_a_malformed_call_after_the_complete_ones():
    text = '<tool_call>{"name": "add", "arguments": {}}</tool_call><tool_call>{"name": "add", "argu'
    first, cut = parse_hermes(text)
    assert first == ToolCall("add", {})
    assert cut.name == "" and "never closed" in cut.error


def test_hermes_text_without_a_call_gives_no_calls():
    assert parse_hermes("The answer is 3.") == []


# ------------------------------------------------------------------------------------ parser lookup


def _cut_parser(text: str) -> list[ToolCall]:
    return [ToolCall(name, {}) for name in text.split()]


def test_a_registered_parser_is_found_by_name_and_the_same_object_may_register_twice(monkeypatch):
    monkeypatch.setattr(tools, "PARSERS", dict(tools.PARSERS))   # the global table stays untouched
    tools.register_tool_parser("words", _cut_parser)
    tools.register_tool_parser("words", _cut_parser)
    assert tool_parser("words")("a b") == [ToolCall("a", {}), ToolCall("b", {})]
    with pytest.raises(ValueError, match="'words' is already registered"):
        tools.register_tool_parser("words", parse_hermes)


def test_a_parser_is_found_by_file_reference(tmp_path):
    path = tmp_path / "my_parser.py"
    path.write_text(textwrap.dedent("""
        from raygraph.agents.tools import ToolCall

        def every_line(text):
            return [ToolCall(line, {}) for line in text.splitlines()]
    """))
    assert tool_parser(f"{path}:every_line")("x\ny") == [ToolCall("x", {}), ToolCall("y", {})]


def test_an_unknown_parser_name_lists_the_known_ones_and_suggests_the_closest():
    with pytest.raises(UserCodeError, match=r"unknown tool parser 'hermse' \(did you mean 'hermes'\?\); known: .*hermes"):
        tool_parser("hermse")


# ------------------------------------------------------------------------------------------ toolbox

TOOLS_FILE = '''
import time


def add(a: int, b: float = 0.5) -> float:
    """Add two numbers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a + b


def divide(a: float, b: float) -> dict:
    """Divide a by b.

    Args:
        a: The dividend.
        b: The divisor.
    """
    if b == 0:
        raise ValueError("b must not be 0")
    return {"quotient": a / b}


def nap(seconds: float) -> str:
    """Sleep, then say so.

    Args:
        seconds: How long to sleep.
    """
    time.sleep(seconds)
    return "awake"


def undocumented(a: int) -> int:
    return a
'''


@pytest.fixture
def tools_file(tmp_path):
    path = tmp_path / "my_tools.py"
    path.write_text(TOOLS_FILE)
    return path


def test_toolbox_schemas_are_the_openai_function_schemas_of_the_typed_functions(tools_file):
    toolbox = Toolbox([f"{tools_file}:add", f"{tools_file}:divide"])
    assert toolbox.names == ["add", "divide"]
    # By hand from the signatures and docstrings: int -> "integer", float -> "number"; only the
    # arguments without a default are required; the description is the docstring's first part.
    assert toolbox.schemas == [
        {"type": "function", "function": {
            "name": "add", "description": "Add two numbers.",
            "parameters": {"type": "object", "properties": {
                "a": {"type": "integer", "description": "The first number."},
                "b": {"type": "number", "description": "The second number."}},
                "required": ["a"]},
            "return": {"type": "number"}}},
        {"type": "function", "function": {
            "name": "divide", "description": "Divide a by b.",
            "parameters": {"type": "object", "properties": {
                "a": {"type": "number", "description": "The dividend."},
                "b": {"type": "number", "description": "The divisor."}},
                "required": ["a", "b"]},
            "return": {"type": "object"}}},
    ]


def test_toolbox_calls_return_text_the_model_reads(tools_file):
    toolbox = Toolbox([f"{tools_file}:add", f"{tools_file}:divide"])
    assert toolbox.call(ToolCall("add", {"a": 1, "b": 2})) == ToolResult("add", "3", "ok")
    assert toolbox.call(ToolCall("divide", {"a": 1, "b": 4})) == ToolResult("divide", '{"quotient": 0.25}', "ok")


def test_toolbox_failures_become_error_results(tools_file):
    toolbox = Toolbox([f"{tools_file}:add", f"{tools_file}:divide"])
    malformed = toolbox.call(ToolCall("", {}, error="invalid JSON in <tool_call>: ..."))
    unknown = toolbox.call(ToolCall("ad", {"a": 1}))
    missing = toolbox.call(ToolCall("add", {"b": 2}))
    extra = toolbox.call(ToolCall("add", {"a": 1, "c": 2}))
    raising = toolbox.call(ToolCall("divide", {"a": 1, "b": 0}))
    assert malformed == ToolResult("", "error: invalid JSON in <tool_call>: ...", "error")
    assert unknown == ToolResult("ad", "error: unknown tool 'ad' (did you mean 'add'?); available tools: add, divide",
                                 "error")
    assert missing == ToolResult("add", "error: add(a: int, b: float = 0.5) -> float: missing a required "
                                        "argument: 'a'", "error")
    assert extra.status == "error" and "unexpected keyword argument 'c'" in extra.text
    assert raising == ToolResult("divide", "error: ValueError: b must not be 0", "error")
    assert tool_counts([malformed, unknown, missing, extra, raising]) == {"ok": 0, "error": 5, "timeout": 0}


def test_a_call_running_past_its_timeout_returns_timeout_without_waiting_for_it(tools_file):
    toolbox = Toolbox([f"{tools_file}:nap"], timeout_s=0.3)
    start = time.monotonic()
    result = toolbox.call(ToolCall("nap", {"seconds": 2}))
    assert time.monotonic() - start < 1.0
    assert result == ToolResult("nap", "error: nap did not finish within 0.3 s", "timeout")
    assert tool_counts([result, toolbox.call(ToolCall("nap", {"seconds": 0}))]) == {"ok": 1, "error": 0, "timeout": 1}


def test_max_result_chars_cuts_long_results_and_says_how_much(tools_file):
    toolbox = Toolbox([f"{tools_file}:divide"], max_result_chars=5)
    assert toolbox.call(ToolCall("divide", {"a": 1, "b": 4})).text == '{"quo\n[... 13 more characters cut]'


def test_a_function_without_a_docstring_is_refused_naming_it_and_the_fix(tools_file):
    with pytest.raises(UserCodeError, match=r"undocumented' cannot be described to the model: .*no docstring.*"
                                            r"docstring with an Args section"):
        Toolbox([f"{tools_file}:undocumented"])


def test_two_tools_with_one_name_are_refused(tools_file):
    with pytest.raises(UserCodeError, match="two tools are named 'add'"):
        Toolbox([f"{tools_file}:add", f"{tools_file}:add"])


def test_an_unknown_builtin_tool_suggests_the_closest_without_importing_it():
    with pytest.raises(UserCodeError, match=r"unknown tool 'python_exe' \(did you mean 'python_exec'\?\)"):
        Toolbox(["python_exe"])
