"""The error types user-caused failures are reported with (`main` prints each as one `error: ...` line).

`ConfigError` is the one configuration error: every config check (`rl/config_check.py`, the SFT / DPO / RM
checks, `rl/preflight.py`, the run directory's lock) raises it naming the `config.<key>` at fault.
`FilterGroupsError` is DAPO's dynamic sampling giving up before any update of a step (`rl/dynamic_sampling.py`);
the run directory (`engine/run/run_dir.py`) treats it, like a reward function's failure, as a step that never ran.
"""

from __future__ import annotations

__all__ = ["ConfigError", "FilterGroupsError"]


class ConfigError(ValueError):
    """Invalid configuration; the message lists every offending `config.<key>`."""


class FilterGroupsError(RuntimeError):
    """`algorithm.filter_groups.max_num_gen_batches` generation batches did not yield `data.train_batch_size`
    groups whose responses differ (the message gives the counts and what to change)."""
