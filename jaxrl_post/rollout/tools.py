"""Tools for multi-turn rollouts: Python functions with a JSON schema, run in worker processes.

A `Tool` is a module-level function plus its OpenAI function spec (`{"type": "function", "function": {"name",
"description", "parameters"}}`), by default derived from the type hints and the Google-style docstring by
`transformers.utils.get_json_schema`; the agent loop passes the specs to the chat template (`tools=`).

`ToolExecutor` runs calls in a `RewardWorkerPool` (rewards/pool.py: one process per worker, forkserver, a hung
call's worker is killed and replaced) with, per call, a timeout, an address-space cap
(`resource.setrlimit(RLIMIT_AS)`, set once in each worker) and an output cap (characters; the rest is cut and
marked). Workers get an allowlisted environment (`worker_env`: `PATH`, `LANG`, `LC_ALL`, `HOME` and `TMPDIR` set to
the executor's own directory), not the trainer's. Tools marked `sandboxed` (file tools only) run each call in the
sandbox of `sandbox.py` instead, as the built-in `python` tool does. A call that raises, hangs (timeout), kills its
worker, exhausts its memory or returns something that is not text becomes an error observation and is counted
(`tool/errors`, `tool/timeouts`); the rollout goes on. `ToolErrorBudget` raises `ToolError` when more than
`max_error_fraction` of a step's calls fail (as `rewards/manager.py` does for reward calls): a tool that fails on
most calls is a bug.

Built-in tools (`BUILTIN_TOOLS`): `calculator` (arithmetic through `ast`, no `eval`) and `python` (code in a
sandboxed subprocess, `sandbox.py`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from jaxrl_post.rewards.pool import RewardWorkerPool
from jaxrl_post.rollout import sandbox
from jaxrl_post.rollout.calculator import calculator, evaluate_arithmetic
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
    "check_sandbox",
    "evaluate_arithmetic",
    "resolve_tools",
    "worker_env",
]


class ToolError(RuntimeError):
    """More than `max_error_fraction` of a step's tool calls failed (the message gives the counts and the
    first failure)."""


@dataclasses.dataclass(frozen=True)
class Tool:
    """A callable tool: `fn(**arguments) -> str` and its OpenAI function spec `schema`.

    `fn` must be picklable (defined at module level) to run in the worker processes. `sandboxed`: each call runs
    in the sandbox (`sandbox.run_function_sandboxed`); only for a `FileFunction`."""

    fn: Callable[..., Any]
    schema: dict
    sandboxed: bool = False

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


def _split(names):
    return [n.strip() for n in names.split(",") if n.strip()] if isinstance(names, str) else list(names)


def resolve_tools(names: str | Sequence[str | Callable | Tool], sandboxed: str | Sequence[str] = ()) -> list[Tool]:
    """`Tool`s from built-in names (`BUILTIN_TOOLS`), `'path/to/file.py:function'` specs (a comma-separated
    string of either allowed), functions or `Tool`s. A function's schema comes from its type hints and
    docstring (`Tool.from_function`). `sandboxed`: names of file tools to run in the sandbox (comma-separated
    string or sequence; the built-in `python` always is).

    Raises ValueError for an unknown name, two tools with the same name, or a `sandboxed` name that is not a file
    tool here (and what `FileFunction` raises)."""
    names, sandboxed = _split(names), set(_split(sandboxed))
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
    files = {t.name for t in tools if isinstance(t.fn, FileFunction)}
    if sandboxed - files:
        raise ValueError(
            f"sandboxed tools {sorted(sandboxed - files)} (rollout.multi_turn.sandboxed_tools) are not file tools "
            f"('path/to/file.py:function') of this run; its file tools: {sorted(files)}"
        )
    return [dataclasses.replace(t, sandboxed=True) if t.name in sandboxed else t for t in tools]


def check_sandbox(tools: Sequence[Tool], allow_unsandboxed: bool) -> None:
    """At start-up: the tools that need the sandbox (`python`, `sandboxed` ones) get it here, or
    SandboxUnavailableError with one line saying what is missing and naming the opt-out
    (`rollout.multi_turn.allow_unsandboxed_tools`); opted out, a warning line instead."""
    names = [t.name for t in tools if t.sandboxed or t.fn is python]
    problem = sandbox.isolation_problem() if names else None
    if problem is None:
        return
    if not allow_unsandboxed:
        raise sandbox.SandboxUnavailableError(
            f"tools {names} need the sandbox, which this machine cannot provide: {problem}; set "
            "rollout.multi_turn.allow_unsandboxed_tools=True to run them without file and process isolation"
        )
    logging.getLogger(__name__).warning(
        "tools %s run WITHOUT file and process isolation (rollout.multi_turn.allow_unsandboxed_tools=True): %s",
        names, problem,
    )  # fmt: skip


def _schema_of(fn) -> dict:
    from transformers.utils import get_json_schema

    return get_json_schema(fn)


# ------------------------------------------------------------------------------------------ execution
_WORKER_SET: list = []  # the settings already applied in this worker process (address-space cap, environment)


def worker_env(home: str) -> dict[str, str]:
    """The environment of a tool worker: the trainer's `PATH`, `LANG` and `LC_ALL` (`C.UTF-8` when unset),
    `HOME` and `TMPDIR` = `home`; nothing else (no tokens, credentials or paths of the trainer)."""
    env = {"PATH": os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin"), "HOME": home, "TMPDIR": home}
    env["LANG"] = os.environ.get("LANG", "C.UTF-8")
    env["LC_ALL"] = os.environ.get("LC_ALL", env["LANG"])
    return env


@dataclasses.dataclass(frozen=True)
class _WorkerSettings:
    fns: Mapping[str, Callable[..., Any]]
    memory_mb: int
    max_output_chars: int
    env: Mapping[str, str] | None  # None: keep the inherited environment
    sandboxed: frozenset[str]  # file tools run in the sandbox
    timeout_s: float
    max_processes: int
    allow_unisolated: bool


def _call_tool(settings: _WorkerSettings, name: str, arguments):
    """Runs in a worker process: apply the worker settings (once: address-space cap, environment, sandbox
    settings), call the tool (in the sandbox when it is marked so) with its printing sent to a capped buffer, and
    return its result as capped text."""
    import contextlib
    import io
    import resource

    if [settings] != _WORKER_SET:
        if settings.memory_mb:
            cap = settings.memory_mb << 20
            resource.setrlimit(resource.RLIMIT_AS, (cap, resource.getrlimit(resource.RLIMIT_AS)[1]))
        if settings.env is not None:
            os.environ.clear()
            os.environ.update(settings.env)
        sandbox.configure(allow_unisolated=settings.allow_unisolated, max_processes=settings.max_processes)
        _WORKER_SET[:] = [settings]
    fn = settings.fns[name]
    if name in settings.sandboxed:  # the worker's own cap does not apply to the sandbox's processes
        out = sandbox.run_function_sandboxed(
            fn.path, fn.name, dict(arguments), timeout_s=max(0.5, settings.timeout_s - 1.0),
            memory_mb=settings.memory_mb or 2048, max_output_bytes=max(4096, 4 * settings.max_output_chars),
        )  # fmt: skip
    else:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            out = fn(**arguments)
    if out is None:  # a function that forgot its `return`: an error observation (docs/agents.md), not "null"
        raise TypeError(f"tool {name!r} returned None, not text")
    if not isinstance(out, str):
        try:
            out = json.dumps(out)
        except (TypeError, ValueError):
            raise TypeError(f"tool {name!r} returned {type(out).__name__}, not text or JSON") from None
    return cap_text(out, settings.max_output_chars)


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
      max_processes: processes of one sandboxed call (the `python` tool, `sandboxed` tools).
      allow_unsandboxed: run sandboxed tools without isolation where `sandbox.isolation_problem()` is not None
        (the explicit opt-out); False: such calls fail with `SandboxUnavailableError`'s message.
      minimal_env: workers get `worker_env(dir)` (`dir`: a temporary directory of this executor, removed by
        `close`); False: the trainer's environment.
    """

    def __init__(
        self,
        tools: Sequence[Tool],
        num_workers: int = 2,
        timeout_s: float = 10.0,
        memory_mb: int = 2048,
        max_output_chars: int = 8192,
        mp_context: str | None = None,
        max_processes: int = 16,
        allow_unsandboxed: bool = False,
        minimal_env: bool = True,
    ):

        self.tools = {t.name: t for t in tools}
        self.home = tempfile.mkdtemp(prefix="jaxrl_post_tools_")
        settings = _WorkerSettings(
            fns={n: t.fn for n, t in self.tools.items()}, memory_mb=int(memory_mb), max_output_chars=max_output_chars,
            env=worker_env(self.home) if minimal_env else None,
            sandboxed=frozenset(n for n, t in self.tools.items() if t.sandboxed), timeout_s=float(timeout_s),
            max_processes=int(max_processes), allow_unisolated=bool(allow_unsandboxed),
        )  # fmt: skip
        fn = functools.partial(_call_tool, settings)
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
        shutil.rmtree(self.home, ignore_errors=True)

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
