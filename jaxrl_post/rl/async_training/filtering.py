"""DAPO's dynamic sampling (`algorithm.filter_groups`) in asynchronous training: groups are filtered where they are
produced, before the queue.

verl's synchronous loop (`rl/dynamic_sampling.py`) filters the groups of a step's generation batches and generates
more batches until `data.train_batch_size` groups are kept. Here the producer already generates until enough groups
wait, so the filter sits at the queue's door: after a generation batch is scored, a group whose
`algorithm.filter_groups.metric` is the same for all `rollout.n` responses (population std 0, verl's test:
`dynamic_sampling.kept_groups`) is not queued but counted as dropped (`async/dropped_groups_total/filtered`); the
producer then generates more, exactly as when stale groups are dropped. Kept groups beyond the step's need wait in
the queue for a later step instead of being thrown away (verl drops the surplus; here it is not wasted unless it
grows stale).

`algorithm.filter_groups.max_num_gen_batches` (> 0) bounds the generation batches of one wait: `collect` raises
`FilterGroupsError` (the step is put back and the last step saved, as in the synchronous loop) when it has generated
that many batches while the trainer waited and still lacks groups; the generation ahead of the trainer stops after that
many batches and leaves the rest to the next step (never an error: the trainer is not waiting on it).

Metrics per training step (over the generation batches scored since the last step, ahead ones included; verl's name
first): `train/num_gen_batches`, `train/num_kept_groups`, `train/num_dropped_groups`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from jaxrl_post.errors import FilterGroupsError
from jaxrl_post.rl.dynamic_sampling import filter_metric_values, kept_groups

FILTERED = "filtered"  # the drop reason of `GroupQueue.drop`: async/dropped_groups_total/filtered


class AsyncGroupFilter:
    """The filter and its per-step counters.

    Args:
      metric: `algorithm.filter_groups.metric` (see `dynamic_sampling.filter_metric_values`).
      max_num_gen_batches: `algorithm.filter_groups.max_num_gen_batches` (<= 0: no limit).
      n: `rollout.n`, responses per group.
    """

    def __init__(self, metric: str, max_num_gen_batches: int, n: int):
        self.metric, self.max_num_gen_batches, self.n = str(metric), int(max_num_gen_batches), int(n)
        self.reset()

    def reset(self) -> None:
        """Zero the step's counters (after they were reported, or when a failed step is put back)."""
        self.num_gen_batches = self.num_kept = self.num_dropped = 0

    def keep(self, b: dict[str, np.ndarray], nt: dict[str, np.ndarray], res: Any) -> list[bool]:
        """Which groups of one scored generation batch are queued: `b` its host arrays (rows `g * n + j`,
        `token_level_scores [B, R]`), `nt` its non-tensor batch (`uid [B]`), `res` its `RewardOutput`
        (`function_scores`, `extra_infos`). Returns one flag per group (`B / n`), in row order. Raises ValueError
        for a metric the rewards do not report (`filter_metric_values`)."""
        values = filter_metric_values(
            self.metric,
            function_scores=res.function_scores,
            token_level_scores=b["token_level_scores"],
            extra_infos=res.extra_infos,
        )
        uids = np.asarray(nt["uid"])
        _, kept, _ = kept_groups(uids, values)
        kept = set(kept)
        flags = [uids[s] in kept for s in range(0, len(uids), self.n)]
        self.num_gen_batches += 1
        self.num_kept += sum(flags)
        self.num_dropped += len(flags) - sum(flags)
        return flags

    def may_generate(self, batches: int) -> bool:
        """Whether one more generation batch may run after `batches` in the current wait (`max_num_gen_batches`)."""
        return self.max_num_gen_batches <= 0 or batches < self.max_num_gen_batches

    def give_up(self, step: int, batches: int, have: int, need: int) -> FilterGroupsError:
        """The error of `collect` at the limit: `batches` generated while waiting gave `have` of `need` groups."""
        return FilterGroupsError(
            f"dynamic sampling (algorithm.filter_groups, metric {self.metric!r}) in asynchronous training, step "
            f"{step}: {batches} generation batches while the trainer waited left {have} of the "
            f"data.train_batch_size={need} groups needed ({self.num_dropped} groups this step had the same metric "
            f"for all rollout.n={self.n} responses); limit algorithm.filter_groups.max_num_gen_batches="
            f"{self.max_num_gen_batches}. The prompts may be too easy or too hard for the model: raise the limit "
            "(<= 0 = no limit) or change the data"
        )

    def metrics(self) -> dict[str, float]:
        """`train/num_gen_batches`, `train/num_kept_groups`, `train/num_dropped_groups` since the last `reset`."""
        return {
            "train/num_gen_batches": float(self.num_gen_batches),
            "train/num_kept_groups": float(self.num_kept),
            "train/num_dropped_groups": float(self.num_dropped),
        }
