"""The asynchronous schedule (`AsyncRollout`) on a model-free rollout (fake_rollout.py), over many steps of each
mode: the staleness bound is never exceeded, every generated group is trained exactly once or dropped with a reason
(or still queued), each step trains `train_batch_size` groups in prompt order, one-step-off trains the batch of the
weights one step back, staleness 0 is the synchronous schedule, and a state saved mid-queue (JSON) continues
exactly."""

import json

import numpy as np
import pytest

from jaxrl_post.rl.async_training import queue
from jaxrl_post.rl.async_training.producer import AsyncRollout
from jaxrl_post.rl.async_training.settings import AsyncSettings
from tests.rl.async_training.fake_rollout import FakeRollout, prompt_batches

B, N = 4, 2


def _settings(mode="fully_async", s=1, k=1, r=1, partial=False):
    return AsyncSettings(mode, s, k, r, partial, 2, B, N)


def _train(ar, rollout, loader, steps, start=0, log=None):
    """The trainer's side: collect step t's groups, then 'update' (publish every k steps)."""
    out = []
    for t in range(start, start + steps):
        b, nt, m, _, _ = ar.collect(next(loader), 1000 * t + 7, {}, None, None, lambda: next(loader), step=t)
        m.update(ar.finish_step({}))  # after the 'update', before the publication
        out.append((t, b, nt, m))
        if ar.settings.publishes_after(t + 1):
            rollout.version = t + 1
            ar.publish(t + 1)
    return out


CASES = {
    "staleness0": _settings(s=0),
    "one_step_off": _settings("one_step_off", 1, 1, 1),
    "s2_k2_r2": _settings(s=2, k=2, r=2),
    "s3_k1": _settings(s=3, k=1),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_staleness_bound_and_every_group_trained_once_or_dropped(name):
    st = CASES[name]
    rollout = FakeRollout(N)
    ar = AsyncRollout(st, rollout)
    loader = prompt_batches(B)
    steps = _train(ar, rollout, loader, 12)
    trained_pids = []
    for t, b, nt, m in steps:
        assert len(b["responses"]) == B * N
        stale = t - b["rollout_versions"].min(axis=1)
        assert stale.max() <= st.staleness_threshold and m["async/staleness/max"] == stale.max()
        # the behaviour weights recorded in each row are the rollout's at generation (fake: scores = version)
        np.testing.assert_array_equal(b["token_level_scores"], b["rollout_versions"].astype(np.float32))
        pids = list(nt["pid"][::N])
        assert all(list(nt["pid"][g * N : (g + 1) * N]) == [p] * N for g, p in enumerate(pids))  # groups whole
        trained_pids += pids
    assert trained_pids == sorted(trained_pids) and len(set(trained_pids)) == len(trained_pids)  # FIFO, once
    q = ar.queue
    generated = set(range(q.produced))
    dropped = {i for ids in q.dropped.values() for i in ids}
    queued = {g.group_id for g in q._items}
    assert set(q.trained) | dropped | queued == generated
    assert len(q.trained) + len(dropped) + len(queued) == q.produced  # disjoint: trained exactly once
    assert len(q.trained) == 12 * B


def test_one_step_off_trains_the_batch_of_the_previous_weights():
    rollout = FakeRollout(N)
    ar = AsyncRollout(_settings("one_step_off", 1, 1, 1), rollout)
    steps = _train(ar, rollout, prompt_batches(B), 5)
    for t, b, nt, m in steps:
        assert np.all(b["rollout_versions"] == max(0, t - 1))  # step 0: the bootstrap batch, on-policy
        np.testing.assert_array_equal(nt["pid"][::N], np.arange(t * B, (t + 1) * B))  # prompts in loader order
        assert m["async/queue_size"] == B  # the next step's batch is ready (generated while this one trains)
    assert [c[2] for c in rollout.calls] == [0, 0, 1, 2, 3, 4]  # batch t + 1 sampled by the weights of step t


def test_staleness_zero_is_the_synchronous_schedule():
    rollout = FakeRollout(N)
    ar = AsyncRollout(_settings(s=0), rollout)
    steps = _train(ar, rollout, prompt_batches(B), 4)
    # one generation batch per step, with the step's own seed and weights, trained at once
    assert [(c[1], c[2]) for c in rollout.calls] == [(1000 * t + 7, t) for t in range(4)]
    for t, b, _, m in steps:
        assert m["async/staleness/max"] == 0 and m["async/queue_size"] == 0
        np.testing.assert_array_equal(b["rollout_log_probs"], np.float32(-((1000 * t + 7) % 1000) / 1000.0))


def test_stale_groups_are_dropped_with_a_reason_and_replaced():
    rollout = FakeRollout(N)
    ar = AsyncRollout(_settings(s=1), rollout)
    loader = prompt_batches(B)
    _train(ar, rollout, loader, 1)  # step 0 leaves one batch (version 0... 1) queued ahead
    before = {g.group_id: g.version for g in ar.queue._items}
    assert before
    rollout.version = 5
    ar.publish(5)  # e.g. weights published while the queue waited: its groups are now 4 versions old at step 5
    b, _, m, _, _ = ar.collect(next(loader), 5007, {}, None, None, lambda: next(loader), step=5)
    m.update(ar.finish_step({}))
    assert ar.queue.dropped == {"stale": sorted(before)}
    assert m["async/dropped_groups_total/stale"] == len(before)
    assert np.all(b["rollout_versions"] == 5)


def test_newly_generated_groups_never_dropped_or_the_step_raises(monkeypatch):
    """A guard, not a rule: a fresh generation batch is all fresh groups, so a step that generates more batches than
    it needs + the batch in flight + 1 has a bug in the versions (as -1 tails were, queue.group_version) and
    raises instead of generating forever."""
    rollout = FakeRollout(N)
    ar = AsyncRollout(_settings(s=1), rollout)
    loader = prompt_batches(B)
    _train(ar, rollout, loader, 2)
    monkeypatch.setattr(queue, "group_version", lambda versions, current: -1)  # the old rule on a short response
    generate = rollout.generate_and_score

    def bounded(*args):  # without the guard the step would generate forever: fail instead of hanging
        assert len(rollout.calls) < 20, "the producer kept generating"
        return generate(*args)

    monkeypatch.setattr(rollout, "generate_and_score", bounded)
    with pytest.raises(RuntimeError, match="newly generated groups were dropped"):
        _train(ar, rollout, loader, 3, start=2)  # step 2 trains the groups queued ahead; step 3 finds none


def test_rollout_weights_too_old_to_ever_train_raise():
    rollout = FakeRollout(N)
    ar = AsyncRollout(_settings(s=0, k=3), rollout)  # config_check rejects this; the schedule must not spin
    loader = prompt_batches(B)
    _train(ar, rollout, loader, 1)
    with pytest.raises(RuntimeError, match="staleness_threshold"):
        ar.collect(next(loader), 7, {}, None, None, lambda: next(loader), step=1)


@pytest.mark.parametrize("name", ["one_step_off", "s2_k2_r2"])
def test_state_saved_mid_queue_continues_exactly(name):
    st = CASES[name]
    ref_rollout = FakeRollout(N)
    ref = AsyncRollout(st, ref_rollout)
    ref_loader = prompt_batches(B)
    want = _train(ref, ref_rollout, ref_loader, 6)

    rollout = FakeRollout(N)
    ar = AsyncRollout(st, rollout)
    loader = prompt_batches(B)
    _train(ar, rollout, loader, 3)
    assert len(ar.queue) > 0  # mid-queue
    saved = json.loads(json.dumps(ar.state_dict()))  # what the checkpoint's host JSON holds
    resumed_rollout = FakeRollout(N)
    resumed_rollout.version = ar.rollout_version
    resumed = AsyncRollout(st, resumed_rollout)
    resumed.load_state_dict(saved)
    got = _train(resumed, resumed_rollout, prompt_batches(B, start=next(loader).non_tensor_batch["pid"][0]), 3, 3)
    for (t, b, nt, m), (t2, b2, nt2, m2) in zip(want[3:], got, strict=True):
        assert t == t2 and m == m2
        for k in b:
            np.testing.assert_array_equal(b[k], b2[k], err_msg=k)
        np.testing.assert_array_equal(nt["pid"], nt2["pid"])
