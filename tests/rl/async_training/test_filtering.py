"""DAPO's dynamic sampling in asynchronous training (`rl/async_training/filtering.py`) on the model-free rollout
(fake_rollout.py): groups whose metric is the same for every response never reach the queue and are counted as dropped
('filtered'); every produced group is trained once, filtered, dropped stale or still queued; the per-step counts add
up to the generation calls; `max_num_gen_batches` bounds the trainer's wait (FilterGroupsError) and the generation
ahead (no error); the filter's counters go through a put-back step."""

import types

import numpy as np
import pytest

from jaxrl_post.errors import FilterGroupsError
from jaxrl_post.rl.async_training.producer import AsyncRollout
from jaxrl_post.rl.async_training.settings import AsyncSettings
from tests.rl.async_training.fake_rollout import FakeRollout, prompt_batches

B, N = 4, 2


class ScoredFakeRollout(FakeRollout):
    """FakeRollout whose reward output also has the per-response scores the filter reads: response j of prompt p
    scores `j * varies(p)` (`varies(p)` False: every response of p scores 0, a group the filter drops)."""

    def __init__(self, n, varies):
        super().__init__(n)
        self.varies = varies

    def generate_and_score(self, prompts, seed, timing, reward_fn):
        b, nt, res = super().generate_and_score(prompts, seed, timing, reward_fn)
        pids = np.asarray(nt["pid"], np.int64)
        scores = np.asarray([float(j * self.varies(p)) for p, j in zip(pids, np.tile(np.arange(self.n), B))])
        tls = np.zeros(b["responses"].shape, np.float32)
        tls[:, -1] = scores
        b["token_level_scores"] = tls
        return b, nt, types.SimpleNamespace(metrics=res.metrics, function_scores=scores, extra_infos={})


def _settings(s=1, max_batches=0):
    return AsyncSettings("fully_async", s, 1, 1, False, 2, B, N, filter_metric="score", max_num_gen_batches=max_batches)


def _train(ar, rollout, loader, steps):
    out = []
    for t in range(steps):
        b, nt, m, _, _ = ar.collect(next(loader), 1000 * t + 7, {}, None, None, lambda: next(loader), step=t)
        m.update(ar.finish_step({}))
        out.append((t, b, nt, m))
        rollout.version = t + 1
        ar.publish(t + 1)
    return out


@pytest.mark.parametrize("s", [0, 1, 2])
def test_filtered_groups_never_train_and_every_group_is_accounted_for(s):
    rollout = ScoredFakeRollout(N, varies=lambda p: p % 3 != 0)  # prompts 0, 3, 6, ... answered all alike
    ar = AsyncRollout(_settings(s), rollout)
    steps = _train(ar, rollout, prompt_batches(B), 10)
    trained = []
    for _, b, nt, _m in steps:
        pids = [int(p) for p in nt["pid"][::N]]
        assert len(pids) == B and all(p % 3 for p in pids)  # only groups whose scores vary
        assert all(np.std(b["token_level_scores"][g * N : (g + 1) * N].sum(-1)) > 0 for g in range(B))
        trained += pids
    assert len(trained) == len(set(trained))  # each at most once
    produced = [p for pids, _, _ in rollout.calls for p in pids]
    assert len(produced) == len(set(produced))
    queued = [int(g.non_tensor["pid"][0]) for g in ar.queue._items]
    filtered = [p for p in produced if p % 3 == 0]
    stale = len(ar.queue.dropped.get("stale", []))
    assert len(ar.queue.dropped["filtered"]) == len(filtered)
    assert len(trained) + len(filtered) + stale + len(queued) == len(produced)
    # the per-step counts: one generation batch per call, its groups kept or dropped
    assert sum(m["train/num_gen_batches"] for *_, m in steps) == len(rollout.calls)
    assert sum(m["train/num_kept_groups"] + m["train/num_dropped_groups"] for *_, m in steps) == len(produced)
    assert sum(m["train/num_dropped_groups"] for *_, m in steps) == len(filtered)
    assert steps[-1][3]["async/dropped_groups_total/filtered"] == len(filtered)


def test_the_trainers_wait_is_bounded_by_max_num_gen_batches():
    rollout = ScoredFakeRollout(N, varies=lambda p: False)  # every group alike: nothing ever trains
    ar = AsyncRollout(_settings(1, max_batches=3), rollout)
    loader = prompt_batches(B)
    with pytest.raises(FilterGroupsError, match=r"step 0: 3 generation batches .* left 0 of the data.train_batch_size"):
        ar.collect(next(loader), 7, {}, None, None, lambda: next(loader), step=0)
    assert len(rollout.calls) == 3


def test_generation_ahead_stops_at_the_limit_and_the_next_wait_raises():
    rollout = ScoredFakeRollout(N, varies=lambda p: p < B)  # only the first batch's groups vary
    ar = AsyncRollout(_settings(2, max_batches=2), rollout)
    loader = prompt_batches(B)
    _, nt, m, _, _ = ar.collect(next(loader), 7, {}, None, None, lambda: next(loader), step=0)
    assert [int(p) for p in nt["pid"][::N]] == list(range(B))
    m.update(ar.finish_step({}))
    # step 0: its own batch, then 2 batches ahead (the limit) that kept nothing: no error while the trainer trains
    assert len(rollout.calls) == 3 and m["train/num_gen_batches"] == 3 and m["train/num_dropped_groups"] == 2 * B
    with pytest.raises(FilterGroupsError, match="step 1: 2 generation batches"):
        ar.collect(next(loader), 1007, {}, None, None, lambda: next(loader), step=1)
    assert len(rollout.calls) == 5


def test_a_put_back_step_restarts_the_counts():
    rollout = ScoredFakeRollout(N, varies=lambda p: p % 2 == 0)
    ar = AsyncRollout(_settings(1), rollout)
    loader = prompt_batches(B)
    snap = ar.snapshot()
    ar.collect(next(loader), 7, {}, None, None, lambda: next(loader), step=0)
    assert ar.filter.num_gen_batches > 0
    ar.restore(snap)
    assert ar.filter.metrics() == {
        "train/num_gen_batches": 0.0,
        "train/num_kept_groups": 0.0,
        "train/num_dropped_groups": 0.0,
    }


@pytest.mark.slow  # one tiny trainer (~30 s on 2 cores)
def test_dapo_tiny_trains_fully_async_on_kept_groups_only(tmp_path):
    """`configs/dapo.py:tiny` (binary reward) trained fully asynchronously, staleness <= 1: every trained group's
    responses differ in score (read back from `trainer.rollout_data_dir`), some groups were filtered, and each step
    logs the filter's counts."""
    import json

    from configs import dapo
    from jaxrl_post.rl.trainer import RLTrainer

    c = dapo.get_config("tiny")
    c.reward_model.overlong_buffer.enable = False  # the dumped score is then the filtered metric itself
    c.algorithm.filter_groups.metric = "score"
    c.trainer.default_local_dir = str(tmp_path / "run")
    c.trainer.rollout_data_dir = str(tmp_path / "dump")
    c.trainer.total_training_steps = 3
    c.trainer.val_before_train = c.trainer.val_at_end = False
    c.trainer.save_freq = -1
    c.async_training.mode = "fully_async"
    c.async_training.staleness_threshold = 1
    t = RLTrainer(c, console_write=lambda s: None)
    try:
        hist = t.fit()["history"]
    finally:
        t.close()
    assert len(hist) == 3
    for step, m in enumerate(hist, 1):
        assert m["train/num_gen_batches"] >= 1
        rows = [json.loads(line) for line in (tmp_path / "dump" / f"{step}.jsonl").read_text().splitlines()]
        by_uid = {}
        for r in rows:
            by_uid.setdefault(r["uid"], []).append(r["score"])
        assert len(by_uid) == c.data.train_batch_size and all(len(v) == c.rollout.n for v in by_uid.values())
        assert all(np.std(v) > 0 for v in by_uid.values()), by_uid
    assert hist[-1]["async/dropped_groups_total/filtered"] > 0  # the filter had something to do
    assert sum(m["train/num_dropped_groups"] for m in hist) == hist[-1]["async/dropped_groups_total/filtered"]
