"""`AsyncRollout`: the producer/consumer schedule of asynchronous training on today's rollout + reward code.

The producer turns prompt batches into scored groups (`RolloutRole.generate_and_score`, or a `PartialGeneration`
on the paged engine with partial rollout) tagged with the rollout's policy version, into a bounded `GroupQueue`; the
consumer (`collect`, called by `RLTrainer.train_step` at step t) takes `data.train_batch_size` fresh groups in FIFO
order, dropping (and counting) stale ones (staleness.py). The interleaving is deterministic: at step t the producer
generates while the queue is empty, the step's groups are taken, then the producer generates ahead until
`AsyncSettings.ahead_chunks` generation batches' worth wait (what is generated while step t trains, under the
weights then published); with partial rollout one more batch is then started and stopped after
`partial_rollout_dispatches` dispatches: it is in flight across the weight update and resumes under the new weights
at step t + 1. On the split placement the generation ahead runs on a background thread during the update
(background.py) and `finish_step` joins it before the publication; elsewhere it runs inside `collect`.

Modes (`async_training.mode`): 'one_step_off' = one batch ahead, weights published after every step (the batch of
step t + 1 sampled by the weights of step t); 'fully_async' = `staleness_threshold`, `trigger_parameter_sync_step`,
`require_batches`, `partial_rollout`. At staleness 0 (k = 1, r = 1, partial off) the schedule is the synchronous one.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from jaxrl_post.algos.rollout_corr import compute_rollout_probs_diff_metrics
from jaxrl_post.engine.run.run_dir import SAVED_ON_ERROR
from jaxrl_post.engine.train_state import place_like
from jaxrl_post.rl.async_training.background import BackgroundProducer
from jaxrl_post.rl.async_training.filtering import FILTERED, AsyncGroupFilter
from jaxrl_post.rl.async_training.host_arrays import ArrayPacker
from jaxrl_post.rl.async_training.partial import PartialGeneration
from jaxrl_post.rl.async_training.queue import GroupQueue, merge_groups, split_groups
from jaxrl_post.rl.async_training.settings import AsyncSettings
from jaxrl_post.rl.async_training.staleness import STALE, is_fresh, staleness_metrics
from jaxrl_post.rl.dynamic_sampling import timer

_SEED_STRIDE = 104_729  # seeds of the extra generation batches of a step: seed + i * stride (mod 2^31 - 1)


def _seed(base: int, i: int) -> int:
    return int((base + i * _SEED_STRIDE) % (2**31 - 1))


class AsyncRollout:
    """The producer and the queue of an asynchronous run.

    Args:
      settings: the run's `AsyncSettings`.
      rollout: the `RolloutRole` (its model is a separate copy of the actor's weights, published by the trainer
        every `trigger_parameter_sync_step` steps: `publish`). The rest of its interface is reached through this
        object (the trainer holds it as its `rollout`, as `FilteredRollout`).

    Attributes: `queue` (`GroupQueue`), `rollout_version` (training steps of the weights the rollout samples with),
    `in_flight` (a `PartialGeneration` stopped at the last weight update, or None), `pending` (prompt batches and
    their seeds not generated yet), `data_position` (`(get, set)` of the prompt loader's position, set by the trainer:
    a failed background job puts it back), `owed` (the generation ahead of a step whose background job failed, to run
    before the next step: `{"seed", "target", "pulled"}`, or None), `job_error` (that job's error, until the trainer
    has saved the step and re-raised it).
    """

    def __init__(self, settings: AsyncSettings, rollout):
        self.__dict__["rollout"] = rollout  # first: `__getattr__` reads it
        self.settings = s = settings
        capacity = (s.require_batches + s.ahead_chunks + 2) * s.chunk_prompts
        self.queue = GroupQueue(capacity)
        self.rollout_version = 0
        self.in_flight: PartialGeneration | None = None
        self.pending: list[tuple[Any, int]] = []
        self._next_group_id = 0
        self._pulled = 0
        self.data_position: tuple[Any, Any] | None = None
        self.owed: dict[str, int] | None = None
        self.job_error: BaseException | None = None
        self._job_start: tuple | None = None
        split = getattr(rollout, "rollout_mesh", None) is not None  # colocated: nothing to overlap, no thread
        self.background = BackgroundProducer() if split and s.background_producer else None
        self.filter = None if s.filter_metric is None else AsyncGroupFilter(s.filter_metric, s.max_num_gen_batches, s.n)

    def __getattr__(self, name):  # the rest of the rollout's interface (sync, sampling_params, engine, close, ...)
        return getattr(self.__dict__["rollout"], name)

    # ---------------------------------------------------------------- weights
    def publish(self, version: int) -> None:
        """The rollout model now holds the weights of `version` (the trainer copied them)."""
        self.rollout_version = int(version)

    # ---------------------------------------------------------------- producer
    def _add_prompts(self, prompts, seed: int) -> None:
        r = self.settings.require_batches
        chunks = prompts.chunk(r) if r > 1 else [prompts]
        self.pending.extend((c, _seed(seed, i)) for i, c in enumerate(chunks))

    def _push(self, b, nt, versions, res) -> None:
        groups = split_groups(b, nt, self.settings.n, versions, self._next_group_id, res.metrics, self.rollout_version)
        self._next_group_id += len(groups)
        keep = [True] * len(groups) if self.filter is None else self.filter.keep(b, nt, res)
        for g, k in zip(groups, keep, strict=True):
            if k:
                self.queue.put(g)
            else:
                self.queue.drop(g, FILTERED)

    def _score_partial(self, gen: PartialGeneration, timing, reward_fn) -> None:
        b, nt, res = self.rollout.score_generated(gen.prompts, gen.out, timing, reward_fn)
        self._push(b, nt, gen.versions, res)

    def _run_partial(self, gen: PartialGeneration, timing, max_dispatches: int | None) -> None:
        params = self.rollout.sampling_params(validate=False, seed=gen.seed)
        with timer("gen", timing):
            gen.run(self.rollout.generator, params, self.rollout_version, max_dispatches)

    def _next_pending(self, more, seed: int):
        if not self.pending:
            self._pulled += 1
            self._add_prompts(more(), _seed(seed, self._pulled))
        return self.pending.pop(0)

    def produce(self, timing: dict[str, float], reward_fn, more, seed: int) -> None:
        """Generate and score one generation batch into the queue: the batch in flight (resumed under the current
        weights) if any, else the next pending prompts (pulled from `more()` when none wait)."""
        if self.in_flight is not None:
            gen, self.in_flight = self.in_flight, None
            self._run_partial(gen, timing, None)
            self._score_partial(gen, timing, reward_fn)
            return
        prompts, s = self._next_pending(more, seed)
        if self.settings.partial_rollout:
            gen = PartialGeneration(prompts, s, self.settings.n)
            self._run_partial(gen, timing, None)
            self._score_partial(gen, timing, reward_fn)
            return
        b, nt, res = self.rollout.generate_and_score(prompts, s, timing, reward_fn)
        versions = np.full(np.shape(b["responses"]), self.rollout_version, np.int32)
        self._push(b, nt, versions, res)

    def _start_in_flight(self, timing, reward_fn, more, seed: int) -> None:
        """Partial rollout: start the next batch; stopped after `partial_rollout_dispatches` (the weight update)."""
        prompts, s = self._next_pending(more, seed)
        gen = PartialGeneration(prompts, s, self.settings.n)
        self._run_partial(gen, timing, self.settings.partial_rollout_dispatches)
        if gen.done:
            self._score_partial(gen, timing, reward_fn)
        else:
            self.in_flight = gen

    # ---------------------------------------------------------------- consumer
    def collect(self, prompts, seed: int, timing: dict[str, float], reward_fn, rng, next_prompts, *, step: int):
        """The training batch of step `step`: `(b, nt, metrics, prompts, rng)` as `RolloutRole.collect`, with
        `b["rollout_versions"] [B, R] int32` and the `async/*` metrics of the batch (the queue's counts come from
        `finish_step`). `prompts`: the step's prompt batch (queued behind those already pending); `next_prompts()`:
        more prompt batches when the producer runs ahead.

        The step's `data.train_batch_size` fresh groups are taken first (generating while the queue runs dry), then
        the ahead generation (`_produce_ahead`) runs: here, or on the background thread (split placement,
        `async_training.background_producer`) until `finish_step`. Either way the same batches are generated in the
        same order under the same weights as when the queue is filled to the step's own + `ahead_chunks` batches
        before taking: production stops at the same count of groups, and taking the oldest fresh groups first
        does not depend on how many wait behind them."""
        s = self.settings
        self._pulled = 0
        self._add_prompts(prompts, seed)
        need = s.train_batch_size
        if not is_fresh(self.rollout_version, step, s.staleness_threshold):
            raise RuntimeError(
                f"step {step}: the rollout's weights (version {self.rollout_version}) are older than "
                f"async_training.staleness_threshold={s.staleness_threshold} allows: no group could ever train "
                f"(publish every trigger_parameter_sync_step <= staleness_threshold + 1 steps)"
            )
        taken, consumed, made = [], 0, 0
        while len(taken) < need:
            if not len(self.queue):
                if self.filter is not None and not self.filter.may_generate(made):
                    raise self.filter.give_up(step, made, len(taken), need)
                if self.filter is None and made > need // s.chunk_prompts + 2:  # a fresh batch is all fresh groups
                    raise RuntimeError(
                        f"step {step}: {made} generation batches left {len(taken)} of the {need} fresh groups the "
                        f"step needs (queue counts {self.queue.counts()}): newly generated groups were dropped, a bug"
                    )
                self.produce(timing, reward_fn, next_prompts, seed)
                made += 1
                continue
            g = self.queue.get()
            consumed += 1
            if is_fresh(g.version, step, s.staleness_threshold):
                taken.append(g)
            else:
                self.queue.drop(g, STALE)
        self.queue.mark_trained(taken)
        target = need + s.ahead_chunks * s.chunk_prompts - consumed  # the queue's length after a take-turns fill
        ahead = (reward_fn, next_prompts, seed, target)
        if self.background is None:
            self._produce_ahead(timing, *ahead)
        else:  # what the job starts from, put back if it fails (`finish_step`)
            position = None if self.data_position is None else self.data_position[0]()
            self._job_start = (self.snapshot(), position, {"seed": seed, "target": target, "pulled": self._pulled})
            self.background.start(lambda: self._produce_ahead({}, *ahead), step)
        b, nt, metrics = merge_groups(taken)
        metrics.update(staleness_metrics(b["rollout_versions"], b["response_attention_mask"], step))
        return b, nt, metrics, prompts, rng

    def _produce_ahead(self, timing, reward_fn, more, seed: int, target: int) -> dict[str, float]:
        """The generation the schedule runs "while earlier steps trained": batches until `target` groups wait, then
        (partial rollout) the next batch started and stopped after `partial_rollout_dispatches` dispatches. Returns
        `timing`."""
        made = 0
        while len(self.queue) < target and (self.filter is None or self.filter.may_generate(made)):
            self.produce(timing, reward_fn, more, seed)
            made += 1
        if self.settings.partial_rollout and self.in_flight is None:
            self._start_in_flight(timing, reward_fn, more, seed)
        return timing

    def finish_step(self, timing: dict[str, float]) -> dict[str, float]:
        """After the step's updates, before its weights are published: the background job joined (its `gen` /
        `reward` seconds added to `timing`, the wait as `timing['wait_producer']`; its error re-raised, see
        `BackgroundProducer.join`), then the queue's metrics (`GroupQueue.counts`, `async/rollout_version`,
        `async/in_flight`).

        A job that failed with a reward, tool or filter error (`run_dir.SAVED_ON_ERROR`) is not raised here: the
        producer and the data position go back to where the job started, the job becomes `owed` (the trainer skips
        the weight publication, saves the step and raises `job_error`; a resumed run pays it with `pay_owed`, so
        nothing the step trained is lost and the resumed run equals the straight one)."""
        if self.background is not None and self.background.busy:
            try:
                done, waited = self.background.join()
            except SAVED_ON_ERROR as e:
                snap, position, self.owed = self._job_start
                self._put_back(snap, position)
                self.job_error, done, waited = e, {}, 0.0
            for k, v in done.items():
                timing[k] = timing.get(k, 0.0) + v
            timing["wait_producer"] = waited
        metrics = self.queue.counts()
        metrics["async/rollout_version"] = float(self.rollout_version)
        metrics["async/in_flight"] = float(self.in_flight is not None)
        if self.filter is not None:
            metrics.update(self.filter.metrics())
            self.filter.reset()
        return metrics

    def pay_owed(self, reward_fn, more) -> None:
        """Run the generation ahead that a failed background job owed (`finish_step`), on this thread, from the state
        the job started from (a resumed run: the checkpoint's producer, data position and rollout weights). On a
        reward, tool or filter error the producer is put back and the job stays owed."""
        if self.owed is None:
            return
        snap, owed = self.snapshot(), self.owed
        position = None if self.data_position is None else self.data_position[0]()
        self._pulled = owed["pulled"]
        try:
            self._produce_ahead({}, reward_fn, more, owed["seed"], owed["target"])
        except SAVED_ON_ERROR:
            self._put_back(snap, position)
            raise
        self.owed = None
        if self.filter is not None:
            self.filter.reset()

    def _put_back(self, snap: tuple, position) -> None:
        """The producer (`restore`) and the data position (None: none recorded) as a job found them."""
        self.restore(snap)
        if position is not None:
            self.data_position[1](position)

    def settle(self) -> None:
        """A failed step: wait for the background job (if any) so nothing runs behind the error (its own error
        logged, `BackgroundProducer.settle`)."""
        if self.background is not None:
            self.background.settle()

    def close(self) -> None:
        """Stop the background thread (after its job), then the rollout's own `close`."""
        try:
            if self.background is not None:
                self.background.close()
        finally:
            self.rollout.close()

    # ---------------------------------------------------------------- checkpoint
    def state_dict(self, packer: ArrayPacker | None = None) -> dict[str, Any]:
        """JSON-able: the queue, the batch in flight, the pending prompts, the rollout version, the group counter
        (with `packer`: their numeric arrays in its buffers, host_arrays.py)."""
        pending = [PartialGeneration(p, sd, self.settings.n).state_dict(packer) for p, sd in self.pending]
        return {
            "queue": self.queue.state_dict(packer),
            "in_flight": None if self.in_flight is None else self.in_flight.state_dict(packer),
            "pending": pending,
            "rollout_version": self.rollout_version,
            "next_group_id": self._next_group_id,
            "owed": self.owed,
        }

    def add_to_checkpoint(self, tree: dict[str, Any], rollout_params) -> None:
        """Put this state into a trainer checkpoint `tree`: `host['async']` (JSON: references and metadata;
        `host['async']['arrays']` the buffer sizes), the numeric arrays as one flat buffer per dtype (the array item
        `async.arrays`) and the rollout's weights (`rollout.params`: older than the actor's between publications)."""
        packer = ArrayPacker()
        tree["host"]["async"] = dict(self.state_dict(packer), arrays=packer.sizes())
        tree["rollout"] = {"params": rollout_params}
        arrays = packer.arrays()
        if arrays:
            tree["async"] = {"arrays": arrays}

    @staticmethod
    def arrays_like(host: dict[str, Any]) -> dict[str, np.ndarray] | None:
        """Restore targets of the `async.arrays` item of a checkpoint whose host JSON is `host` (None: none)."""
        sizes = (host.get("async") or {}).get("arrays") or {}
        return {k: np.zeros((int(n),), np.dtype(k)) for k, n in sizes.items()} or None

    def restore_checkpoint(self, saved: dict[str, Any], like):
        """Inverse of `add_to_checkpoint`: loads the state and returns the rollout's weights placed like `like` (the
        rollout model samples with them again), or None when `saved` is a synchronous run's checkpoint. A checkpoint
        written before the array item (every array a JSON list) loads too."""
        if not (saved.get("rollout") and "async" in saved["host"]):
            return None
        arrays = (saved.get("async") or {}).get("arrays")
        arrays = None if arrays is None else {k: np.asarray(v) for k, v in arrays.items()}
        self.load_state_dict(saved["host"]["async"], arrays)
        params = place_like(saved["rollout"]["params"], like)
        self.rollout.publish_copy(params)
        return params

    def load_state_dict(self, d: dict[str, Any], arrays: dict[str, np.ndarray] | None = None) -> None:
        """Inverse of `state_dict` (`arrays`: the packer's buffers, when it had one)."""
        self.queue.load_state_dict(d["queue"], arrays)
        fly = d["in_flight"]
        self.in_flight = None if fly is None else PartialGeneration.from_state_dict(fly, arrays)
        self.pending = []
        for p in d["pending"]:
            gen = PartialGeneration.from_state_dict(p, arrays)
            self.pending.append((gen.prompts, gen.seed))
        self.rollout_version = int(d["rollout_version"])
        self._next_group_id = int(d["next_group_id"])
        self.owed = d.get("owed")  # absent in checkpoints written before it

    # ---------------------------------------------------------------- a failed step
    def snapshot(self) -> tuple:
        """The producer's state at a step's start, for `restore` (`RLTrainer.run_step`: a reward failure in the step
        puts it back, so nothing is trained, lost or counted twice). Queued groups and pending prompt batches are
        never changed in place, so the lists are copied; the batch in flight is (its rows are written in place
        when it resumes), so it is copied (`PartialGeneration.copy`)."""
        fly = None if self.in_flight is None else self.in_flight.copy()
        return self.queue.snapshot(), fly, list(self.pending), self.rollout_version, self._next_group_id

    def restore(self, snap: tuple) -> None:
        """Put back the state of `snapshot()`."""
        queue, fly, pending, version, next_id = snap
        self.queue.restore(queue)
        self.in_flight, self.pending = None if fly is None else fly.copy(), list(pending)
        self.rollout_version, self._next_group_id = version, next_id
        if self.filter is not None:  # its counters start at 0 with every step
            self.filter.reset()


def rollout_probs_diff(b: dict[str, np.ndarray], mask_BR: np.ndarray) -> dict[str, float]:
    """verl's `training/rollout_probs_diff_{max,std,valid}` and `training/rollout_actor_probs_pearson_corr`
    between the behaviour (`b["rollout_log_probs"]`) and the proximal policy (`b["old_log_probs"]`, recomputed)
    over the tokens of `mask_BR` (`rollout_corr.py`); {} without old log-probs. The `_mean` is the actor update's
    (`losses.py`, current vs behaviour policy, as verl logs it), not repeated here."""
    if "old_log_probs" not in b or not np.any(mask_BR):
        return {}
    out = compute_rollout_probs_diff_metrics(b["old_log_probs"], b["rollout_log_probs"], mask_BR)
    return {k: float(v) for k, v in jax.device_get(out).items() if k != "training/rollout_probs_diff_mean"}
