"""What scoring a batch returns (`RewardOutput`), the error a failing reward function raises, and how a reward
function's result is read (`to_float`) and named in errors (`fn_label`). Used by `rewards.manager`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["RewardFunctionError", "RewardOutput", "fn_label", "to_float"]


@dataclass
class RewardOutput:
    """token_level_scores: [B, R] float32 (score on the last valid response token, 0 elsewhere);
    scores: [B] float32; metrics: scalar metrics ('reward/num_errors': failed calls of any kind, timeouts
    included; 'reward/num_timeouts': those that timed out; 'reward/extra/<key>/mean');
    extra_infos: per-row values of the extra keys of dict results, each [B] (float32 with NaN where a
    row lacks the key, or object when non-numeric); errors: up to 8 error messages of this batch;
    function_scores: [B] float32, the reward function's own scores, before the overlong penalty (equal to
    `scores` when overlong shaping is off)."""

    token_level_scores: np.ndarray
    scores: np.ndarray
    metrics: dict[str, float]
    extra_infos: dict[str, np.ndarray] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    function_scores: np.ndarray | None = None


class RewardFunctionError(RuntimeError):
    """More than `max_error_fraction` of a batch's reward calls failed (raised or timed out).

    The message names the reward function, the fraction, and the first failure (row, data source, error). In
    process, the original exception (with its traceback) is `__cause__`; from a worker process, the message
    ends with the worker's traceback text.
    """


def fn_label(fn: Any) -> str:
    """How an error names a reward function: its own label, the custom file and name, or its qualname."""
    if isinstance(getattr(fn, "reward_label", None), str):  # RemoteRewardClient, GenerativeJudge
        return fn.reward_label
    if hasattr(fn, "path") and hasattr(fn, "name"):  # CustomRewardFunction
        return f"{fn.name!r} from {fn.path} (custom_reward_function)"
    return getattr(fn, "__qualname__", None) or repr(fn)


def to_float(x: Any) -> float:
    """A reward function's scalar result as a float. Raises TypeError for anything else."""
    if isinstance(x, (bool, np.bool_)):
        return float(x)
    if isinstance(x, (int, float, np.integer, np.floating)) or (isinstance(x, np.ndarray) and x.size == 1):
        return float(x)
    raise TypeError(f"reward must be a number or a dict with a numeric 'score', got {type(x).__name__}: {x!r}")
