"""Rule rewards on decoded text, dispatched by `data_source` (verl's `default_compute_score`).

Public API:
  default_compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float | dict
  load_custom_reward_fn(path, name="compute_score", reward_kwargs=None) -> picklable callable
  RewardManager(compute_score, tokenizer, num_workers, timeout_s)   (see manager.py)
  gsm8k, math_reward, reasoning_gym_reward: the scorers.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
from collections.abc import Callable
from typing import Any

from jaxrl_post.rewards import gsm8k, math_reward, reasoning_gym_reward
from jaxrl_post.rewards.manager import RewardManager, RewardOutput

__all__ = [
    "CustomRewardFunction",
    "GSM8K_SOURCES",
    "MATH_SOURCES",
    "RewardManager",
    "RewardOutput",
    "default_compute_score",
    "gsm8k",
    "load_custom_reward_fn",
    "math_reward",
    "reasoning_gym_reward",
]

GSM8K_SOURCES = ("openai/gsm8k", "gsm8k")
MATH_SOURCES = (
    "lighteval/MATH",
    "DigitalLearningGmbH/MATH-lighteval",
    "HuggingFaceH4/MATH-500",
    "math",
    "MATH",
)
_RG_PREFIXES = reasoning_gym_reward.DATA_SOURCE_PREFIXES


def _is_reasoning_gym(data_source: str) -> bool:
    return data_source in ("reasoning_gym", "reasoning-gym") or data_source.startswith(_RG_PREFIXES)


def default_compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: str,
    extra_info: dict[str, Any] | None = None,
    **kwargs: Any,
) -> float | dict[str, Any]:
    """Score one decoded response by its data source (verl's `default_compute_score`).

    'openai/gsm8k', 'gsm8k' -> gsm8k.compute_score (strict "####" answer, numeric comparison);
    MATH sources (MATH_SOURCES) -> math_reward.compute_score (boxed answer, math-verify);
    'reasoning_gym/<task>' (or 'reasoning_gym' with extra_info['task']) -> the task's own scorer.
    Extra keyword arguments go to the scorer.

    Raises:
      NotImplementedError: unknown data source (the message lists the known ones).
    """
    if data_source in GSM8K_SOURCES:
        return gsm8k.compute_score(solution_str, ground_truth, **kwargs)
    if data_source in MATH_SOURCES:
        return math_reward.compute_score(solution_str, ground_truth, **kwargs)
    if _is_reasoning_gym(data_source):
        return reasoning_gym_reward.compute_score(
            solution_str, ground_truth, extra_info=extra_info, data_source=data_source, **kwargs
        )
    known = list(GSM8K_SOURCES) + list(MATH_SOURCES) + ["reasoning_gym/<task>"]
    raise NotImplementedError(
        f"No reward function for data_source={data_source!r}. Known data sources: {known}. "
        "Set custom_reward_function.path/name to score other sources."
    )


class CustomRewardFunction:
    """A user reward function loaded from a Python file; picklable by (path, name, kwargs).

    Pickling re-imports the file in the receiving process, so it works with 'spawn'/'forkserver'
    reward workers even though the file is not an importable module.
    Call signature: fn(data_source, solution_str, ground_truth, extra_info=None) -> float | dict.
    """

    def __init__(self, path: str, name: str = "compute_score", reward_kwargs: dict[str, Any] | None = None):
        self.path = os.path.abspath(os.path.expanduser(path))
        self.name = name
        self.reward_kwargs = dict(reward_kwargs or {})
        self._fn = _load_function(self.path, self.name)

    def __call__(self, data_source, solution_str, ground_truth, extra_info=None):
        return self._fn(data_source, solution_str, ground_truth, extra_info, **self.reward_kwargs)

    def __getstate__(self):
        return {"path": self.path, "name": self.name, "reward_kwargs": self.reward_kwargs}

    def __setstate__(self, state):
        self.__init__(state["path"], state["name"], state["reward_kwargs"])

    def __repr__(self):
        return f"CustomRewardFunction({self.path!r}, {self.name!r})"


def _load_function(path: str, name: str) -> Callable[..., Any]:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"custom reward function file not found: {path}")
    module_name = "jaxrl_post_custom_reward_" + hashlib.sha1(path.encode()).hexdigest()[:12]
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path} as a Python module (is it a .py file?)")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        sys.modules.pop(module_name, None)
        raise ImportError(f"error while importing custom reward file {path}: {type(e).__name__}: {e}") from e
    if not hasattr(module, name):
        available = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        raise AttributeError(f"reward function {name!r} not found in {path}; callables defined there: {available}")
    fn = getattr(module, name)
    if not callable(fn):
        raise TypeError(f"{name!r} in {path} is not callable (got {type(fn).__name__})")
    return fn


def load_custom_reward_fn(
    path: str | None, name: str = "compute_score", reward_kwargs: dict[str, Any] | None = None
) -> CustomRewardFunction | None:
    """Load `name` from the Python file `path` (verl's `custom_reward_function.path/name`).

    Returns None when `path` is None or empty (meaning: use default_compute_score).
    Raises:
      FileNotFoundError: no such file. ImportError: the file fails to import (message names it).
      AttributeError: no attribute `name` (lists the file's callables). TypeError: not callable.
    """
    if not path:
        return None
    return CustomRewardFunction(path, name or "compute_score", reward_kwargs)
