"""A reward failure in the background job (split placement) on the model-free schedule (fake_rollout.py):
`finish_step` puts the producer and the data position back to where the job started and marks the job owed; the
state saved then (JSON, as the checkpoint's host part) and a new producer that pays the owed job
(`AsyncRollout.pay_owed`), publishes and trains on give exactly the batches of the run that never failed, also when
the step's own take pulled prompt batches before its job started (DAPO's filter: the job's pull counter). The
trainer-level test (a real tiny trainer, its checkpoint and metrics) is
tests/rl/async_training/test_background_trainer.py."""

import json

import numpy as np
import pytest

from jaxrl_post.rewards import RewardFunctionError
from jaxrl_post.rl.async_training.background import BackgroundProducer
from jaxrl_post.rl.async_training.producer import AsyncRollout
from jaxrl_post.rl.async_training.settings import AsyncSettings
from tests.rl.async_training.fake_rollout import prompt_batches
from tests.rl.async_training.test_filtering import ScoredFakeRollout

B, N = 4, 2
SETTINGS = {  # (mode, staleness, k, require_batches, DAPO filter metric)
    "one_step_off": ("one_step_off", 1, 1, 1, None),
    "s2_k2_r2": ("fully_async", 2, 2, 2, None),
    "s1_filter": ("fully_async", 1, 1, 1, "score"),
}
# (settings, failing step, the job's generation batch that fails): step 0's job pulls a prompt batch from the loader
# (measured on the reference: later jobs generate what the step's own pull left pending); s2_k2_r2's step 0 job makes
# two batches (r = 2 chunks), the second fails after the first was queued
CASES = {
    "one_step_off-step0": ("one_step_off", 0, 0),
    "one_step_off-step2": ("one_step_off", 2, 0),
    "s2_k2_r2-step0-second": ("s2_k2_r2", 0, 1),
    "s2_k2_r2-step2": ("s2_k2_r2", 2, 0),
    # the filter drops every third prompt's group, so step 0's own take pulls a prompt batch from the loader before
    # its job starts: the owed job must resume the pull counter (`owed['pulled']` > 0), whose seeds it samples with
    "s1_filter-step0": ("s1_filter", 0, 0),
}


class Loader:
    """Prompt batches with a resumable position (`get_state` / `set_state`, as `PromptDataLoader`)."""

    def __init__(self, start: int = 0):
        self.i = start

    def __next__(self):
        out = next(prompt_batches(B, start=self.i))  # the batch at the current position
        self.i += B
        return out

    def get_state(self):
        return {"i": self.i}

    def set_state(self, s):
        self.i = int(s["i"])


def _varies(p):
    return p % 3 != 0  # prompts 0, 3, 6, ...: every response scores alike, a group DAPO's filter drops


class FailingRollout(ScoredFakeRollout):
    """Raises `RewardFunctionError` in the generation batch number `fail_at` (0-based), after 'generating'."""

    def __init__(self, n, fail_at=None):
        super().__init__(n, _varies)
        self.fail_at, self.batches = fail_at, 0

    def generate_and_score(self, prompts, seed, timing, reward_fn):
        self.batches += 1
        if self.batches - 1 == self.fail_at:
            raise RewardFunctionError("injected reward failure")
        return super().generate_and_score(prompts, seed, timing, reward_fn)


def _rollout(fail_at=None):
    return FailingRollout(N, fail_at)


def _producer(name, rollout, loader):
    mode, s, k, r, metric = SETTINGS[name]
    ar = AsyncRollout(AsyncSettings(mode, s, k, r, False, 2, B, N, filter_metric=metric), rollout)
    ar.background = BackgroundProducer()  # the split placement's thread (FakeRollout has no rollout mesh)
    ar.data_position = (loader.get_state, loader.set_state)
    return ar


def _step(ar, rollout, loader, t):
    """The trainer's side of step t: collect, 'update', finish_step (the join), publish unless the job is owed."""
    b, nt, m, _, _ = ar.collect(next(loader), 1000 * t + 7, {}, None, None, lambda: next(loader), step=t)
    m.update(ar.finish_step({}))
    if ar.owed is None and ar.settings.publishes_after(t + 1):
        rollout.version = t + 1
        ar.publish(t + 1)
    return b, nt


@pytest.mark.parametrize("case", sorted(CASES))
def test_failed_job_is_put_back_saved_owed_and_paid_exactly(case):
    name, fail_step, fail_batch = CASES[case]
    ref_rollout, ref_loader = _rollout(), Loader()
    ref = _producer(name, ref_rollout, ref_loader)
    want = [_step(ref, ref_rollout, ref_loader, t) for t in range(6)]
    ref.close()

    rollout, loader = _rollout(), Loader()
    ar = _producer(name, rollout, loader)
    for t in range(fail_step):
        _step(ar, rollout, loader, t)
    before = (json.dumps(ar.state_dict()), loader.i)
    job_start, start = {}, ar.background.start
    first = rollout.batches

    def start_armed(fn, step):  # the job starts (the step's own batches are done): its batch `fail_batch` fails
        job_start.update(i=loader.i, queued=len(ar.queue))
        rollout.fail_at = rollout.batches + fail_batch
        start(fn, step)

    ar.background.start = start_armed
    _step(ar, rollout, loader, fail_step)
    assert isinstance(ar.job_error, RewardFunctionError) and ar.owed is not None
    assert rollout.batches > first and ar.rollout_version <= fail_step  # not published after the failed job
    assert loader.i == job_start["i"] and len(ar.queue) == job_start["queued"]  # put back to the job's start
    assert before != (json.dumps(ar.state_dict()), loader.i)  # the step itself did move the producer
    if SETTINGS[name][4] is not None:  # the case that exercises the owed pull counter does
        assert ar.owed["pulled"] > 0
    saved = json.loads(json.dumps(ar.state_dict()))  # the checkpoint's host JSON
    position, version = loader.get_state(), ar.rollout_version
    ar.close()

    resumed_rollout, resumed_loader = _rollout(), Loader()
    resumed_rollout.version = version
    resumed_loader.set_state(position)
    resumed = _producer(name, resumed_rollout, resumed_loader)
    resumed.load_state_dict(saved)
    assert resumed.owed == saved["owed"] is not None
    resumed.pay_owed(None, lambda: next(resumed_loader))
    assert resumed.owed is None
    if resumed.settings.publishes_after(fail_step + 1):  # what the failed step's publication would have done
        resumed_rollout.version = fail_step + 1
        resumed.publish(fail_step + 1)
    got = [_step(resumed, resumed_rollout, resumed_loader, t) for t in range(fail_step + 1, 6)]
    resumed.close()
    for t, ((b, nt), (b2, nt2)) in enumerate(zip(want[fail_step + 1 :], got, strict=True), start=fail_step + 1):
        for k in b:
            np.testing.assert_array_equal(b[k], b2[k], err_msg=f"step {t}: {k}")
        np.testing.assert_array_equal(nt["pid"], nt2["pid"], err_msg=f"step {t}")
    assert resumed.state_dict() == ref.state_dict()
