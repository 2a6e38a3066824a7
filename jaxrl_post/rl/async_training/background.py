"""`BackgroundProducer`: the one worker thread that runs a step's ahead generation on the split placement's rollout
mesh while the trainer's update runs on the training mesh (docs/async.md, "What overlaps").

The schedule (producer.py) already fixes what each generation batch is, which weights sample it and where its
groups go in the queue; the thread only changes when that work runs. `AsyncRollout.collect` starts it after the
step's batch is taken, `AsyncRollout.finish_step` joins it before the weights are published (`RLTrainer.sync_weights`)
and before anything else reads the producer (validation, checkpoints, the next step's snapshot and collect). Only one
job runs at a time, and the main thread never touches the rollout, the queue, the reward function or the data loader
while it runs: the trainer reads only the training mesh's params (the rollout samples with its own copy), so the
thread never sees a buffer the update donates.

An exception in the thread is re-raised on the main thread by `join`, the same object with its message unchanged and a
note naming its origin (`BaseException.add_note`).
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

ORIGIN_NOTE = "raised in the asynchronous producer's background thread (async_training/background.py), step {step}"


class BackgroundProducer:
    """One worker thread (`concurrent.futures.ThreadPoolExecutor(max_workers=1)`), one job at a time.

    Attributes: `events`, the last 64 `(what, step, start, end)` intervals (`time.perf_counter()` seconds): what =
    'produce' (the thread's job) or 'train' (the main thread's work between `start` and `join`, recorded by `join`).
    `thread_name`: the worker thread's name prefix.
    """

    thread_name = "async-producer"

    def __init__(self):
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=self.thread_name)
        self._future: concurrent.futures.Future | None = None
        self._step = -1
        self._started = 0.0
        self.events: collections.deque[tuple[str, int, float, float]] = collections.deque(maxlen=64)

    @property
    def busy(self) -> bool:
        """Whether a job was started and not joined yet."""
        return self._future is not None

    def start(self, fn: Callable[[], Any], step: int) -> None:
        """Run `fn()` on the worker thread (training step `step`). Raises RuntimeError when a job is still
        unjoined (the schedule has one job per step)."""
        if self._future is not None:
            raise RuntimeError(f"step {step}: the background producer's job of step {self._step} was never joined")

        def job():
            t0 = time.perf_counter()
            try:
                return fn()
            finally:
                self.events.append(("produce", step, t0, time.perf_counter()))

        self._step, self._started = step, time.perf_counter()
        self._future = self._pool.submit(job)

    def join(self) -> tuple[Any, float]:
        """Wait for the job; returns `(fn's result, seconds waited)` (`(None, 0.0)` when none runs). An exception
        raised by `fn` is re-raised here, with a note naming the thread and the step."""
        if self._future is None:
            return None, 0.0
        fut, self._future = self._future, None
        t0 = time.perf_counter()
        self.events.append(("train", self._step, self._started, t0))
        try:
            out = fut.result()
        except BaseException as e:
            e.add_note(ORIGIN_NOTE.format(step=self._step))
            raise
        return out, time.perf_counter() - t0

    def settle(self) -> None:
        """Join after the step already failed on the main thread: wait for the job; its own error (if any) is logged,
        not raised, so the step's error is the one that propagates."""
        if self._future is None:
            return
        try:
            self.join()
        except Exception:
            log.exception("the background producer also failed (the step had already failed on the main thread)")

    def close(self) -> None:
        """Wait for a running job (its error logged, `settle`) and stop the thread."""
        self.settle()
        self._pool.shutdown(wait=True)

    @staticmethod
    def in_worker() -> bool:
        """Whether the calling thread is the worker (tests: where a failure was raised)."""
        return threading.current_thread().name.startswith(BackgroundProducer.thread_name)
