"""Reward functions that fail are loud: the batch raises RewardFunctionError past
`max_error_fraction`, in-process calls time out, unknown data sources are refused up front."""

import textwrap
import threading
import time

import numpy as np
import pytest

from jaxrl_post.rewards import (
    RewardFunctionError,
    RewardManager,
    UnknownDataSourceError,
    check_data_sources,
    default_compute_score,
    get_reward_fn,
    known_data_sources,
    load_custom_reward_fn,
)
from jaxrl_post.rewards.inprocess import ThreadCaller


class CharTokenizer:
    def batch_decode(self, seqs, skip_special_tokens=True):
        return ["".join(chr(t) for t in s) for s in seqs]


def _batch(texts, data_source="my/source"):
    from jaxrl_post.batch.protocol import DataProto

    B, R = len(texts), max(len(t) for t in texts)
    resp = np.zeros((B, R), np.int32)
    mask = np.zeros((B, R), np.int32)
    for i, t in enumerate(texts):
        resp[i, : len(t)] = [ord(c) for c in t]
        mask[i, : len(t)] = 1
    return DataProto.from_dict(
        tensors={"responses": resp, "response_mask": mask},
        non_tensors={
            "data_source": np.array([data_source] * B, dtype=object),
            "ground_truth": np.array(["1"] * B, dtype=object),
        },
    )


RAISING_SRC = textwrap.dedent(
    """
    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        if solution_str.startswith("bad"):
            return helper(solution_str)
        return 1.0

    def helper(s):
        raise ValueError(f"cannot parse {s!r}")
    """
)


def test_raising_reward_fn_stops_with_first_exception(tmp_path):
    path = tmp_path / "raising_reward.py"
    path.write_text(RAISING_SRC)
    fn = load_custom_reward_fn(str(path))
    mgr = RewardManager(fn, CharTokenizer(), num_workers=0, timeout_s=5.0)  # default max_error_fraction=0.5
    # at the limit (2 of 4 = 0.5, not more): scored 0 and counted, as before
    out = mgr.compute(_batch(["ok1", "bad1", "ok2", "bad2"]))
    np.testing.assert_array_equal(out.scores, [1, 0, 1, 0])
    assert out.metrics["reward/num_errors"] == 2 and out.metrics["reward/num_timeouts"] == 0
    assert out.errors[0] == "row 1 (data_source='my/source'): ValueError: cannot parse 'bad1'"
    # over the limit: the run stops, naming the function, the data source, the fraction and the first failure
    with pytest.raises(RewardFunctionError) as e:
        mgr.compute(_batch(["ok", "badA", "badB"]))
    msg = str(e.value)
    assert f"reward function 'compute_score' from {path} (custom_reward_function)" in msg
    assert "failed on 2 of 3 responses (67%, 0 timeouts; limit reward_model.max_error_fraction=0.5)" in msg
    assert "First failure, row 1 (data_source='my/source'), in process: ValueError: cannot parse 'badA'" in msg
    # the original exception (with its traceback through the user's file) is the cause
    cause = e.value.__cause__
    assert isinstance(cause, ValueError) and str(cause) == "cannot parse 'badA'"
    tb = cause.__traceback__
    frames = []
    while tb is not None:
        frames.append(tb.tb_frame.f_code.co_name)
        tb = tb.tb_next
    assert frames[-2:] == ["compute_score", "helper"]
    # every call failing (the case) raises too; max_error_fraction=1.0 never raises
    with pytest.raises(RewardFunctionError, match="failed on 2 of 2 responses"):
        mgr.compute(_batch(["bad", "bad"]))
    lenient = RewardManager(fn, CharTokenizer(), num_workers=0, max_error_fraction=1.0)
    assert lenient.compute(_batch(["bad", "bad"])).metrics["reward/num_errors"] == 2
    with pytest.raises(ValueError, match=r"max_error_fraction must be in \[0, 1\]"):
        RewardManager(fn, CharTokenizer(), max_error_fraction=1.5)


def test_bad_return_value_counts_as_failure():
    mgr = RewardManager(lambda *a: "not a number", CharTokenizer(), num_workers=0, max_error_fraction=0.0)
    with pytest.raises(RewardFunctionError, match=r"failed on 1 of 1 .*TypeError: reward must be a number") as e:
        mgr.compute(_batch(["x"]))
    assert isinstance(e.value.__cause__, TypeError)


def test_in_process_timeout_with_hanging_function():
    release = threading.Event()

    def hang_on_h(data_source, solution_str, ground_truth, extra_info=None):
        if solution_str.startswith("h"):
            release.wait(60)  # "hangs" (released at the end of the test so the thread exits)
            return 1.0
        return 0.5

    mgr = RewardManager(hang_on_h, CharTokenizer(), num_workers=0, timeout_s=0.2)
    try:
        t0 = time.monotonic()
        out = mgr.compute(_batch(["h1", "a", "b", "c"]))
        took = time.monotonic() - t0
        assert took < 5, f"a hung call blocked the batch for {took:.1f} s"
        np.testing.assert_array_equal(out.scores, [0, 0.5, 0.5, 0.5])
        assert out.metrics["reward/num_timeouts"] == 1 and out.metrics["reward/num_errors"] == 1
        assert out.errors == ["row 0 (data_source='my/source'): reward call exceeded 0.2 s (in process)"]
        assert mgr._thread.num_abandoned == 1
        # a fresh helper thread scores the next calls; too many timeouts stop the run
        with pytest.raises(RewardFunctionError, match=r"2 of 3 responses \(67%, 2 timeouts.*exceeded 0.2 s"):
            mgr.compute(_batch(["h2", "h3", "a"]))
    finally:
        release.set()
        mgr.close()


def test_thread_caller_results():
    caller = ThreadCaller(lambda x: 1 / x, timeout_s=5.0)
    assert caller.call((2,)).value == 0.5
    res = caller.call((0,))
    assert res.status == "error" and res.message == "ZeroDivisionError: division by zero"
    assert isinstance(res.exception, ZeroDivisionError) and "1 / x" in res.traceback
    caller.close()
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        ThreadCaller(print, 0)


def test_reward_registry_and_unknown_sources():
    assert get_reward_fn("openai/gsm8k") is get_reward_fn("gsm8k")
    assert get_reward_fn("reasoning_gym/basic_arithmetic") is get_reward_fn("reasoning_gym")
    check_data_sources(["openai/gsm8k", "lighteval/MATH", "reasoning_gym/chain_sum", "gsm8k"])
    with pytest.raises(UnknownDataSourceError) as e:
        check_data_sources(["openai/gsm8k", "my/src", "other", "my/src"])
    msg = str(e.value)
    assert msg.startswith("No reward function for data_sources ['my/src', 'other']. Known data sources: [")
    assert "'openai/gsm8k'" in msg and "'reasoning_gym/<task>'" in msg and "custom_reward_function.path" in msg
    assert known_data_sources()[:2] == ["openai/gsm8k", "gsm8k"]
    with pytest.raises(NotImplementedError, match="data_source='nope'"):  # still a NotImplementedError (verl)
        default_compute_score("nope", "x", "y")


NONFINITE_SRC = textwrap.dedent(
    """
    import os
    import sys

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        if solution_str.startswith("nan"):
            return float("nan")
        if solution_str.startswith("inf"):
            return {"score": float("-inf"), "acc": 1.0}
        if solution_str.startswith("exit"):
            os._exit(3)
        if solution_str.startswith("sysexit"):
            sys.exit(4)
        return 0.5
    """
)


def test_nonfinite_reward_is_a_failure_in_process(tmp_path):
    """NaN / inf from a reward function (plain or a dict's 'score') is a failed call, as the remote client's: scored
    0 and counted in reward/num_errors; past max_error_fraction the batch raises naming the function and the
    value. A `sys.exit` in process is a failed call too, not the end of the trainer."""
    path = tmp_path / "nonfinite.py"
    path.write_text(NONFINITE_SRC)
    mgr = RewardManager(load_custom_reward_fn(str(path)), CharTokenizer(), num_workers=0, timeout_s=5.0)
    out = mgr.compute(_batch(["ok1", "nan1", "ok2", "inf1"]))  # 2 of 4: at the limit, not over it
    np.testing.assert_array_equal(out.scores, [0.5, 0, 0.5, 0])
    assert np.isfinite(out.token_level_scores).all()
    assert out.metrics["reward/num_errors"] == 2 and out.metrics["reward/num_timeouts"] == 0
    assert out.errors == [
        "row 1 (data_source='my/source'): ValueError: reward nan is not a finite number",
        "row 3 (data_source='my/source'): ValueError: reward -inf is not a finite number",
    ]
    with pytest.raises(RewardFunctionError) as e:
        mgr.compute(_batch(["nan", "ok", "nan"]))
    assert str(e.value) == (
        f"reward function 'compute_score' from {path} (custom_reward_function) failed on 2 of 3 responses (67%, 0 "
        "timeouts; limit reward_model.max_error_fraction=0.5). First failure, row 0 (data_source='my/source'), in "
        "process: ValueError: reward nan is not a finite number"
    )
    out = mgr.compute(_batch(["sysexit", "ok", "ok"]))  # SystemExit would otherwise end the trainer
    assert out.errors == ["row 0 (data_source='my/source'): the function called sys.exit(4)"]
    mgr.close()


def test_nonfinite_reward_and_process_exit_in_a_worker(tmp_path):
    """In a reward worker: NaN is a failed call as in process; a call that ends its process (`os._exit(3)`) is
    reported as such (the worker is replaced) and past max_error_fraction stops the batch naming the exit code."""
    path = tmp_path / "nonfinite.py"
    path.write_text(NONFINITE_SRC)
    mgr = RewardManager(load_custom_reward_fn(str(path)), CharTokenizer(), num_workers=1, timeout_s=60.0)
    try:
        out = mgr.compute(_batch(["ok", "nan", "exit", "ok"]))
        np.testing.assert_array_equal(out.scores, [0.5, 0, 0, 0.5])
        assert out.metrics["reward/num_errors"] == 2
        assert out.errors == [
            "row 1 (data_source='my/source'): ValueError: reward nan is not a finite number",
            "row 2 (data_source='my/source'): reward worker died (exit code 3)",
        ]
        with pytest.raises(
            RewardFunctionError, match=r"failed on 2 of 3 .* in worker processes: ValueError: reward nan"
        ):
            mgr.compute(_batch(["nan", "ok", "inf"]))
        with pytest.raises(RewardFunctionError, match=r"failed on 2 of 2 .* in worker processes: reward worker died"):
            mgr.compute(_batch(["exit", "exit"]))
    finally:
        mgr.close()


def test_user_reward_in_process_says_it_is_unprotected(tmp_path, caplog):
    """num_workers=0 with a user's reward file: one warning at construction that a call ending the process ends
    the run without a message, and how to run it in workers; none for the project's own toy rewards (:tiny)."""
    import logging
    import os

    path = tmp_path / "nonfinite.py"
    path.write_text(NONFINITE_SRC)
    with caplog.at_level(logging.WARNING, logger="jaxrl_post.rewards.inprocess"):
        RewardManager(load_custom_reward_fn(str(path)), CharTokenizer(), num_workers=0).close()
        assert len(caplog.records) == 1
        msg = caplog.records[0].getMessage()
        assert msg.startswith(f"reward: 'compute_score' from {path} runs in the trainer process")
        assert "os._exit" in msg and "--config.reward_model.num_workers=2" in msg
        caplog.clear()
        repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        tiny = load_custom_reward_fn(os.path.join(repo, "configs", "tiny_reward.py"))
        RewardManager(tiny, CharTokenizer(), num_workers=0).close()
        RewardManager(lambda *a: 1.0, CharTokenizer(), num_workers=0).close()  # a function passed in code
        assert caplog.records == []
