"""Tools for multi-turn rollouts: Python functions with a JSON schema, run in worker processes.

A `Tool` is a module-level function plus its OpenAI function spec (`{"type": "function", "function": {"name",
"description", "parameters"}}`), by default derived from the type hints and the Google-style docstring by
`transformers.utils.get_json_schema`; the agent loop passes the specs to the chat template (`tools=`).

`ToolExecutor` runs calls in a `RewardWorkerPool` (rewards/pool.py: one process per worker, forkserver, a
hung call's worker is killed and replaced) with, per call, a timeout, an address-space cap
(`resource.setrlimit(RLIMIT_AS)`, set once in each worker) and an output cap (characters; the rest is cut
and marked). A call that raises, hangs (timeout), kills its worker, exhausts its memory or returns
something that is not text becomes an error observation and is counted (`tool/errors`, `tool/timeouts`);
the rollout goes on. `ToolErrorBudget` raises `ToolError` when more than `max_error_fraction` of a step's
calls fail (as `rewards/manager.py` does for reward calls): a tool that fails on most calls is a bug.

Built-in tools (`BUILTIN_TOOLS`): `calculator` (arithmetic through `ast`, no `eval`) and `python` (code in a
sandboxed subprocess, `sandbox.py`).
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import json
import math
import operator
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from jaxrl_post.rollout.sandbox import python

__all__ = [
    "BUILTIN_TOOLS",
    "FileFunction",
    "Tool",
    "ToolError",
    "ToolErrorBudget",
    "ToolExecutor",
    "ToolResult",
    "calculator",
    "cap_text",
    "evaluate_arithmetic",
    "resolve_tools",
]


class ToolError(RuntimeError):
    """More than `max_error_fraction` of a step's tool calls failed (the message gives the counts and the
    first failure)."""


@dataclasses.dataclass(frozen=True)
class Tool:
    """A callable tool: `fn(**arguments) -> str` and its OpenAI function spec `schema`.

    `fn` must be picklable (defined at module level) to run in the worker processes."""

    fn: Callable[..., Any]
    schema: dict

    @property
    def name(self) -> str:
        return self.schema["function"]["name"]

    @classmethod
    def from_function(cls, fn: Callable[..., Any], schema: Mapping | None = None) -> Tool:
        """A tool from `fn`; `schema` None: `transformers.utils.get_json_schema(fn)` (type hints + Google-style
        docstring with an `Args:` entry per parameter; raises its `TypeHintParsingException` /
        `DocstringParsingException` when they are missing). A bare function spec (`{"name", ...}`) is wrapped
        as `{"type": "function", "function": spec}`."""
        if schema is None:
            from transformers.utils import get_json_schema

            schema = get_json_schema(fn)
        schema = dict(schema)
        if "function" not in schema:
            schema = {"type": "function", "function": schema}
        schema["function"] = {k: v for k, v in schema["function"].items() if k != "return"}
        return cls(fn, schema)


@dataclasses.dataclass(frozen=True)
class ToolResult:
    """One call's outcome: `text` (the observation), `status` 'ok' | 'error' | 'timeout'."""

    text: str
    status: str = "ok"


# ------------------------------------------------------------------------------------------ calculator
_BINOPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNOPS = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_MAX_POW = 1000  # largest exponent magnitude
_MAX_DIGITS = 4000  # largest integer result, in decimal digits


def _eval_node(node: ast.AST):
    if isinstance(node, ast.Expression):
        return _eval_node(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        left, right = _eval_node(node.left), _eval_node(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > _MAX_POW:
            raise ValueError(f"exponent {right} too large (limit {_MAX_POW})")
        out = _BINOPS[type(node.op)](left, right)
        if isinstance(out, int) and out.bit_length() > _MAX_DIGITS * 3.33:
            raise ValueError(f"result has more than {_MAX_DIGITS} digits")
        return out
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNOPS:
        return _UNOPS[type(node.op)](_eval_node(node.operand))
    raise ValueError(f"unsupported expression element {type(node).__name__}; use numbers, + - * / // % ** ( )")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression and return the result.

    Args:
        expression: an arithmetic expression with numbers, + - * / // % ** and parentheses, e.g. "12*(3+4)"
    """
    try:
        return str(evaluate_arithmetic(expression))
    except (ValueError, ArithmeticError) as e:  # the model's mistake: an observation, not a tool failure
        return f"Error: {e}"


def evaluate_arithmetic(expression: str) -> int | float:
    """The value of an arithmetic `expression` (numbers, + - * / // % ** and parentheses), walked with `ast`
    (no `eval`): integral floats under 1e15 come back as ints. Raises ValueError for anything else (names,
    calls, attributes...), an exponent over 1000, a result over 4000 digits or not finite; ZeroDivisionError."""
    try:
        tree = ast.parse(str(expression).strip(), mode="eval")
    except SyntaxError as e:
        raise ValueError(f"cannot parse {expression!r}: {e.msg}") from None
    value = _eval_node(tree)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"result is not finite: {value}")
        if value.is_integer() and abs(value) < 1e15:
            value = int(value)
    return value


BUILTIN_TOOLS: dict[str, Callable[..., Any]] = {"calculator": calculator, "python": python}


class FileFunction:
    """A function `name` defined in the Python file `path`, loaded on first call (picklable by path and name,
    so worker processes load the file themselves, as `rewards.CustomRewardFunction` does).

    Raises (at construction, in the parent): FileNotFoundError, ImportError naming the file, AttributeError
    listing its callables, TypeError if not callable."""

    def __init__(self, path: str, name: str):
        self.path, self.name = os.path.abspath(path), name
        self._fn = None
        fn = self._load()
        self.__name__, self.__doc__ = name, fn.__doc__
        self.__wrapped__ = fn  # get_json_schema reads the signature and docstring through it

    def _load(self):
        if self._fn is None:
            import importlib.util

            if not os.path.isfile(self.path):
                raise FileNotFoundError(f"tool file {self.path} does not exist")
            spec = importlib.util.spec_from_file_location(f"jaxrl_post_tool_{abs(hash(self.path))}", self.path)
            module = importlib.util.module_from_spec(spec)
            try:
                spec.loader.exec_module(module)
            except Exception as e:
                raise ImportError(f"tool file {self.path} failed to import: {type(e).__name__}: {e}") from e
            if not hasattr(module, self.name):
                names = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
                raise AttributeError(f"tool file {self.path} has no {self.name!r}; its callables: {names}")
            fn = getattr(module, self.name)
            if not callable(fn):
                raise TypeError(f"{self.name!r} in {self.path} is not callable")
            self._fn = fn
        return self._fn

    def __call__(self, *args, **kwargs):
        return self._load()(*args, **kwargs)

    def __getstate__(self):
        return {"path": self.path, "name": self.name}

    def __setstate__(self, state):
        self.path, self.name, self._fn = state["path"], state["name"], None


def resolve_tools(names: str | Sequence[str | Callable | Tool]) -> list[Tool]:
    """`Tool`s from built-in names (`BUILTIN_TOOLS`), `'path/to/file.py:function'` specs (a comma-separated
    string of either allowed), functions or `Tool`s. A function's schema comes from its type hints and
    docstring (`Tool.from_function`).

    Raises ValueError for an unknown name or two tools with the same name (and what `FileFunction` raises)."""
    if isinstance(names, str):
        names = [n.strip() for n in names.split(",") if n.strip()]
    tools = []
    for t in names:
        if isinstance(t, Tool):
            tools.append(t)
        elif isinstance(t, str) and ":" in t and t.split(":", 1)[0].endswith(".py"):
            path, name = t.split(":", 1)
            fn = FileFunction(path, name)
            tools.append(Tool.from_function(fn, _schema_of(fn.__wrapped__)))
        elif isinstance(t, str):
            if t not in BUILTIN_TOOLS:
                raise ValueError(
                    f"unknown tool {t!r} (rollout.multi_turn.tools); built-in: {sorted(BUILTIN_TOOLS)}, or "
                    "'path/to/file.py:function'"
                )
            tools.append(Tool.from_function(BUILTIN_TOOLS[t]))
        else:
            tools.append(Tool.from_function(t))
    seen = [t.name for t in tools]
    if len(set(seen)) != len(seen):
        raise ValueError(f"tool names must be unique, got {seen}")
    return tools


def _schema_of(fn) -> dict:
    from transformers.utils import get_json_schema

    return get_json_schema(fn)


# ------------------------------------------------------------------------------------------ execution
_CAPPED_WORKER_MB: list[int] = []  # the address-space cap already set in this worker process


def _call_tool(fns: Mapping[str, Callable[..., Any]], memory_mb: int, max_output_chars: int, name: str, arguments):
    """Runs in a worker process: cap this worker's address space (once), call the tool with its printing sent
    to a capped buffer, and return its result as capped text."""
    import contextlib
    import io
    import resource

    if memory_mb and [memory_mb] != _CAPPED_WORKER_MB:
        resource.setrlimit(resource.RLIMIT_AS, (memory_mb << 20, resource.getrlimit(resource.RLIMIT_AS)[1]))
        _CAPPED_WORKER_MB[:] = [memory_mb]
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        out = fns[name](**arguments)
    if out is None:  # a function that forgot its `return`: an error observation (docs/agents.md), not "null"
        raise TypeError(f"tool {name!r} returned None, not text")
    if not isinstance(out, str):
        try:
            out = json.dumps(out)
        except (TypeError, ValueError):
            raise TypeError(f"tool {name!r} returned {type(out).__name__}, not text or JSON") from None
    return cap_text(out, max_output_chars)


def cap_text(text: str, max_chars: int, side: str = "left") -> str:
    """`text` cut to `max_chars` characters with a `...(truncated)` mark (verl's truncation of tool responses,
    `multi_turn.tool_response_truncate_side`): 'left' keeps the start, 'right' the end, 'middle' both ends."""
    if max_chars is None or len(text) <= max_chars:
        return text
    if side == "left":
        return text[:max_chars] + "...(truncated)"
    if side == "right":
        return "(truncated)..." + text[-max_chars:]
    if side == "middle":
        half = max_chars // 2
        return text[:half] + "...(truncated)..." + text[len(text) - (max_chars - half) :]
    raise ValueError(f"tool_response_truncate_side must be left, right or middle, got {side!r}")


class ToolExecutor:
    """Runs tool calls in `num_workers` worker processes.

    Args:
      tools: the tools (unique names).
      num_workers: worker processes (>= 1).
      timeout_s: per-call wall-time limit; the worker of a call over it is killed and replaced.
      memory_mb: address-space cap of each worker (RLIMIT_AS), MiB; 0 = none.
      max_output_chars: a result longer than this is cut (in the worker, before it is sent back).
      mp_context: 'forkserver' (default on POSIX) or 'spawn'.
    """

    def __init__(
        self,
        tools: Sequence[Tool],
        num_workers: int = 2,
        timeout_s: float = 10.0,
        memory_mb: int = 2048,
        max_output_chars: int = 8192,
        mp_context: str | None = None,
    ):
        from jaxrl_post.rewards.pool import RewardWorkerPool

        self.tools = {t.name: t for t in tools}
        fn = functools.partial(_call_tool, {n: t.fn for n, t in self.tools.items()}, int(memory_mb), max_output_chars)
        self._pool = RewardWorkerPool(fn, int(num_workers), timeout_s, mp_context, label="tool")
        self.schemas = [t.schema for t in tools]

    def run(self, calls: Sequence[tuple[str, dict]]) -> list[ToolResult]:
        """`(name, arguments)` calls (names must be tools here: check with `tool_parser.validate_call` first)
        -> one `ToolResult` each, in order; never raises for a failing call."""
        unknown = [n for n, _ in calls if n not in self.tools]
        if unknown:
            raise ValueError(f"unknown tools {unknown}; validate calls first")
        out = []
        for res in self._pool.map([(n, a) for n, a in calls]):
            if res.status == "ok":
                out.append(ToolResult(res.value, "ok"))
            else:
                out.append(ToolResult(f"Error: {res.message}", res.status))
        return out

    def close(self) -> None:
        self._pool.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class ToolErrorBudget:
    """Counts a step's executed tool calls and their failures; `check()` raises `ToolError` past
    `max_error_fraction`.

    Failures: calls that raised, timed out, crashed their worker or returned no text -- bugs of the tool. The
    model's own mistakes (malformed calls, unknown tools, bad arguments, a calculator expression that does not
    parse) are observations for it to learn from, counted by the agent loop but not here."""

    def __init__(self, max_error_fraction: float = 0.5):
        if not 0.0 <= float(max_error_fraction) <= 1.0:
            raise ValueError(f"max_error_fraction must be in [0, 1], got {max_error_fraction}")
        self.max_error_fraction = float(max_error_fraction)
        self.first_error: str | None = None
        self.reset()

    def reset(self) -> None:
        """Start counting a new step."""
        self.calls = self.errors = self.timeouts = 0
        self.first_error = None

    def add(self, status: str, message: str = "") -> None:
        self.calls += 1
        if status != "ok":
            self.errors += 1
            self.timeouts += status == "timeout"
            if self.first_error is None:
                self.first_error = " ".join(message.split())  # ToolError is one line

    def check(self) -> None:
        """Raises ToolError when errors > max_error_fraction * calls (and at least one call failed)."""
        if self.errors and self.errors > self.max_error_fraction * self.calls:
            raise ToolError(
                f"{self.errors} of {self.calls} tool calls failed in this step ({self.timeouts} timeouts; limit "
                f"rollout.multi_turn.max_error_fraction={self.max_error_fraction:g}). First failure: "
                f"{self.first_error}"
            )
