"""Environments for multi-turn rollouts: `reset(row) -> messages`, `step(assistant_text) -> StepResult`.

The shape of skyrl-gym's `BaseTextEnv` / OpenEnv / TRL's `environment_factory`: the agent loop makes one
environment per trajectory (`env_factory(row)`), renders `reset(row)`'s messages as the prompt, and after each
assistant turn calls `step` with the turn's text (the model's tokens decoded, without the end-of-turn token).
The step's messages (role 'tool' or 'user') are appended to the conversation as the chat template renders
them; its reward goes to the trajectory's `turn_scores` (verl's name; the reward function sees them in
`extra_info`); `done` ends the trajectory.

`ToolEnv` is the stateless case: a set of tools; each step parses the tool calls (`tool_parser`), runs them
(`tools.ToolExecutor`, all rows of a turn at once through `step_batch`) and answers with one 'tool' message per
call; a turn without calls ends the trajectory. `GuessNumberEnv` is a multi-turn game with feedback.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from typing import Any

from jaxrl_post.rollout.tool_parser import validate_call
from jaxrl_post.rollout.tools import cap_text

__all__ = ["Environment", "GuessNumberEnv", "StepResult", "ToolEnv", "guess_number_score"]


@dataclasses.dataclass
class StepResult:
    """`messages`: what the environment says next (chat messages, appended after the assistant turn);
    `reward`: this turn's reward (float); `done`: the trajectory ends; `info`: counters (numbers), e.g. a
    `ToolEnv`'s `tool_calls`, `tool_errors`, `tool_format_errors`, `tool_timeouts`, and `tool_statuses` (the
    executed calls' statuses, for the error budget)."""

    messages: list[dict]
    reward: float = 0.0
    done: bool = False
    info: dict[str, Any] = dataclasses.field(default_factory=dict)


class Environment:
    """One trajectory's environment. Subclasses implement `reset` and `step`; `step_batch` may be overridden to
    serve all trajectories of a turn at once (`ToolEnv` runs their calls in parallel)."""

    def reset(self, row: Mapping[str, Any]) -> list[dict]:
        """The initial conversation for dataset row `row` (its non-tensor fields: `raw_prompt`, `extra_info`,
        `ground_truth`...)."""
        raise NotImplementedError

    def step(self, action: str) -> StepResult:
        """React to the assistant's turn `action` (text)."""
        raise NotImplementedError

    @classmethod
    def step_batch(cls, envs: Sequence[Environment], actions: Sequence[str]) -> list[StepResult]:
        """`[env.step(a) for env, a in zip(envs, actions)]`; override to batch."""
        return [env.step(a) for env, a in zip(envs, actions)]


class ToolEnv(Environment):
    """A tool set as an environment (stateless between turns).

    Args:
      executor: `tools.ToolExecutor` (shared by all trajectories).
      parser: a tool-call parser (`tool_parser.get_tool_parser`).
      max_parallel_calls: calls run per turn (verl `multi_turn.max_parallel_calls`); later ones are dropped
        (counted in `tool_dropped_calls`), as verl does.
      max_tool_response_length: characters of a tool response kept (verl's meaning), cut on
        `tool_response_truncate_side` ('left' keeps the start, 'right' the end, 'middle' both).
    """

    def __init__(
        self,
        executor,
        parser,
        max_parallel_calls: int = 1,
        max_tool_response_length: int = 256,
        tool_response_truncate_side: str = "middle",
    ):
        self.executor, self.parser = executor, parser
        self.max_parallel_calls = int(max_parallel_calls)
        self.max_tool_response_length = int(max_tool_response_length)
        self.side = tool_response_truncate_side

    def reset(self, row):
        msgs = row.get("raw_prompt")
        if msgs is None:
            raise KeyError("ToolEnv.reset: the row has no 'raw_prompt' (its chat messages)")
        return [dict(m) for m in msgs]

    def step(self, action):
        return self.step_batch([self], [action])[0]

    @classmethod
    def step_batch(cls, envs, actions):

        if not envs:
            return []
        executor = envs[0].executor
        schemas = {n: t.schema["function"] for n, t in executor.tools.items()}
        plans = []  # per env: list of ("run", index into calls) | ("error", text)
        calls: list[tuple[str, dict]] = []
        results = []
        for env, action in zip(envs, actions):
            turn = env.parser.parse(action)
            info = {"tool_calls": 0, "tool_errors": 0, "tool_format_errors": 0, "tool_timeouts": 0}
            info["tool_dropped_calls"] = max(0, turn.num_calls - env.max_parallel_calls)
            plan = []  # malformed calls first, then the well-formed ones, each group in written order
            items = [("error", f"Error: malformed tool call: {e.error}") for e in turn.errors]
            for c in turn.calls:
                why = validate_call(c, schemas)
                items.append(("error", f"Error: {why}") if why else ("run", c))
            for kind, v in items[: env.max_parallel_calls]:
                info["tool_calls"] += 1
                if kind == "error":
                    info["tool_errors"] += 1
                    info["tool_format_errors"] += 1
                    plan.append(("error", v))
                else:
                    plan.append(("run", len(calls)))
                    calls.append((v.name, v.arguments))
            plans.append(plan)
            results.append(StepResult([], 0.0, not plan, info))
        outs = executor.run(calls) if calls else []
        for env, plan, res in zip(envs, plans, results):
            statuses = []
            for kind, v in plan:
                if kind == "error":
                    text = v
                else:
                    out = outs[v]
                    statuses.append((out.status, f"tool {calls[v][0]!r}: {out.text}"))
                    text = out.text
                    if out.status != "ok":
                        res.info["tool_errors"] += 1
                        res.info["tool_timeouts"] += out.status == "timeout"
                res.messages.append({"role": "tool", "content": cap_text(text, env.max_tool_response_length, env.side)})
            res.info["tool_statuses"] = statuses
        return results


class GuessNumberEnv(Environment):
    """Guess a secret integer in [low, high]: the model answers `<guess>N</guess>`, the user says "too low",
    "too high" or "correct". Reward 1.0 on the turn that guesses right (the episode ends), else 0; a turn
    without a readable guess gets a format hint. After `max_attempts` guesses the episode ends.

    The secret is `row['extra_info']['secret']` (or `row['ground_truth']`)."""

    pattern = re.compile(r"<guess>\s*(-?\d+)\s*</guess>")

    def __init__(self, low: int = 1, high: int = 100, max_attempts: int = 8):
        self.low, self.high, self.max_attempts = int(low), int(high), int(max_attempts)
        self.attempts = 0
        self.secret: int | None = None

    def reset(self, row):
        info = row.get("extra_info") or {}
        secret = info.get("secret", row.get("ground_truth"))
        if secret is None:
            raise KeyError("GuessNumberEnv.reset: the row needs extra_info['secret'] or ground_truth")
        self.secret, self.attempts = int(secret), 0
        return [
            {
                "role": "user",
                "content": f"I picked an integer between {self.low} and {self.high}. Guess it: answer with "
                "<guess>N</guess>. I will tell you if it is too low or too high.",
            }
        ]

    def step(self, action):
        m = self.pattern.search(action)
        if m is None:
            return StepResult([{"role": "user", "content": "Answer with <guess>N</guess>."}], 0.0, False)
        self.attempts += 1
        guess = int(m.group(1))
        if guess == self.secret:
            return StepResult([], 1.0, True, {"guesses": self.attempts})
        done = self.attempts >= self.max_attempts
        word = "too low" if guess < self.secret else "too high"
        return StepResult([{"role": "user", "content": f"{guess} is {word}."}], 0.0, done, {"guesses": self.attempts})


def guess_number_score(data_source, solution_str, ground_truth, extra_info=None):
    """Reward function for `GuessNumberEnv` trajectories: the sum of the episode's `turn_scores` (1.0 when it
    guessed the number, else 0.0)."""
    del data_source, solution_str, ground_truth
    return float(sum((extra_info or {}).get("turn_scores", [])))
