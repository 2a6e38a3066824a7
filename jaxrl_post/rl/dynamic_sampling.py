"""DAPO dynamic sampling (`algorithm.filter_groups`): keep only groups whose responses differ, and generate
more prompt batches until a full training batch of such groups is collected.

Semantics are verl's (`RayDAPOTrainer.fit`, recipe/dapo/dapo_ray_trainer.py; DAPO paper, arXiv 2503.14476,
section 3.2 "Dynamic Sampling"):

- after scoring, a group (the `rollout.n` responses of one prompt, sharing a `uid`) is kept when the
  population std of its `metric` values is > 0 (verl: `np.std(values) > 0`; groups of one response are
  kept, but `rollout.n == 1` is refused by the config check);
- kept rows of successive generation batches are concatenated in order until at least
  `data.train_batch_size` groups are kept; the surplus is dropped (verl: `batch[:train_batch_size * n]`,
  the first groups in generation order);
- when a generation batch leaves fewer kept groups than needed and `max_num_gen_batches > 0` batches
  have been generated in this step, `FilterGroupsError` is raised (verl raises ValueError).

`GroupCollector` holds that state for one training step (plain numpy, no jax); `filter_metric_values`
resolves the metric name on one scored generation batch. `FilteredRollout` wraps any rollout (the trainer's
`roles.RolloutRole`) with the loop over generation batches.

Only the training step is filtered; validation never is. Every generation batch has the shape of a
training batch (`data.train_batch_size` prompts x `rollout.n`), and the update gets exactly
`data.train_batch_size x rollout.n` rows, so no jitted function sees a new shape. Extra generation
batches are read from the training data loader, so its saved position (checkpoints) is after them.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from jaxrl_post.errors import Checker, FilterGroupsError, is_int
from jaxrl_post.rewards.manager import RewardFunctionError
from jaxrl_post.runtime.distributed import gather_rows

__all__ = [
    "FilterGroupsError",
    "GroupCollector",
    "FilteredRollout",
    "check_filter_groups",
    "filter_metric_values",
    "kept_groups",
    "merge_reward_metrics",
]


# filter_groups metrics every reward function has (the rest are extra keys of a reward function's dict results)
FILTER_METRICS = ("acc", "score", "seq_reward", "seq_final_reward")


def check_filter_groups(c: Checker) -> None:
    """Config check of `algorithm.filter_groups.*` (a section of `rl/config_check.py`'s table): `enable` a bool,
    `max_num_gen_batches` an int; when enabled, `rollout.n >= 2` and a `metric` the rewards produce (the
    built-in ones: `FILTER_METRICS`, plus the overlong buffer's when it logs), not `seq_final_reward` with KL in
    the reward."""
    cfg = c.cfg
    fg, ob = cfg.algorithm.filter_groups, cfg.reward_model.overlong_buffer
    c.check("algorithm.filter_groups.enable", lambda v: isinstance(v, bool), "must be a bool")
    c.check("algorithm.filter_groups.max_num_gen_batches", is_int, "must be an int (<= 0 = no limit)")
    if fg.enable is not True:
        return
    if is_int(cfg.rollout.n) and cfg.rollout.n < 2:
        c.err("rollout.n", "algorithm.filter_groups compares the responses of a group: needs rollout.n >= 2")
    metric = fg.metric
    known = FILTER_METRICS + (("overlong_reward", "overlong") if ob.enable is True and ob.log is True else ())
    if not isinstance(metric, str) or not metric:
        c.err("algorithm.filter_groups.metric", f"must name a per-response value, e.g. one of {list(known)}")
    elif not cfg.custom_reward_function.path and metric not in known:
        # the built-in reward functions return plain scores: no other names exist
        c.err("algorithm.filter_groups.metric", f"unknown metric; valid with the built-in rewards: {list(known)}")
    elif metric == "seq_final_reward" and cfg.algorithm.use_kl_in_reward:
        c.err(
            "algorithm.filter_groups.metric",
            "seq_final_reward with algorithm.use_kl_in_reward is not supported (the KL penalty is computed after "
            "filtering); use seq_reward",
        )


@contextlib.contextmanager
def timer(name: str, timing: dict[str, float]):
    """Add the wall time of the block to `timing[name]` (summed over repeated blocks)."""
    t0 = time.perf_counter()
    yield
    timing[name] = timing.get(name, 0.0) + time.perf_counter() - t0


def filter_metric_values(
    metric: str,
    *,
    function_scores: np.ndarray,
    token_level_scores: np.ndarray,
    extra_infos: Mapping[str, np.ndarray],
) -> np.ndarray:
    """Per-response values of `algorithm.filter_groups.metric` for one scored generation batch.

    Args:
      metric: 'acc' (the reward function's `acc` extra key when it reports one, else its own score before
        the overlong penalty: verl's DAPO reward manager records `acc` = score for plain-number results),
        'score' (that score), 'seq_reward' (the sum of `token_level_scores`, i.e. after the overlong
        penalty), 'seq_final_reward' (the same: the KL-in-reward penalty is applied after filtering, so the
        config check refuses it with `algorithm.use_kl_in_reward`), or any extra key of the reward
        function's dict results (e.g. 'overlong_reward' with `reward_model.overlong_buffer.log`).
      function_scores: `[B]` float, the reward function's scores (`RewardOutput.function_scores`).
      token_level_scores: `[B, R]` float, scores on the response tokens (penalty included).
      extra_infos: `RewardOutput.extra_infos`, each `[B]`.

    Returns:
      `[B]` array (float64 for numbers; object arrays of other values are returned as they are).

    Raises:
      ValueError: `metric` names no value of this batch (the message names the config key and lists the
        available names).
    """
    if metric == "acc" and "acc" not in extra_infos:
        return np.asarray(function_scores, np.float64)
    if metric == "score":
        return np.asarray(function_scores, np.float64)
    if metric in ("seq_reward", "seq_final_reward"):
        return np.asarray(token_level_scores, np.float64).sum(-1)
    if metric in extra_infos:
        v = np.asarray(extra_infos[metric])
        return v.astype(np.float64) if v.dtype.kind in "biuf" else v
    available = sorted({"acc", "score", "seq_reward", "seq_final_reward", *extra_infos})
    raise ValueError(
        f"config.algorithm.filter_groups.metric={metric!r}: the reward function reports no such value; "
        f"available: {available}"
    )


def _varies(values: np.ndarray) -> bool:
    if values.dtype.kind == "f":
        return bool(np.std(values) > 0)  # verl's test (a group with a NaN has std NaN: dropped)
    return len({repr(v) for v in values.tolist()}) > 1


def kept_groups(uids: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, list[Any], list[Any]]:
    """Which groups of one generation batch survive the filter.

    Args:
      uids: `[B]` group ids (verl's `uid`; any hashable values, rows of a group need not be adjacent).
      values: `[B]` metric values (`filter_metric_values`).

    Returns:
      `(keep [B] bool, kept uids, dropped uids)`: rows of groups whose values vary (std > 0) or that hold a
      single response; the uid lists are in order of first appearance.
    """
    uids = np.asarray(uids)
    values = np.asarray(values)
    if uids.shape != values.shape or uids.ndim != 1:
        raise ValueError(f"uids {uids.shape} and values {values.shape} must both be [B]")
    order: dict[Any, list[int]] = {}
    for i, u in enumerate(uids.tolist()):
        order.setdefault(u, []).append(i)
    kept = [u for u, rows in order.items() if len(rows) == 1 or _varies(values[rows])]
    kept_set = set(kept)
    dropped = [u for u in order if u not in kept_set]
    keep = np.asarray([u in kept_set for u in uids.tolist()], bool).reshape(uids.shape)
    return keep, kept, dropped


class GroupCollector:
    """Collects the kept groups of one training step's generation batches (verl's `filter_groups` loop).

    Args:
      train_batch_size: groups (prompts) the update needs, `data.train_batch_size`.
      n: responses per group, `rollout.n`.
      max_num_gen_batches: stop with `FilterGroupsError` after this many generation batches; <= 0 = no limit.
      metric: the metric's name (for messages only).

    Use: `done = c.add(rows, uids, values)` for each scored generation batch until it returns True, then
    `c.batch()` (exactly `train_batch_size * n` rows) and `c.metrics()`.
    """

    def __init__(self, train_batch_size: int, n: int, max_num_gen_batches: int, metric: str = "acc"):
        self.train_batch_size, self.n = int(train_batch_size), int(n)
        self.max_num_gen_batches = int(max_num_gen_batches)
        self.metric = metric
        self.num_gen_batches = 0
        self.num_kept = self.num_dropped = 0
        self._parts: list[dict[str, np.ndarray]] = []  # kept rows of each generation batch
        self._part_uids: list[np.ndarray] = []  # their uids
        self._uids: list[Any] = []  # kept uids, in order

    @property
    def done(self) -> bool:
        return self.num_kept >= self.train_batch_size

    def add(self, rows: Mapping[str, np.ndarray], uids: np.ndarray, values: np.ndarray) -> bool:
        """Filter one generation batch and keep its surviving rows; True once enough groups are kept.

        Args:
          rows: per-row arrays of the batch (`[B, ...]` each, numpy or object arrays).
          uids: `[B]` group ids; values: `[B]` metric values.

        Raises:
          FilterGroupsError: still too few groups after `max_num_gen_batches` (> 0) generation batches.
          ValueError: a kept group does not have exactly `n` rows, or the arrays disagree on B.
        """
        if self.done:
            raise RuntimeError("GroupCollector.add after enough groups were collected")
        keep, kept, dropped = kept_groups(uids, values)
        for k, v in rows.items():
            if len(v) != len(keep):
                raise ValueError(f"rows[{k!r}] has {len(v)} rows, uids has {len(keep)}")
        if int(keep.sum()) != len(kept) * self.n:
            raise ValueError(f"every group must have rollout.n = {self.n} responses; got {len(keep)} rows")
        self.num_gen_batches += 1
        self.num_kept += len(kept)
        self.num_dropped += len(dropped)
        self._parts.append({k: np.asarray(v)[keep] for k, v in rows.items()})
        self._part_uids.append(np.asarray(uids)[keep])
        self._uids += kept
        if self.done:
            return True
        if 0 < self.max_num_gen_batches <= self.num_gen_batches:
            raise FilterGroupsError(
                f"dynamic sampling (algorithm.filter_groups, metric {self.metric!r}): "
                f"{self.num_gen_batches} generation batches gave {self.num_kept} of the "
                f"data.train_batch_size={self.train_batch_size} groups needed ({self.num_dropped} groups had "
                f"the same metric for all rollout.n={self.n} responses); limit algorithm.filter_groups."
                f"max_num_gen_batches={self.max_num_gen_batches}. The prompts may be too easy or too hard for "
                "the model: raise the limit (<= 0 = no limit) or change the data"
            )
        return False

    def batch(self) -> dict[str, np.ndarray]:
        """The first `train_batch_size` kept groups, `[train_batch_size * n, ...]` per key (generation order)."""
        if not self.done:
            raise RuntimeError(f"only {self.num_kept} of {self.train_batch_size} groups collected")
        take = set(self._uids[: self.train_batch_size])
        sel = np.asarray([u in take for u in np.concatenate(self._part_uids).tolist()], bool)
        out = {k: np.concatenate([p[k] for p in self._parts], axis=0)[sel] for k in self._parts[0]}
        assert int(sel.sum()) == self.train_batch_size * self.n
        return out

    def metrics(self) -> dict[str, float]:
        """`train/num_gen_batches` (verl), `train/num_kept_groups` and `train/num_dropped_groups` (over every
        generation batch of the step, before the surplus is dropped)."""
        return {
            "train/num_gen_batches": float(self.num_gen_batches),
            "train/num_kept_groups": float(self.num_kept),
            "train/num_dropped_groups": float(self.num_dropped),
        }


def merge_reward_metrics(outputs: list[Any]) -> dict[str, float]:
    """Reward-manager metrics over every response scored in a step (all generation batches): the
    `reward/num_errors` and `reward/num_timeouts` counts summed, `reward/extra/<key>/mean` over all rows."""
    if len(outputs) == 1:
        return dict(outputs[0].metrics)
    out = {k: float(sum(o.metrics.get(k, 0.0) for o in outputs)) for k in ("reward/num_errors", "reward/num_timeouts")}
    keys = {k for o in outputs for k, v in o.extra_infos.items() if np.asarray(v).dtype.kind == "f"}
    for k in sorted(keys):
        vals = [np.asarray(o.extra_infos[k], np.float64) for o in outputs if k in o.extra_infos]
        vals = np.concatenate(vals)
        if np.isfinite(vals).any():
            out[f"reward/extra/{k}/mean"] = float(np.nanmean(vals))
    return out


def score_everywhere(reward_fn, data, local: bool):
    """`reward_fn.compute(data)`; with process-local rows a failure on any process is raised on every process
    (the others would otherwise wait in the next gather forever). A process-local `data` of no rows (a
    validation batch whose real rows all sit on other processes) is not scored: None, after the check.
    Raises RewardFunctionError."""

    if not local:
        return reward_fn.compute(data)

    err = res = None
    try:
        if data is None or len(data):
            res = reward_fn.compute(data)
    except RewardFunctionError as e:
        err = e
    failed = gather_rows(np.asarray([err is not None]))
    if err is not None:
        raise err
    if failed.any():
        raise RewardFunctionError(
            f"the reward function failed on process {int(np.argmax(failed))} (its message is in that process's log)"
        )
    return res


class FilteredRollout:
    """DAPO's dynamic sampling around any rollout (`algorithm.filter_groups.enable`): `collect` generates and
    scores prompt batches with `inner.generate_and_score` until `data.train_batch_size` groups with a varying
    `algorithm.filter_groups.metric` are kept. Every other attribute (`sync`, `sampling_params`, `engine`,
    `generator`, ...) is the inner rollout's.

    Args:
      cfg: the job ConfigDict (`algorithm.filter_groups`, `data.train_batch_size`, `rollout.n`).
      inner: the rollout to filter (`roles.RolloutRole` or anything with its `generate_and_score`).
    """

    def __init__(self, cfg, inner):
        self.config, self.inner = cfg, inner

    def __getattr__(self, name):
        return getattr(self.__dict__["inner"], name)

    def collect(self, prompts, seed: int, timing: dict[str, float], reward_fn, rng, next_prompts: Callable[[], Any]):
        """verl's dynamic-sampling loop for one training step: generate + score `prompts`, then further
        prompt batches from `next_prompts()` (each seeded from `rng`, which is split once per extra batch),
        until `data.train_batch_size` groups with a varying `algorithm.filter_groups.metric` are kept.

        Returns `(b, nt, metrics, last_prompts, rng)`: the training batch (exactly train_batch_size x n rows),
        its non-tensor batch, the reward metrics over all scored responses plus `train/num_gen_batches`,
        `train/num_kept_groups`, `train/num_dropped_groups`, the last prompt batch read, and the advanced key.

        Raises:
          FilterGroupsError: `max_num_gen_batches` reached. ValueError: unknown metric.
          RewardFunctionError: see `RewardManager.compute`.
        """
        import jax

        cfg = self.config
        fg = cfg.algorithm.filter_groups
        collector = GroupCollector(
            int(cfg.data.train_batch_size), int(cfg.rollout.n), int(fg.max_num_gen_batches), fg.metric
        )
        outputs = []
        while True:
            b, nt, res = self.inner.generate_and_score(prompts, seed, timing, reward_fn)
            outputs.append(res)
            values = filter_metric_values(
                fg.metric,
                function_scores=res.function_scores,
                token_level_scores=b["token_level_scores"],
                extra_infos=res.extra_infos,
            )
            rows = dict(b, **{f"nt/{k}": np.asarray(v) for k, v in nt.items()})
            if collector.add(rows, np.asarray(nt["uid"]), values):
                break
            prompts = next_prompts()
            rng, key = jax.random.split(rng)
            seed = int(jax.random.randint(key, (), 0, 2**31 - 1))
        rows = collector.batch()
        b = {k: v for k, v in rows.items() if not k.startswith("nt/")}
        nt = {k[3:]: v for k, v in rows.items() if k.startswith("nt/")}
        metrics = merge_reward_metrics(outputs)
        metrics.update(collector.metrics())
        return b, nt, metrics, prompts, rng
