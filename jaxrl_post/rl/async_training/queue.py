"""`GroupQueue`: the bounded FIFO of scored groups between the rollout (producer) and the trainer (consumer).

A group is one prompt's `rollout.n` scored responses (the unit GRPO's advantages need), tagged with the policy
version that sampled its oldest token. The queue is pure Python and deterministic; `state_dict` is JSON-able (with an
`ArrayPacker` the numeric arrays go to the checkpoint's array item and the JSON keeps references; without one, as
flat lists: float32 -> Python float -> float32 is exact), so a checkpoint holds it and a resumed run continues with
the very same groups (Tunix keeps a data queue for its async rollout; verl's fully-async
`MessageQueue` is bounded the same way).
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

import numpy as np

from jaxrl_post.rl.async_training.host_arrays import ArrayPacker, decode_array, encode_array


@dataclasses.dataclass
class ScoredGroup:
    """One prompt's scored responses.

    Fields:
      group_id: running number of the group over the run (generation order).
      version: the policy version (completed training steps of the weights) that sampled its oldest token.
      batch: host arrays `[n, ...]` (`responses [n, R] int32`, `rollout_log_probs [n, R] float32`,
        `token_level_scores [n, R] float32`, `rollout_versions [n, R] int32`, ...).
      non_tensor: `[n]` object arrays (`uid`, `data_source`, ...).
      metrics: the reward metrics of the generation batch it came from.
    """

    group_id: int
    version: int
    batch: dict[str, np.ndarray]
    non_tensor: dict[str, np.ndarray]
    metrics: dict[str, float]

    def to_json(self, packer: ArrayPacker | None = None) -> dict[str, Any]:
        """JSON-able; with `packer` the numeric arrays go into its buffers (host_arrays.py), else as lists."""
        return {
            "group_id": int(self.group_id),
            "version": int(self.version),
            "batch": {k: encode_array(v, packer) for k, v in self.batch.items()},
            "non_tensor": {k: encode_array(v, packer) for k, v in self.non_tensor.items()},
            "metrics": {k: float(v) for k, v in self.metrics.items()},
        }

    @classmethod
    def from_json(cls, d: dict[str, Any], arrays: dict[str, np.ndarray] | None = None) -> ScoredGroup:
        """Inverse of `to_json` (`arrays`: the packer's buffers, when it had one)."""
        batch = {k: decode_array(v, arrays) for k, v in d["batch"].items()}
        version = int(d["version"])
        if "rollout_versions" in batch:  # recomputed: a checkpoint from before `group_version` holds -1 for some
            version = group_version(batch["rollout_versions"], version)
        return cls(
            group_id=int(d["group_id"]),
            version=version,
            batch=batch,
            non_tensor={k: decode_array(v, arrays) for k, v in d["non_tensor"].items()},
            metrics=dict(d["metrics"]),
        )


def split_groups(
    b: dict[str, np.ndarray],
    nt: dict[str, np.ndarray],
    n: int,
    versions: np.ndarray,
    first_id: int,
    metrics: dict[str, float],
    current: int,
) -> list[ScoredGroup]:
    """A scored generation batch (rows `i * n + j`, `[B, ...]` arrays) as its `B / n` groups; `versions [B, R]` the
    per-token versions, -1 where no token was generated (`PartialGeneration.versions`); `current` the version the
    rollout samples with now. A group's version is `group_version` of its rows."""
    rows = len(versions)
    out = []
    for g, s in enumerate(range(0, rows, n)):
        sl = slice(s, s + n)
        batch = {k: np.asarray(v)[sl] for k, v in b.items()}
        batch["rollout_versions"] = np.asarray(versions[sl], np.int32)
        non_tensor = {k: np.asarray(v)[sl] for k, v in nt.items()}
        version = group_version(versions[sl], current)
        out.append(ScoredGroup(first_id + g, version, batch, non_tensor, dict(metrics)))
    return out


def group_version(versions: np.ndarray, current: int) -> int:
    """The version of a group's oldest token: the minimum of `versions [n, R] int32` over the tokens that exist
    (>= 0; -1 marks the positions past a response's end, which no policy sampled), `current` when none exists.
    Taking -1 as a version made every partial-rollout group with a response shorter than R look `step + 1` steps
    old: dropped as stale from step `staleness_threshold` on, and the producer generated forever."""
    v = np.asarray(versions)
    have = v[v >= 0]
    return int(have.min()) if have.size else int(current)


def merge_groups(groups: list[ScoredGroup]) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], dict[str, float]]:
    """The training batch of `groups` in order: `(b, nt, reward_metrics)` (metrics: the mean over the groups of
    their generation batch's metrics)."""
    b = {k: np.concatenate([g.batch[k] for g in groups]) for k in groups[0].batch}
    nt = {k: np.concatenate([g.non_tensor[k] for g in groups]) for k in groups[0].non_tensor}
    names = sorted({k for g in groups for k in g.metrics})
    metrics = {k: float(np.mean([g.metrics[k] for g in groups if k in g.metrics])) for k in names}
    return b, nt, metrics


class GroupQueue:
    """Bounded FIFO of `ScoredGroup`s with counters of what was produced, trained and dropped (and why).

    Args:
      capacity: groups the queue holds at most; `put` past it raises OverflowError (the producer waits instead).
    """

    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"GroupQueue: capacity must be >= 1, got {capacity}")
        self.capacity = int(capacity)
        self._items: collections.deque[ScoredGroup] = collections.deque()
        self.produced = 0
        self.trained: list[int] = []  # group ids in the order they were trained
        self.dropped: dict[str, list[int]] = {}  # reason -> group ids

    def __len__(self) -> int:
        return len(self._items)

    @property
    def full(self) -> bool:
        return len(self._items) >= self.capacity

    def put(self, group: ScoredGroup) -> None:
        """Append `group`. Raises OverflowError when the queue is full."""
        if self.full:
            raise OverflowError(f"GroupQueue: full ({self.capacity} groups)")
        self._items.append(group)
        self.produced += 1

    def get(self) -> ScoredGroup:
        """The oldest group. Raises IndexError when empty."""
        return self._items.popleft()

    def peek_versions(self) -> list[int]:
        return [g.version for g in self._items]

    def mark_trained(self, groups: list[ScoredGroup]) -> None:
        self.trained.extend(g.group_id for g in groups)

    def drop(self, group: ScoredGroup, reason: str) -> None:
        """Count `group` as dropped for `reason` (e.g. 'stale')."""
        self.dropped.setdefault(reason, []).append(group.group_id)

    def counts(self) -> dict[str, float]:
        """`async/queue_size`, `async/produced_groups_total`, `async/trained_groups_total`,
        `async/dropped_groups_total/<reason>`."""
        out = {
            "async/queue_size": float(len(self._items)),
            "async/produced_groups_total": float(self.produced),
            "async/trained_groups_total": float(len(self.trained)),
        }
        out.update({f"async/dropped_groups_total/{r}": float(len(ids)) for r, ids in sorted(self.dropped.items())})
        return out

    def snapshot(self) -> tuple:
        """The queue's contents and counters now, for `restore` (groups are not changed in place: a list copy)."""
        return list(self._items), self.produced, len(self.trained), {k: len(v) for k, v in self.dropped.items()}

    def restore(self, snap: tuple) -> None:
        """Put back the state of `snapshot()` (the groups produced, trained and dropped since are forgotten)."""
        items, produced, n_trained, dropped = snap
        self._items = collections.deque(items)
        self.produced, self.trained = produced, self.trained[:n_trained]
        self.dropped = {k: v[: dropped[k]] for k, v in self.dropped.items() if k in dropped}

    def state_dict(self, packer: ArrayPacker | None = None) -> dict[str, Any]:
        """JSON-able state: the queued groups and the counters (with `packer`: the groups' numeric arrays in its
        buffers, see `ScoredGroup.to_json`)."""
        return {
            "capacity": self.capacity,
            "items": [g.to_json(packer) for g in self._items],
            "produced": self.produced,
            "trained": list(self.trained),
            "dropped": {k: list(v) for k, v in self.dropped.items()},
        }

    def load_state_dict(self, d: dict[str, Any], arrays: dict[str, np.ndarray] | None = None) -> None:
        """Inverse of `state_dict` (`arrays`: the packer's buffers, when it had one)."""
        self.capacity = int(d["capacity"])
        self._items = collections.deque(ScoredGroup.from_json(g, arrays) for g in d["items"])
        self.produced = int(d["produced"])
        self.trained = [int(i) for i in d["trained"]]
        self.dropped = {k: [int(i) for i in v] for k, v in d["dropped"].items()}
