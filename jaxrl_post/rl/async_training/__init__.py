"""Asynchronous RL (issue 57): a bounded, version-tagged queue of scored groups between the rollout (producer) and
the trainer (consumer), the staleness rule, partial rollout, and the schedule of the three modes (docs/async.md).

  settings.py   `AsyncSettings` from `async_training.*` / `rollout.n_gpus_per_node` (verl's fully-async names)
  queue.py      `ScoredGroup`, `GroupQueue` (bounded, FIFO, JSON-able state for checkpoints)
  host_arrays.py  `ArrayPacker`: the state's numeric arrays as one flat buffer per dtype (checkpoint item async.arrays)
  staleness.py  the staleness rule and the `async/staleness/*` metrics
  partial.py    `PartialGeneration`: a paged generation stopped at a weight update and resumed under new weights
  producer.py   `AsyncRollout`: the producer/consumer schedule driving today's rollout + reward code
  placement.py  split placement: disjoint rollout / training meshes, weight publication with its bytes
"""

from jaxrl_post.rl.async_training.queue import GroupQueue, ScoredGroup
from jaxrl_post.rl.async_training.settings import AsyncSettings, async_mode
from jaxrl_post.rl.async_training.staleness import is_fresh, staleness_metrics

__all__ = ["AsyncSettings", "GroupQueue", "ScoredGroup", "async_mode", "is_fresh", "staleness_metrics"]
