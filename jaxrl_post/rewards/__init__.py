"""Rule rewards on decoded text, dispatched by `data_source` (verl's `default_compute_score`).

Public API:
  default_compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float | dict
  REWARD_FUNCTIONS / get_reward_fn(data_source) / check_data_sources(sources): the registry by data_source
  load_custom_reward_fn(path, name="compute_score", reward_kwargs=None) -> picklable callable
  RewardManager(compute_score, tokenizer, num_workers, timeout_s)   (see manager.py)
  gsm8k, math_reward, reasoning_gym_reward: the scorers.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
from collections.abc import Callable, Iterable
from typing import Any

from jaxrl_post.rewards import gsm8k, math_reward, reasoning_gym_reward
from jaxrl_post.rewards.manager import RewardFunctionError, RewardManager, RewardOutput

__all__ = [
    "CustomRewardFunction",
    "GSM8K_SOURCES",
    "MATH_SOURCES",
    "REWARD_FUNCTIONS",
    "RewardFunctionError",
    "RewardManager",
    "RewardOutput",
    "UnknownDataSourceError",
    "check_data_sources",
    "default_compute_score",
    "get_reward_fn",
    "known_data_sources",
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


def _is_reasoning_gym(data_source: str) -> bool:  # also used by rl/validation.py (maj@k answers)
    return data_source in ("reasoning_gym", "reasoning-gym") or data_source.startswith(_RG_PREFIXES)


def _gsm8k_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    return gsm8k.compute_score(solution_str, ground_truth, **kwargs)


def _math_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    return math_reward.compute_score(solution_str, ground_truth, **kwargs)


def _reasoning_gym_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    return reasoning_gym_reward.compute_score(
        solution_str, ground_truth, extra_info=extra_info, data_source=data_source, **kwargs
    )


# The reward registry: data_source -> scorer(data_source, solution_str, ground_truth, extra_info, **kwargs).
REWARD_FUNCTIONS: dict[str, Callable[..., Any]] = {
    **dict.fromkeys(GSM8K_SOURCES, _gsm8k_score),
    **dict.fromkeys(MATH_SOURCES, _math_score),
    "reasoning_gym": _reasoning_gym_score,  # the task comes from extra_info["task"]
    "reasoning-gym": _reasoning_gym_score,
}
# data_source prefixes: 'reasoning_gym/<task>' etc.
REWARD_FUNCTION_PREFIXES: dict[str, Callable[..., Any]] = dict.fromkeys(_RG_PREFIXES, _reasoning_gym_score)


class UnknownDataSourceError(NotImplementedError):
    """A data_source with no reward function in the registry (and no custom reward function set)."""


def known_data_sources() -> list[str]:
    """The data sources `default_compute_score` can score (prefixes shown as '<prefix><task>')."""
    return list(REWARD_FUNCTIONS) + [f"{p}<task>" for p in REWARD_FUNCTION_PREFIXES]


def _unknown_message(unknown: list[str]) -> str:
    what = f"data_source={unknown[0]!r}" if len(unknown) == 1 else f"data_sources {unknown}"
    return (
        f"No reward function for {what}. Known data sources: {known_data_sources()}. "
        "Set custom_reward_function.path/name (--config.custom_reward_function.path=my_reward.py) "
        "to score other sources."
    )


def get_reward_fn(data_source: str) -> Callable[..., Any]:
    """The registry's scorer for `data_source` (exact name first, then prefix).

    Raises:
      UnknownDataSourceError: no scorer for it (the message lists the known data sources).
    """
    if data_source in REWARD_FUNCTIONS:
        return REWARD_FUNCTIONS[data_source]
    for prefix, fn in REWARD_FUNCTION_PREFIXES.items():
        if data_source.startswith(prefix):
            return fn
    raise UnknownDataSourceError(_unknown_message([data_source]))


def check_data_sources(data_sources: Iterable[str]) -> None:
    """Check that `default_compute_score` can score every data source (call it before training).

    Raises:
      UnknownDataSourceError: some are unknown; the message names all of them and lists the known ones.
    """
    unknown = []
    for ds in dict.fromkeys(data_sources):
        try:
            get_reward_fn(str(ds))
        except UnknownDataSourceError:
            unknown.append(str(ds))
    if unknown:
        raise UnknownDataSourceError(_unknown_message(unknown))


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
    Extra keyword arguments go to the scorer. The registry is `REWARD_FUNCTIONS` (+ prefixes).

    Raises:
      UnknownDataSourceError (a NotImplementedError): unknown data source (the message lists the known ones).
    """
    return get_reward_fn(data_source)(data_source, solution_str, ground_truth, extra_info, **kwargs)


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
