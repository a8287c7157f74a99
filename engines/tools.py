"""Tools for agent episodes: named `module:function`, described by JSON schema, called by text.

    "calc:add" --import--> the function --transformers.utils.get_json_schema--> its schema
        (name, description and parameters from the signature's type hints and the docstring's
        Google-style Args: what chat templates with `tools=` expect)
    model text --parse_tool_calls--> calls + the reason of each malformed one
        --check_call--> a reason when the name or the arguments do not fit the schema
        --call_tool--> the result as a string (or the error as a string)
        --tool_message--> {"role": "tool", "name", "content"}: the environment's next message

The call format is the one Qwen2/2.5 and Hermes templates teach, which SmolLM2's function
calling data (Argilla's APIGen) uses too: JSON inside ``<tool_call>...</tool_call>``, either
one object ``{"name": ..., "arguments": {...}}`` (Qwen, Hermes) or a list of them (SmolLM2).
``arguments`` may also be a JSON string holding the object (OpenAI's wire form).

Chat templates differ in whether they show tools at all. Qwen2.5's renders the schemas into
its system turn itself. SmolLM2-135M-Instruct's (the template in its GGUF, as on the hub)
ignores `tools`: `template_renders_tools` finds that out by rendering with and without them,
and `tools_system_prompt` writes the schemas and the call format into a system message for
such templates (our words, in the shape of SmolLM2's documented function-calling prompt).

Nothing here raises on what the model wrote: a malformed call is a reason string, and a tool
that raises gives an error result. `call_tool` runs a tool in this process, unsandboxed; a
rollout runs them through `consumers.tool_runner` instead (a sandboxed process per episode,
a time limit per call, caps on what a call returns and prints).
"""

from __future__ import annotations

import importlib
import inspect
import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"
_CALL = re.compile(re.escape(CALL_OPEN) + r"(.*?)" + re.escape(CALL_CLOSE), re.DOTALL)


class ToolError(ValueError):
    """A tool named in the config cannot be loaded (one line naming the cause)."""


@dataclass(frozen=True)
class Tool:
    name: str
    function: Callable[..., Any]
    schema: dict[str, Any]
    """``{"type": "function", "function": {"name", "description", "parameters"}}``."""
    spec: str = ""
    """The ``module:function`` it was loaded from (what a tool process imports)."""


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class ParsedCalls:
    """What one model turn asked for."""

    calls: tuple[ToolCall, ...]
    errors: tuple[str, ...]
    """One reason per malformed call, in order of appearance."""
    text: str
    """The turn's text outside the calls, stripped."""


@dataclass(frozen=True)
class ToolResult:
    content: str
    error: str | None = None
    """Why the call failed (the content then says so too, for the model to read)."""


def load_tool(spec: str) -> Tool:
    """The function `spec` names (``package.module:function``) with its JSON schema."""
    function = import_tool(spec)
    from transformers.utils import get_json_schema

    try:
        schema = get_json_schema(function)
    except Exception as exc:  # noqa: BLE001 - its parsers raise several kinds; one line for all
        detail = " ".join(str(exc).split())
        raise ToolError(f"tool {spec!r}: no JSON schema from its signature: {detail}") from None
    return Tool(name=schema["function"]["name"], function=function, schema=schema, spec=spec)


def import_tool(spec: str) -> Callable[..., Any]:
    """The function `spec` names, imported (no schema: what a tool process needs, without
    importing transformers)."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ToolError(f"tool {spec!r}: name it as module:function")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ToolError(f"tool {spec!r}: cannot import {module_name!r}: {exc}") from None
    function = getattr(module, attr, None)
    if function is None:
        raise ToolError(f"tool {spec!r}: module {module_name!r} has no {attr!r}")
    if not inspect.isfunction(function):
        raise ToolError(f"tool {spec!r}: {attr!r} is a {type(function).__name__}, not a function")
    return function


def load_tools(specs: Sequence[str]) -> dict[str, Tool]:
    """The tools `specs` name, by tool name; two with one name are refused."""
    tools: dict[str, Tool] = {}
    for spec in specs:
        tool = load_tool(spec)
        if tool.name in tools:
            raise ToolError(f"tool {spec!r}: a tool named {tool.name!r} is loaded already")
        tools[tool.name] = tool
    return tools


def parse_tool_calls(text: str) -> ParsedCalls:
    """The ``<tool_call>`` blocks of a model turn's text, each parsed (see the module doc)."""
    calls: list[ToolCall] = []
    errors: list[str] = []
    for n, block in enumerate(_CALL.findall(text), 1):
        try:
            value = json.loads(block)
        except json.JSONDecodeError as exc:
            errors.append(f"tool call {n}: not JSON ({exc.msg} at char {exc.pos})")
            continue
        items = value if isinstance(value, list) else [value]
        for item in items:
            call = _call(item)
            if isinstance(call, str):
                errors.append(f"tool call {n}: {call}")
            else:
                calls.append(call)
    outside = _CALL.sub("", text)
    if CALL_OPEN in outside:
        errors.append(f"a {CALL_OPEN} without its {CALL_CLOSE}")
    elif CALL_CLOSE in outside:
        errors.append(f"a {CALL_CLOSE} without its {CALL_OPEN}")
    return ParsedCalls(tuple(calls), tuple(errors), outside.strip())


def _call(item: object) -> ToolCall | str:
    """One ``{"name", "arguments"}`` object as a call, or why it is none."""
    if not isinstance(item, dict):
        return f"a JSON {type(item).__name__}, not an object with a name and arguments"
    name = item.get("name")
    if not isinstance(name, str) or not name:
        return 'no "name" string'
    arguments = item.get("arguments", {})
    if isinstance(arguments, str):  # OpenAI's wire form: the object as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return f'{name}: "arguments" is a string that is no JSON object'
    if not isinstance(arguments, dict):
        return f'{name}: "arguments" is a JSON {type(arguments).__name__}, not an object'
    unknown = set(item) - {"name", "arguments"}
    if unknown:
        return f"{name}: unknown keys {sorted(unknown)}"
    return ToolCall(name, arguments)


def check_call(call: ToolCall, tools: dict[str, Tool]) -> str | None:
    """Why `call` cannot be made (an unknown tool, a missing or unknown argument); None: fine.
    Types are the tool's business: the schema's are hints, not validated here."""
    tool = tools.get(call.name)
    if tool is None:
        return f"no tool named {call.name!r} (tools: {', '.join(sorted(tools)) or 'none'})"
    parameters = tool.schema["function"].get("parameters", {})
    known = set(parameters.get("properties", {}))
    missing = [p for p in parameters.get("required", []) if p not in call.arguments]
    if missing:
        return f"{call.name}: missing arguments {missing}"
    unknown = sorted(set(call.arguments) - known)
    if unknown:
        return f"{call.name}: unknown arguments {unknown}"
    return None


def call_tool(tool: Tool, arguments: dict[str, Any]) -> ToolResult:
    """Call `tool` here (no sandbox, no time limit: `consumers.tool_runner` has those); its
    result as a string, or its exception as the error."""
    try:
        value = tool.function(**arguments)
    except Exception as exc:  # noqa: BLE001 - a tool's failure is its episode's, not ours
        error = f"{tool.name} raised {type(exc).__name__}: {exc}"
        return ToolResult(content=f"error: {error}", error=error)
    return ToolResult(content=result_text(value))


def result_text(value: object) -> str:
    """A tool's return value as the text the model reads: a string as it is, else JSON, else
    its str()."""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return str(value)


def tool_message(call: ToolCall, result: ToolResult) -> dict[str, Any]:
    """The environment message carrying `result` back to the model."""
    return {"role": "tool", "name": call.name, "content": result.content}


def template_renders_tools(tokenizer: Any, schemas: Sequence[dict[str, Any]]) -> bool:
    """Does the tokenizer's chat template show `schemas` when given them as ``tools``?"""
    messages = [{"role": "user", "content": "x"}]
    plain = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    with_tools = tokenizer.apply_chat_template(
        messages, tools=list(schemas), tokenize=False, add_generation_prompt=True
    )
    return bool(plain != with_tools)


def tools_system_prompt(schemas: Sequence[dict[str, Any]]) -> str:
    """A system message's content listing `schemas` and the call format, for a template that
    does not render tools itself (SmolLM2's)."""
    listed = "\n".join(json.dumps(schema) for schema in schemas)
    return (
        "You can call these tools:\n"
        f"<tools>\n{listed}\n</tools>\n"
        "To call tools, answer with a JSON list of calls between tool_call tags, and nothing "
        "else:\n"
        f'{CALL_OPEN}[{{"name": "tool_name", "arguments": {{"argument": "value"}}}}]{CALL_CLOSE}\n'
        "Each result comes back in a message from the tool. Without a call, your answer is final."
    )


def prompt_with_tools(
    tokenizer: Any, messages: Sequence[dict[str, Any]], schemas: Sequence[dict[str, Any]]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The episode's first messages and the ``tools`` to render them with: `schemas` as the
    template's own ``tools`` when it renders them; else `tools_system_prompt` in the system
    message (added before its content, or as a new first message) and no ``tools``."""
    out = [dict(m) for m in messages]
    if not schemas or template_renders_tools(tokenizer, schemas):
        return out, list(schemas) or None
    prompt = tools_system_prompt(schemas)
    if out and out[0].get("role") == "system":
        out[0]["content"] = f"{out[0]['content']}\n\n{prompt}"
    else:
        out.insert(0, {"role": "system", "content": prompt})
    return out, None
