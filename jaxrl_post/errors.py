"""The error types user-caused failures are reported with (`main` prints each as one `error: ...` line), and the
`Checker` every config check reports through.

`ConfigError` is the one configuration error: every config check (the sections of `rl/config_check.py`, the
SFT / DPO / RM checks, `rl/preflight.py`, the run directory's lock) raises it naming the `config.<key>` at fault.
`Checker` holds a job config and the problems found so far; each config section's check function (beside the
feature that reads the section: `rollout/config_checks.py`, `algos/config_checks.py`, ...) takes one and reports
through `check` / `err`, and `raise_if_any` raises the one `ConfigError` listing them all.
`FilterGroupsError` is DAPO's dynamic sampling giving up before any update of a step (`rl/dynamic_sampling.py`);
the run directory (`engine/run/run_dir.py`) treats it, like a reward function's failure, as a step that never ran.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

__all__ = [
    "Checker",
    "ConfigError",
    "DeviceCounts",
    "FilterGroupsError",
    "config_value",
    "is_int",
    "is_num",
    "nonneg",
    "pos_int",
]


class ConfigError(ValueError):
    """Invalid configuration; the message lists every offending `config.<key>`."""


class FilterGroupsError(RuntimeError):
    """`algorithm.filter_groups.max_num_gen_batches` generation batches did not yield `data.train_batch_size`
    groups whose responses differ (the message gives the counts and what to change)."""


def is_int(v: Any) -> bool:
    """An int, not a bool."""
    return isinstance(v, int) and not isinstance(v, bool)


def is_num(v: Any) -> bool:
    """An int or a float, not a bool."""
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def pos_int(v: Any) -> bool:
    """An int (not a bool) > 0."""
    return is_int(v) and v > 0


def nonneg(v: Any) -> bool:
    """A number (not a bool) >= 0."""
    return is_num(v) and v >= 0


def config_value(cfg: Any, path: str) -> Any:
    """The value at a dotted `path` of a ConfigDict (or nested dicts). Raises AttributeError / KeyError when a
    part is missing."""
    node = cfg
    for part in path.split("."):
        node = node[part] if isinstance(node, dict) else getattr(node, part)
    return node


class DeviceCounts(NamedTuple):
    """The devices a run's config is checked against: `total` (all devices of the job), `rollout` (those the
    split placement gives the rollout, 0 when colocated) and `processes` (JAX processes)."""

    total: int
    rollout: int = 0
    processes: int = 1

    @property
    def train(self) -> int:
        """Devices of the training mesh: `total - rollout`."""
        return self.total - self.rollout


class Checker:
    """Collects a config's problems, one `config.<key>=<value>: <what is wrong>` line each.

    Args:
      cfg: the job ConfigDict the keys are read from.
      devices: the device counts the RL sections check against (None for the supervised trainers).

    Attributes:
      errors: the lines so far, in the order they were found.
      checked: the keys whose value `check` validated, in order (the ownership test reads it).
    """

    def __init__(self, cfg: Any, devices: DeviceCounts | None = None):
        self.cfg, self.devices = cfg, devices
        self.errors: list[str] = []
        self.checked: list[str] = []

    def add(self, line: str) -> None:
        """Appends `config.<line>` as it is (for messages that do not read `<key>=<value>: ...`)."""
        self.errors.append(f"config.{line}")

    def err(self, key: str, msg: str) -> None:
        """Reports `config.<key>=<value>: <msg>` (`config.<key>: <msg>` when the key does not exist)."""
        try:
            val = config_value(self.cfg, key)
            self.errors.append(f"config.{key}={val!r}: {msg}")
        except (AttributeError, KeyError):
            self.errors.append(f"config.{key}: {msg}")

    def check(self, key: str, pred: Callable[[Any], bool], msg: str) -> bool:
        """Whether `pred(value of key)` holds; reports `msg` (or `missing key`) when not. A predicate that raises
        (a value of the wrong type) counts as False; a float nan or +-inf fails every check, reported as
        `not a finite number; <msg>` (no checked key takes one)."""
        self.checked.append(key)
        try:
            val = config_value(self.cfg, key)
        except (AttributeError, KeyError):
            self.errors.append(f"config.{key}: missing key")
            return False
        if isinstance(val, float) and not math.isfinite(val):  # nan / inf pass `v >= 0`-style predicates or fail oddly
            self.err(key, f"not a finite number; {msg}")
            return False
        try:
            ok = pred(val)
        except Exception:  # wrong type for the predicate: reported below as the key's error
            ok = False
        if not ok:
            self.err(key, msg)
        return bool(ok)

    def raise_if_any(self, title: str = "invalid config") -> None:
        """Raises ConfigError(`<title>:` and one indented line per problem) when any was found.

        Raises:
          ConfigError: listing every problem, in the order found.
        """
        if self.errors:
            raise ConfigError(f"{title}:\n  " + "\n  ".join(self.errors))
