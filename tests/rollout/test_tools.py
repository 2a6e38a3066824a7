"""Tools: schemas, the calculator, the Python sandbox, and every failure mode of a tool in the worker pool."""

import os
import time

import pytest

from jaxrl_post.rollout.sandbox import python, run_python_sandboxed
from jaxrl_post.rollout.tools import (
    Tool,
    ToolError,
    ToolErrorBudget,
    ToolExecutor,
    calculator,
    cap_text,
    evaluate_arithmetic,
    resolve_tools,
)

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(__file__)), "tool_fixtures.py")


def test_schema_from_type_hints_and_docstring():
    (t,) = resolve_tools("calculator")
    assert t.schema == {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression and return the result.",
            "parameters": {
                "type": "object",
                "properties": {
                    "expression": {
                        "type": "string",
                        "description": "an arithmetic expression with numbers, + - * / // % ** and parentheses, "
                        'e.g. "12*(3+4)"',
                    }
                },
                "required": ["expression"],
            },
        },
    }
    spec = {"name": "f", "parameters": {"type": "object", "properties": {}}}
    assert Tool.from_function(len, spec).schema == {"type": "function", "function": spec}
    with pytest.raises(ValueError, match="unknown tool 'nope'"):
        resolve_tools("nope")
    with pytest.raises(ValueError, match="unique"):
        resolve_tools("calculator,calculator")
    with pytest.raises(AttributeError, match="no 'missing'"):
        resolve_tools(f"{FIXTURES}:missing")


@pytest.mark.parametrize(
    "expr, want",
    [("12*(3+4)", 84), ("7/2", 3.5), ("2**10 - 1", 1023), ("-3 + +4", 1), ("17 // 5 + 17 % 5", 5), ("1e3", 1000)],
)
def test_calculator_values(expr, want):
    assert evaluate_arithmetic(expr) == want
    assert calculator(expr) == str(want)


@pytest.mark.parametrize(
    "expr, why",
    [
        ("__import__('os').system('true')", "unsupported expression element Call"),
        ("x + 1", "unsupported expression element Name"),
        ("(1).real", "unsupported expression element Attribute"),
        ("2 ** 100000", "exponent 100000 too large"),
        ("1 +", "cannot parse"),
        ("1/0", "division by zero"),
        ("'a' * 3", "unsupported expression element Constant"),
    ],
)
def test_calculator_refuses(expr, why):
    assert calculator(expr).startswith("Error: ") and why in calculator(expr)


def test_cap_text_sides():
    assert cap_text("abcdef", 10) == "abcdef"
    assert cap_text("abcdef", 4, "left") == "abcd...(truncated)"
    assert cap_text("abcdef", 4, "right") == "(truncated)...cdef"
    assert cap_text("abcdef", 3, "middle") == "a...(truncated)...ef"


def test_python_sandbox_env_cwd_limits(monkeypatch):
    monkeypatch.setenv("SECRET", "hunter2")
    out, rc, timed_out = run_python_sandboxed(
        "import os, sys; print(repr(os.environ.get('SECRET'))); print(os.getcwd()); print(sorted(os.listdir('.')))"
    )
    assert (rc, timed_out) == (0, False)
    secret, cwd, listing = out.splitlines()
    assert secret == "None" and "hunter2" not in out
    assert cwd == "/tool" and listing == "[]"  # the sandbox's own fresh directory (the output goes elsewhere)
    out, rc, _ = run_python_sandboxed("x = bytearray(4 << 30); print('allocated')", memory_mb=256)
    assert rc != 0 and "allocated" not in out  # MemoryError (or killed): the cap held
    t0 = time.monotonic()
    out, rc, timed_out = run_python_sandboxed("while True: pass", timeout_s=1.0)
    # stopped by the wall-clock timeout or by the CPU-time limit, whichever comes first on a loaded machine
    assert (timed_out and rc is None) or (not timed_out and rc != 0)
    assert time.monotonic() - t0 < 10
    out, rc, _ = run_python_sandboxed("while True: print('x' * 1000)", timeout_s=5.0, max_output_bytes=5000)
    assert len(out) <= 5000 and rc != 0
    assert python("print(6 * 7)") == "42\n"
    assert "[exit code 1]" in python("raise SystemExit(1)")


def test_python_sandbox_network():
    out, _, _ = run_python_sandboxed(
        "import socket\ns = socket.socket(); s.settimeout(2)\ntry:\n    s.connect(('10.255.255.1', 80))\n"
        "except OSError as e:\n    print(type(e).__name__, e.errno)"
    )
    assert "101" in out  # ENETUNREACH: no interface but loopback in the new network namespace


def _tool(name):
    return resolve_tools(f"{FIXTURES}:{name}")[0]


def test_executor_failure_modes(monkeypatch):
    monkeypatch.setenv("SECRET_TOKEN", "abc")
    tools = [_tool(n) for n in ("echo", "raiser", "hang", "crash", "flood", "memory_bomb", "not_text", "no_return")]
    tools.append(resolve_tools("calculator")[0])
    with ToolExecutor(tools, num_workers=2, timeout_s=3.0, memory_mb=1024, max_output_chars=100) as ex:
        t0 = time.monotonic()
        res = ex.run(
            [
                ("echo", {"text": "hi"}),
                ("raiser", {"text": "q"}),
                ("hang", {"text": "q"}),
                ("crash", {"text": "q"}),
                ("flood", {"text": "q"}),
                ("memory_bomb", {"text": "q"}),
                ("not_text", {"text": "q"}),
                ("calculator", {"expression": "6*7"}),
                ("echo", {"text": "still alive"}),
                ("no_return", {"text": "q"}),
            ]
        )
        elapsed = time.monotonic() - t0
        assert [r.status for r in res] == [
            "ok",
            "error",
            "timeout",
            "error",
            "ok",
            "error",
            "error",
            "ok",
            "ok",
            "error",
        ]
        assert res[0].text == "hi" and res[8].text == "still alive" and res[7].text == "42"
        assert "RuntimeError: tool failed on q" in res[1].text
        assert "tool call exceeded 3 s" in res[2].text
        assert "tool worker died (exit code 3)" in res[3].text
        assert res[4].text == "y" * 100 + "...(truncated)"  # capped in the worker; prints went nowhere
        assert "MemoryError" in res[5].text
        assert "returned object, not text or JSON" in res[6].text
        assert res[9].text == "Error: TypeError: tool 'no_return' returned None, not text"  # docs/agents.md, not "null"
        assert elapsed < 60
        with pytest.raises(ValueError, match="unknown tools"):
            ex.run([("nope", {})])


def test_error_budget():
    b = ToolErrorBudget(0.5)
    for s in ("ok", "error", "timeout"):
        b.add(s, f"{s} message")
    assert (b.calls, b.errors, b.timeouts) == (3, 2, 1)
    with pytest.raises(ToolError, match="2 of 3 tool calls failed .*1 timeouts.*First failure: error message"):
        b.check()
    ok = ToolErrorBudget(0.5)
    ok.add("ok")
    ok.add("error", "e")
    ok.check()  # 1 of 2 is not more than half
