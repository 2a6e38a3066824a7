"""The background producer (`async_training/background.py`) on the model-free rollout (fake_rollout.py): with the
ahead generation on the worker thread, every mode's schedule generates the same batches (prompt ids, seeds, weights
version) in the same order and trains the same rows as the take-turns run; the ahead batches really run on the worker
while the main thread "trains"; an error raised on the worker surfaces on the main thread at the join, the same
exception with a note naming its origin."""

import threading
import time

import numpy as np
import pytest

from jaxrl_post.rl.async_training.background import BackgroundProducer
from jaxrl_post.rl.async_training.producer import AsyncRollout
from tests.rl.async_training.fake_rollout import FakeRollout, prompt_batches
from tests.rl.async_training.test_schedule import CASES, B, N


class SplitFakeRollout(FakeRollout):
    """A fake rollout on "the split placement" (`rollout_mesh` set: `AsyncRollout` starts its thread); records the
    thread of every generation batch and can fail on the `fail_at`-th one."""

    rollout_mesh = "rollout devices"

    def __init__(self, n, fail_at=None, gen_seconds=0.0):
        super().__init__(n)
        self.threads: list[str] = []
        self.fail_at, self.gen_seconds = fail_at, gen_seconds

    def generate_and_score(self, prompts, seed, timing, reward_fn):
        self.threads.append(threading.current_thread().name)
        if self.fail_at is not None and len(self.threads) == self.fail_at:
            raise ValueError(f"generation batch {self.fail_at} failed")
        time.sleep(self.gen_seconds)
        return super().generate_and_score(prompts, seed, timing, reward_fn)


def _train(ar, rollout, loader, steps, train_seconds=0.0):
    """The trainer's side as `rl/step.py`: collect, 'update', `finish_step` (join), then publish."""
    out = []
    for t in range(steps):
        b, nt, m, _, _ = ar.collect(next(loader), 1000 * t + 7, {}, None, None, lambda: next(loader), step=t)
        time.sleep(train_seconds)  # the update on the training mesh
        m.update(ar.finish_step({}))
        out.append((b, nt, m))
        if ar.settings.publishes_after(t + 1):
            rollout.version = t + 1
            ar.publish(t + 1)
    return out


@pytest.mark.parametrize("name", sorted(CASES))
def test_threaded_schedule_equals_take_turns(name):
    runs = {}
    for label, cls in (("turns", FakeRollout), ("thread", SplitFakeRollout)):
        rollout = cls(N)
        ar = AsyncRollout(CASES[name], rollout)
        assert (ar.background is not None) == (label == "thread")
        try:
            runs[label] = (_train(ar, rollout, prompt_batches(B), 8), rollout.calls)
        finally:
            ar.close()
    (turns, turn_calls), (thread, thread_calls) = runs["turns"], runs["thread"]
    assert thread_calls == turn_calls  # same prompts, seeds and weights versions, same order
    for (b0, nt0, m0), (b1, nt1, m1) in zip(turns, thread, strict=True):
        assert m1 == m0
        assert b1.keys() == b0.keys() and all(np.array_equal(b1[k], b0[k]) for k in b0)
        assert list(nt1["pid"]) == list(nt0["pid"])


def test_ahead_batches_run_on_the_worker_while_the_main_thread_trains():
    rollout = SplitFakeRollout(N, gen_seconds=0.05)
    ar = AsyncRollout(CASES["one_step_off"], rollout)
    try:
        _train(ar, rollout, prompt_batches(B), 3, train_seconds=0.1)
        events = list(ar.background.events)
    finally:
        ar.close()
    # step 0 generates its own batch on the main thread, every later batch was generated ahead on the worker
    assert rollout.threads[0] == threading.main_thread().name
    assert all(n.startswith(BackgroundProducer.thread_name) for n in rollout.threads[1:]) and len(rollout.threads) == 4
    for t in range(3):
        (p0, p1), (t0, t1) = ((e[2], e[3]) for what in ("produce", "train") for e in events if e[:2] == (what, t))
        assert max(p0, t0) < min(p1, t1)  # the intervals intersect


def test_worker_error_surfaces_on_the_main_thread_at_the_join():
    rollout = SplitFakeRollout(N, fail_at=3)  # one_step_off: batch 3 is the one generated ahead during step 1
    ar = AsyncRollout(CASES["one_step_off"], rollout)
    try:
        with pytest.raises(ValueError) as e:
            _train(ar, rollout, prompt_batches(B), 3)
        assert str(e.value) == "generation batch 3 failed"  # the message unchanged (str() leaves notes out)
        assert any("background thread" in n and "step 1" in n for n in e.value.__notes__)
        assert rollout.threads[2].startswith(BackgroundProducer.thread_name)
        assert not ar.background.busy and len(ar.queue) == 0  # joined; the failed batch queued nothing
    finally:
        ar.close()


def test_settle_logs_the_worker_error_behind_a_main_thread_error(caplog):
    bg = BackgroundProducer()
    bg.start(lambda: 1 / 0, step=4)
    bg.settle()  # the step's own error is the one that propagates; this one is logged
    assert not bg.busy and "also failed" in caplog.text and "ZeroDivisionError" in caplog.text
    bg.start(lambda: {"gen": 1.0}, step=5)
    with pytest.raises(RuntimeError, match="step 5 was never joined"):
        bg.start(lambda: {}, step=6)
    assert bg.join()[0] == {"gen": 1.0}
    bg.close()
