"""Asynchronous training end to end on the tiny GRPO configs: fully asynchronous at staleness 0 is the synchronous
run (every shared metric and the final params bit for bit); `configs/grpo.py:async` (partial rollout on the paged
engine, staleness <= 2, two generation batches per step) stopped after step 2 with groups queued and a batch in
flight resumes exactly (the later steps' metrics and the final params bit for bit); a reward function that fails in the
middle of step 3 (after some of the step's groups were queued) stops the run with one line, the checkpoint of step 2
holds the queue as it was before step 3, and resuming gives the uninterrupted run's steps 3-4 bit for bit."""

import os

import jax
import numpy as np
import pytest

from configs import grpo
from jaxrl_post.rewards import RewardFunctionError
from jaxrl_post.rl.trainer import RLTrainer

_TIME = ("timing_s/", "timing_per_token_ms/", "perf/time_per_step", "perf/throughput", "perf/mfu/")


@pytest.fixture(scope="module", autouse=True)
def jax_cache(tmp_path_factory):
    """A module-wide persistent compilation cache: trainers after the first start cheaply."""
    from jax._src import compilation_cache

    names = (
        "jax_compilation_cache_dir",
        "jax_persistent_cache_min_compile_time_secs",
        "jax_persistent_cache_min_entry_size_bytes",
    )
    old = {n: getattr(jax.config, n) for n in names}
    # the session's cache (tests/conftest.py; shared with the other files' tiny trainers), else one for this module
    cache = os.environ.get("JAX_COMPILATION_CACHE_DIR") or str(tmp_path_factory.mktemp("jax_cache"))
    jax.config.update("jax_compilation_cache_dir", cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    yield
    for n, v in old.items():
        jax.config.update(n, v)
    compilation_cache.reset_cache()


def _cfg(variant, workdir, steps, **async_kw):
    c = grpo.get_config(variant)
    c.trainer.default_local_dir = str(workdir)
    c.trainer.total_training_steps = steps
    c.trainer.val_before_train = False
    c.trainer.val_at_end = False
    c.trainer.save_freq = 2
    for k, v in async_kw.items():
        setattr(c.async_training, k, v)
    return c


def _fit(cfg, max_steps=None):
    t = RLTrainer(cfg, console_write=lambda s: None)
    try:
        hist = t.fit(max_steps=max_steps)["history"]
        params = jax.tree.map(np.asarray, t.state.actor.params)
        saved = t.state_dict()["host"].get("async")
    finally:
        t.close()
    return [{k: v for k, v in m.items() if not k.startswith(_TIME)} for m in hist], params, saved


def _same_params(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(x, y)


@pytest.mark.slow  # two tiny trainers (~60 s on 2 loaded cores)
def test_fully_async_at_staleness_zero_is_the_synchronous_run(tmp_path):
    sync, p_sync, _ = _fit(_cfg("tiny", tmp_path / "sync", 2))
    asy, p_async, _ = _fit(_cfg("tiny", tmp_path / "async", 2, mode="fully_async", staleness_threshold=0))
    for s, a in zip(sync, asy, strict=True):
        assert {k: a[k] for k in s} == s
        assert a["async/staleness/max"] == 0
    _same_params(p_sync, p_async)


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """`configs/grpo.py:async` run 4 steps straight: (metrics, final actor params)."""
    want, p_want, _ = _fit(_cfg("async", tmp_path_factory.mktemp("straight"), 4))
    return want, p_want


@pytest.mark.slow  # three paged trainers (~90 s on 2 loaded cores)
def test_async_variant_resumes_exactly_mid_queue(straight, tmp_path):
    want, p_want = straight
    assert max(m["async/staleness/max"] for m in want) >= 1  # really off-policy
    assert all(m["async/staleness/max"] <= 2 for m in want)
    assert any(m.get("rollout_corr/rollout_is_mean") is not None for m in want) or any(
        k.startswith("rollout_corr/") for k in want[-1]
    )
    _, _, saved = _fit(_cfg("async", tmp_path / "resumed", 4), max_steps=2)  # checkpoint of step 2
    assert saved["queue"]["items"] and saved["in_flight"] is not None  # groups queued, a batch in flight
    assert any(s["tokens"]["shape"][0] for s in saved["in_flight"]["unfinished"])  # ... stopped halfway
    assert "data" not in saved["queue"]["items"][0]["batch"]["responses"]  # arrays in the item async.arrays
    got, p_got, _ = _fit(_cfg("async", tmp_path / "resumed", 4))  # resumes from step 2
    assert got == want[2:]
    _same_params(p_got, p_want)
    assert os.path.isdir(tmp_path / "resumed" / "checkpoints" / "global_step_4")


_FLAKY = """
import importlib.util, os
_spec = importlib.util.spec_from_file_location("_tiny_reward", {tiny!r})
_tiny = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_tiny)
_calls = [0]

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if os.path.exists({marker!r}):  # armed: the k-th call from now on, and every later one, fails
        _calls[0] += 1
        if _calls[0] >= {k}:
            raise RuntimeError("reward service down")
    return _tiny.compute_score(data_source, solution_str, ground_truth, extra_info)
"""


def _async_state(t):
    tree = t.state_dict()
    return tree["host"]["async"], jax.tree.map(np.asarray, tree.get("async"))


@pytest.mark.slow  # two paged trainers (~40 s on 2 loaded cores)
def test_reward_failure_mid_step_puts_the_queue_back_and_resume_is_exact(straight, tmp_path):
    want, p_want = straight
    marker, reward = tmp_path / "armed", tmp_path / "flaky_reward.py"
    # a generation batch is 2 prompts x 4 samples = 8 reward calls: call 9 fails in step 3's second batch, once the
    # batch in flight was resumed, scored and queued
    reward.write_text(_FLAKY.format(tiny=grpo.TINY_REWARD, marker=str(marker), k=9))
    c = _cfg("async", tmp_path / "run", 4)
    c.trainer.save_freq = 100  # the checkpoint of step 2 is the one written at the error
    c.custom_reward_function.path = str(reward)
    c.reward_model.num_workers = 0  # in process: one call counter
    c.reward_model.max_error_fraction = 0.0  # a failed call stops the run
    lines = []
    t = RLTrainer(c, console_write=lines.append)
    try:
        t.fit(max_steps=2)
        before, before_arrays = _async_state(t)
        assert before["queue"]["items"] and before["in_flight"] is not None
        marker.write_text("")
        with pytest.raises(RewardFunctionError, match="reward service down"):
            t.fit()
        after, after_arrays = _async_state(t)
    finally:
        t.close()
    root = tmp_path / "run" / "checkpoints"
    assert lines[-1] == (
        f"stopped by an error in step 3; checkpoint of step 2 saved to {root / 'global_step_2'}; "
        "fix the cause and rerun the same command to resume"
    )
    assert after == before  # the queue, its counters, the batch in flight and the pending prompts as before step 3
    for x, y in zip(jax.tree.leaves(after_arrays), jax.tree.leaves(before_arrays), strict=True):
        np.testing.assert_array_equal(x, y)
    got, p_got, _ = _fit(_cfg("async", tmp_path / "run", 4))  # the working reward again: resumes from step 2
    assert got == want[2:]
    _same_params(p_got, p_want)
