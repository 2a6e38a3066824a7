"""Tool-call parsers: the model's assistant text -> the tool calls it asks for (verl's `ToolParser`).

A parser turns one assistant turn's text into `ParsedTurn`: the text outside the calls (`content`), the
well-formed calls (`ToolCall`: name + arguments dict) and the malformed ones (`ToolCallError`: the raw text
and why it failed). The agent loop answers every malformed call with an error observation and counts it
(`tool/errors`), as it does for a call to an unknown tool or with arguments that do not fit the tool's
schema (`validate_call`).

Formats are registered by name (`register_tool_parser`; `multi_turn.format` selects one, verl's
`actor_rollout_ref.rollout.multi_turn.format`). `hermes` is the first: calls are JSON objects
`{"name": ..., "arguments": {...}}` between `<tool_call>` and `</tool_call>`, several per turn allowed (Nous
Research Hermes 2 Pro function calling; Qwen2.5 / Qwen3 chat templates use it; verl's `HermesToolParser`
uses the same regex).
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable, Mapping
from typing import Any

__all__ = [
    "HermesToolParser",
    "ParsedTurn",
    "ToolCall",
    "ToolCallError",
    "get_tool_parser",
    "register_tool_parser",
    "validate_call",
]


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """One well-formed call: the tool's `name` and its `arguments` (a JSON object as a dict)."""

    name: str
    arguments: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class ToolCallError:
    """One call the parser could not read: `raw` (the text between the tags) and `error` (why)."""

    raw: str
    error: str


@dataclasses.dataclass(frozen=True)
class ParsedTurn:
    """An assistant turn: `content` (text outside the calls, stripped), `calls` (well-formed, in order) and
    `errors` (malformed, in order). `num_calls` counts both."""

    content: str
    calls: tuple[ToolCall, ...] = ()
    errors: tuple[ToolCallError, ...] = ()

    @property
    def num_calls(self) -> int:
        return len(self.calls) + len(self.errors)


class HermesToolParser:
    """`<tool_call>{"name": str, "arguments": {...}}</tool_call>`, any number per turn.

    An unclosed `<tool_call>` at the end of a turn (the model stopped mid-call) is a malformed call. A call
    whose JSON does not parse, is not an object, lacks a string `name`, or has `arguments` that are not an
    object (a JSON string holding an object is accepted, as OpenAI's API sends them) is malformed.
    Source: verl `experimental/agent_loop/tool_parser.py::HermesToolParser` (regex and tags).
    """

    name = "hermes"
    start, end = "<tool_call>", "</tool_call>"
    _regex = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)

    def system_prompt(self, tools: list[dict]) -> str:
        """Tool instructions for a template that ignores `tools=` (SmolLM2's): Qwen2.5's Hermes tool prompt,
        one JSON spec per line inside `<tools></tools>`."""
        specs = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        return (
            "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
            f"{specs}\n</tools>\n\nFor each function call, return a json object with function name and arguments "
            "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
        )

    def parse(self, text: str) -> ParsedTurn:
        calls: list[ToolCall] = []
        errors: list[ToolCallError] = []
        for m in self._regex.finditer(text):
            raw = m.group(1).strip()
            call = _read_call(raw)
            (errors if isinstance(call, ToolCallError) else calls).append(call)
        content = self._regex.sub("", text)
        if self.start in content:  # opened, never closed
            head, _, tail = content.partition(self.start)
            errors.append(ToolCallError(tail.strip(), f"unclosed {self.start} (no {self.end})"))
            content = head
        return ParsedTurn(content.strip(), tuple(calls), tuple(errors))


def _read_call(raw: str) -> ToolCall | ToolCallError:
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as e:
        return ToolCallError(raw, f"tool call is not valid JSON: {e}")
    if not isinstance(obj, dict):
        return ToolCallError(raw, f"tool call must be a JSON object, got {type(obj).__name__}")
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return ToolCallError(raw, "tool call has no string 'name'")
    args = obj.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError as e:
            return ToolCallError(raw, f"tool call 'arguments' string is not valid JSON: {e}")
    if not isinstance(args, dict):
        return ToolCallError(raw, f"tool call 'arguments' must be a JSON object, got {type(args).__name__}")
    return ToolCall(name, args)


_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "array": (list,),
    "object": (dict,),
    "null": (type(None),),
}


def _type_ok(value: Any, spec: Mapping[str, Any]) -> bool:
    t = spec.get("type")
    if t is None:
        return True
    types = t if isinstance(t, list) else [t]
    for name in types:
        allowed = _JSON_TYPES.get(name)
        if allowed is None:
            return True  # a type this check does not know: accept
        if isinstance(value, bool) and name in ("integer", "number"):
            continue
        if isinstance(value, allowed):
            return True
    return False


def validate_call(call: ToolCall, schemas: Mapping[str, Mapping[str, Any]]) -> str | None:
    """None when `call` names a tool of `schemas` (name -> OpenAI function spec `{"name", "parameters"}`) and
    its arguments fit the spec's `parameters` (required keys present, no unknown keys, top-level JSON types
    right, `enum` respected); else the reason, as text for the error observation."""
    spec = schemas.get(call.name)
    if spec is None:
        return f"unknown tool {call.name!r}; available: {sorted(schemas)}"
    params = spec.get("parameters") or {}
    props = params.get("properties") or {}
    missing = [k for k in params.get("required", ()) if k not in call.arguments]
    if missing:
        return f"tool {call.name!r}: missing required argument(s) {missing}"
    unknown = [k for k in call.arguments if k not in props]
    if unknown and params.get("additionalProperties", False) is not True:
        return f"tool {call.name!r}: unknown argument(s) {unknown}; expected {sorted(props)}"
    for k, v in call.arguments.items():
        p = props.get(k) or {}
        if not _type_ok(v, p):
            return f"tool {call.name!r}: argument {k!r} must be of type {p.get('type')}, got {type(v).__name__}"
        if "enum" in p and v not in p["enum"]:
            return f"tool {call.name!r}: argument {k!r} must be one of {p['enum']}, got {v!r}"
    return None


_PARSERS: dict[str, Callable[[], Any]] = {"hermes": HermesToolParser}


def register_tool_parser(name: str, factory: Callable[[], Any]) -> None:
    """Register a tool-call format: `factory()` returns an object with `parse(text) -> ParsedTurn`.

    Raises ValueError if `name` is taken."""
    if name in _PARSERS:
        raise ValueError(f"tool parser {name!r} is already registered")
    _PARSERS[name] = factory


def get_tool_parser(name: str):
    """The parser registered as `name` (`multi_turn.format`). Raises ValueError for an unknown name."""
    if name not in _PARSERS:
        raise ValueError(f"unknown tool-call format {name!r} (rollout.multi_turn.format); known: {sorted(_PARSERS)}")
    return _PARSERS[name]()
