"""`AsyncSettings`: the asynchronous-training keys of a job config, typed once (async_training.config_checks.check_async
validates them first).

Keys (verl's fully-async recipe names, plus `async_training.mode`, ours: verl ships one-step-off and fully async as
two recipes):
  async_training.mode: 'sync' (today's loop), 'one_step_off' (the rollout of step t+1 runs under the weights of step
    t while step t trains: staleness 1) or 'fully_async'.
  async_training.staleness_threshold: a group sampled under policy version v trains at step t only if
    t - v <= threshold (verl counts a fraction of stale samples; here it is the version gap, AReaL's
    `max_staleness`).
  async_training.trigger_parameter_sync_step: training steps between weight publications to the rollout.
  async_training.require_batches: generation batches per training step (each of
    `data.train_batch_size / require_batches` prompts; one version tag each).
  async_training.partial_rollout: generation in flight at a weight update stops there and resumes under the new
    weights (paged engine only).
  async_training.partial_rollout_dispatches: ours; the engine dispatches the generation in flight runs before the
    weight update stops it (the deterministic stand-in for the generation that overlaps a training step).
  async_training.background_producer: ours; on the split placement, the generation the schedule runs ahead of the
    trainer runs on a background thread while the update runs (background.py); False: the two take turns (the
    reference the threaded run equals bit for bit). Colocated runs never start the thread.
  rollout.n_gpus_per_node, rollout.nnodes: devices given to the rollout (0 = colocated with training).
"""

from __future__ import annotations

import dataclasses
from typing import Any

MODES = ("sync", "one_step_off", "fully_async")


def async_mode(cfg: Any) -> str:
    """`async_training.mode` of `cfg` ('sync' when the section is absent)."""
    sec = cfg.get("async_training") if hasattr(cfg, "get") else None
    return "sync" if sec is None else str(sec.get("mode", "sync"))


@dataclasses.dataclass(frozen=True)
class AsyncSettings:
    """The schedule of one run (see the module docstring for the keys).

    Fields: mode; staleness_threshold (version gap allowed); trigger_parameter_sync_step (k); require_batches (r);
    partial_rollout; partial_rollout_dispatches; train_batch_size (prompts = groups per step); n (group size);
    background_producer (split placement: the ahead generation on a thread, background.py); filter_metric
    (`algorithm.filter_groups.metric` when DAPO's filter is on, else None) and max_num_gen_batches (filtering.py).
    """

    mode: str
    staleness_threshold: int
    trigger_parameter_sync_step: int
    require_batches: int
    partial_rollout: bool
    partial_rollout_dispatches: int
    train_batch_size: int
    n: int
    background_producer: bool = True
    filter_metric: str | None = None
    max_num_gen_batches: int = 0

    @classmethod
    def from_config(cls, cfg: Any) -> AsyncSettings:
        a = cfg.async_training
        mode = async_mode(cfg)
        fg = cfg.get("algorithm", {}).get("filter_groups")
        one_step = mode == "one_step_off"  # its own recipe: staleness 1, weights after every step, no partial
        return cls(
            mode=mode,
            staleness_threshold=1 if one_step else int(a.staleness_threshold),
            trigger_parameter_sync_step=1 if one_step else int(a.trigger_parameter_sync_step),
            require_batches=1 if one_step else int(a.require_batches),
            partial_rollout=False if one_step else bool(a.partial_rollout),
            partial_rollout_dispatches=int(a.partial_rollout_dispatches),
            train_batch_size=int(cfg.data.train_batch_size),
            n=int(cfg.rollout.n),
            background_producer=bool(a.get("background_producer", True)),
            filter_metric=str(fg.metric) if fg is not None and fg.get("enable") is True else None,
            max_num_gen_batches=0 if fg is None else int(fg.get("max_num_gen_batches", 0)),
        )

    @property
    def chunk_prompts(self) -> int:
        """Prompts per generation batch."""
        return self.train_batch_size // self.require_batches

    @property
    def ahead_chunks(self) -> int:
        """Generation batches produced beyond the step's own before it trains: the most whose groups stay within
        the staleness bound when consumed (`s - (k - 1)` batches-of-a-step, one fewer with a partial generation in
        flight), in generation batches."""
        steps = self.staleness_threshold - (self.trigger_parameter_sync_step - 1) - int(self.partial_rollout)
        return max(0, steps) * self.require_batches

    def publishes_after(self, step: int) -> bool:
        """Whether the weights are published to the rollout once `step` training steps are done."""
        return step % self.trigger_parameter_sync_step == 0
