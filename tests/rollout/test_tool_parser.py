"""Hermes tool-call parsing (good, several per turn, broken JSON, unknown name, bad arguments) and the registry."""

import pytest

from jaxrl_post.rollout.tool_parser import (
    HermesToolParser,
    ToolCall,
    get_tool_parser,
    register_tool_parser,
    validate_call,
)

CALC = {
    "name": "calculator",
    "description": "d",
    "parameters": {
        "type": "object",
        "properties": {"expression": {"type": "string"}, "digits": {"type": "integer"}},
        "required": ["expression"],
    },
}


def test_parses_several_calls_and_keeps_content():
    text = (
        'Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "2*3"}}\n</tool_call>\n'
        '<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"4+5\\"}"}</tool_call> done'
    )
    turn = HermesToolParser().parse(text)
    assert turn.calls == (ToolCall("calculator", {"expression": "2*3"}), ToolCall("calculator", {"expression": "4+5"}))
    assert turn.errors == ()
    assert turn.content == "Let me compute.\n\n done"
    assert turn.num_calls == 2


def test_no_calls():
    turn = HermesToolParser().parse("The answer is 42.")
    assert (turn.calls, turn.errors, turn.content) == ((), (), "The answer is 42.")


@pytest.mark.parametrize(
    "body, why",
    [
        ('{"name": "calculator", "arguments": {"expression": "2*3"}', "not valid JSON"),
        ('["calculator"]', "must be a JSON object"),
        ('{"arguments": {}}', "no string 'name'"),
        ('{"name": "calculator", "arguments": [1, 2]}', "'arguments' must be a JSON object"),
        ('{"name": "calculator", "arguments": "{oops"}', "'arguments' string is not valid JSON"),
    ],
)
def test_broken_calls_are_errors(body, why):
    turn = HermesToolParser().parse(f"x <tool_call>{body}</tool_call> <tool_call>" + '{"name": "a"}</tool_call>')
    assert len(turn.errors) == 1 and why in turn.errors[0].error
    assert turn.errors[0].raw == body
    assert turn.calls == (ToolCall("a", {}),)


def test_unclosed_call_is_an_error():
    turn = HermesToolParser().parse('ok <tool_call>{"name": "calculator", "argu')
    assert turn.calls == () and len(turn.errors) == 1 and "unclosed" in turn.errors[0].error
    assert turn.content == "ok"


def test_validate_call():
    schemas = {"calculator": CALC}
    assert validate_call(ToolCall("calculator", {"expression": "1"}), schemas) is None
    assert "unknown tool 'calc'" in validate_call(ToolCall("calc", {"expression": "1"}), schemas)
    assert "missing required" in validate_call(ToolCall("calculator", {}), schemas)
    assert "unknown argument" in validate_call(ToolCall("calculator", {"expression": "1", "x": 2}), schemas)
    assert "must be of type string" in validate_call(ToolCall("calculator", {"expression": 3}), schemas)
    # bool is not an integer in JSON schema
    assert "integer" in validate_call(ToolCall("calculator", {"expression": "1", "digits": True}), schemas)
    assert validate_call(ToolCall("calculator", {"expression": "1", "digits": 3}), schemas) is None


def test_registry():
    assert isinstance(get_tool_parser("hermes"), HermesToolParser)
    with pytest.raises(ValueError, match="unknown tool-call format 'nope'"):
        get_tool_parser("nope")
    with pytest.raises(ValueError, match="already registered"):
        register_tool_parser("hermes", HermesToolParser)
