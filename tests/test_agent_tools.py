"""`engines.tools`: tools by `module:function`, their schemas, and calls parsed from text.

- A function's schema is what transformers' `get_json_schema` makes of its signature and
  docstring; names that load nothing, or nothing with a schema, are one-line `ToolError`s.
- ``<tool_call>`` blocks parse as one object (Qwen2/Hermes) or a list (SmolLM2); every
  malformed call is a reason string, never an exception.
- Qwen2-style ChatML renders ``tools`` itself; SmolLM2's ignores them, so the tools go into a
  system message.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import pytest

from engines.tools import (
    ParsedCalls,
    ToolCall,
    ToolError,
    call_tool,
    check_call,
    load_tool,
    load_tools,
    parse_tool_calls,
    prompt_with_tools,
    template_renders_tools,
    tool_message,
)
from tests.chat_templates import CHATML_TOOLS, chat_tokenizer, smollm2_template

T = TypeVar("T")


def no_exception(function: Callable[..., T], *args: Any) -> T:
    """`function(*args)`; an exception it raises fails the test by assertion (the claim is
    that it raises none)."""
    try:
        return function(*args)
    except Exception as exc:  # noqa: BLE001
        raise AssertionError(f"{function.__name__} raised {exc!r}") from None


def test_a_tool_is_a_function_with_the_schema_of_its_signature_and_docstring() -> None:
    tool = load_tool("tests.agent_tools:lookup")
    assert tool.name == "lookup"
    assert tool.function(key="k") == {"key": "k", "value": "none"}
    assert tool.schema == {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Look a key up.",
            "parameters": {
                "type": "object",
                "properties": {
                    "key": {"type": "string", "description": "What to look up."},
                    "default": {
                        "type": "string",
                        "description": "What to answer when the key is unknown.",
                    },
                },
                "required": ["key"],
            },
            "return": {"type": "object", "additionalProperties": {"type": "string"}},
        },
    }


@pytest.mark.parametrize(
    ("spec", "cause"),
    [
        ("tests.agent_tools.add", "name it as module:function"),
        ("tests.no_such_module:add", "cannot import 'tests.no_such_module'"),
        ("tests.agent_tools:missing", "has no 'missing'"),
        ("tests.agent_tools:NOT_A_FUNCTION", "is a int, not a function"),
        ("tests.agent_tools:undocumented", "no JSON schema from its signature"),
    ],
)
def test_a_name_that_gives_no_tool_is_a_one_line_error(spec: str, cause: str) -> None:
    with pytest.raises(ToolError) as error:
        load_tool(spec)
    message = str(error.value)
    assert cause in message and spec in message and "\n" not in message, message


def test_two_tools_of_one_name_are_refused() -> None:
    assert sorted(load_tools(["tests.agent_tools:add", "tests.agent_tools:divide"])) == [
        "add",
        "divide",
    ]
    with pytest.raises(ToolError, match="named 'add' is loaded already"):
        load_tools(["tests.agent_tools:add", "tests.agent_tools:add"])


def test_calls_parse_in_the_qwen_and_smollm2_forms() -> None:
    qwen = (
        "I will add them.\n<tool_call>\n"
        '{"name": "add", "arguments": {"a": 17, "b": 25}}\n</tool_call>'
    )
    parsed = parse_tool_calls(qwen)
    assert parsed.calls == (ToolCall("add", {"a": 17, "b": 25}),)
    assert parsed.errors == () and parsed.text == "I will add them."
    smollm2 = (
        '<tool_call>[{"name": "add", "arguments": {"a": 1, "b": 2}}, '
        '{"name": "lookup", "arguments": "{\\"key\\": \\"x\\"}"}]</tool_call>'
    )
    parsed = parse_tool_calls(smollm2)
    assert parsed.calls == (ToolCall("add", {"a": 1, "b": 2}), ToolCall("lookup", {"key": "x"}))
    assert parsed.errors == () and parsed.text == ""
    two = parse_tool_calls(f'{qwen} and <tool_call>{{"name": "divide"}}</tool_call>')
    assert [c.name for c in two.calls] == ["add", "divide"] and two.calls[1].arguments == {}
    assert parse_tool_calls("The answer is 42.") == ParsedCalls((), (), "The answer is 42.")


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("<tool_call>{name: add}</tool_call>", "tool call 1: not JSON (Expecting property name"),
        ('<tool_call>{"arguments": {}}</tool_call>', 'tool call 1: no "name" string'),
        ('<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>', "is a JSON list"),
        ('<tool_call>{"name": "add", "arguments": "a=1"}</tool_call>', "no JSON object"),
        ('<tool_call>{"name": "add", "args": {}}</tool_call>', "unknown keys ['args']"),
        ("<tool_call>[1]</tool_call>", "a JSON int, not an object"),
        ('<tool_call>{"name": "add", "arguments": {"a": 1}', "a <tool_call> without its"),
        ('{"name": "add"}</tool_call>', "a </tool_call> without its <tool_call>"),
    ],
)
def test_a_malformed_call_is_a_reason_not_an_exception(text: str, reason: str) -> None:
    parsed = no_exception(parse_tool_calls, text)
    assert parsed.calls == ()
    assert len(parsed.errors) == 1 and reason in parsed.errors[0], parsed.errors


def test_a_good_call_beside_a_malformed_one_is_kept() -> None:
    parsed = no_exception(
        parse_tool_calls,
        '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
        "<tool_call>oops</tool_call>",
    )
    assert parsed.calls == (ToolCall("add", {"a": 1, "b": 2}),)
    assert parsed.errors == ("tool call 2: not JSON (Expecting value at char 0)",)


def test_calls_are_checked_against_the_schemas_and_called() -> None:
    tools = load_tools(["tests.agent_tools:add", "tests.agent_tools:divide"])
    assert check_call(ToolCall("add", {"a": 1, "b": 2}), tools) is None
    assert check_call(ToolCall("mul", {}), tools) == "no tool named 'mul' (tools: add, divide)"
    assert check_call(ToolCall("add", {"a": 1}), tools) == "add: missing arguments ['b']"
    assert check_call(ToolCall("add", {"a": 1, "b": 2, "c": 3}), tools) == (
        "add: unknown arguments ['c']"
    )
    result = call_tool(tools["add"], {"a": 17, "b": 25})
    assert (result.content, result.error) == ("42", None)
    assert tool_message(ToolCall("add", {}), result) == {
        "role": "tool",
        "name": "add",
        "content": "42",
    }
    failed = no_exception(call_tool, tools["divide"], {"a": 1, "b": 0})
    assert failed.error == "divide raised ZeroDivisionError: division by zero"
    assert failed.content == f"error: {failed.error}"
    lookup = call_tool(load_tool("tests.agent_tools:lookup"), {"key": "k"})
    assert lookup.content == '{"key": "k", "value": "none"}'


def test_tools_go_to_the_template_or_to_a_system_message() -> None:
    schema = load_tool("tests.agent_tools:add").schema
    question = [{"role": "user", "content": "What is 17 plus 25?"}]
    qwen = chat_tokenizer(CHATML_TOOLS)
    assert template_renders_tools(qwen, [schema])
    assert prompt_with_tools(qwen, question, [schema]) == (question, [schema])
    smollm2 = chat_tokenizer(smollm2_template())
    assert not template_renders_tools(smollm2, [schema])
    messages, tools = prompt_with_tools(smollm2, question, [schema])
    assert tools is None and messages[1:] == question
    assert messages[0]["role"] == "system" and '"name": "add"' in messages[0]["content"]
    assert "<tool_call>[" in messages[0]["content"]
    system = [{"role": "system", "content": "Be brief."}, *question]
    messages, _ = prompt_with_tools(smollm2, system, [schema])
    assert len(messages) == 2 and messages[0]["content"].startswith("Be brief.\n\n")
    assert prompt_with_tools(smollm2, question, []) == (question, None)
