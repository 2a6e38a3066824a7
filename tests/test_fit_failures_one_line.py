"""main(): failures of `fit` the user can act on are one `error:` line (exit 2), the traceback in error.log."""

import os

import pytest


def test_failures_during_training_are_one_line(tmp_path, monkeypatch, capsys):
    """main() when fit() fails in a way the user can act on: a reward function returning NaN, a tool failing on
    most calls, dynamic sampling that finds too few groups, a full disk (ENOSPC). Each is one `error:` line on
    stderr and exit 2, the trainer closed; the full disk names the file and the last intact checkpoint, removes
    the partial save and puts the traceback in <run>/error.log."""
    import errno

    import jax.numpy as jnp

    from configs import grpo
    from jaxrl_post import main as main_mod
    from jaxrl_post.engine.run.checkpoint import Checkpointer
    from jaxrl_post.errors import FilterGroupsError
    from jaxrl_post.rewards import RewardManager
    from jaxrl_post.rl import trainer as trainer_mod
    from jaxrl_post.rollout.tools import ToolErrorBudget
    from tests.rewards.test_reward_failures import CharTokenizer, _batch

    run_dir = tmp_path / "run"
    ckpt = Checkpointer(str(run_dir / "checkpoints"), max_to_keep=None)
    ckpt.save(1, {"host": {}, "actor": {"w": jnp.ones((4,))}})
    ckpt.wait_until_finished()
    nan_mgr = RewardManager(lambda *a: float("nan"), CharTokenizer(), num_workers=0)

    def tool_failure():
        budget = ToolErrorBudget(0.5)
        for _ in range(7):
            budget.add("error", "tool 'lookup': Error: KeyError: 'x'\n(more text)")
        budget.check()

    def disk_full():
        (run_dir / "checkpoints" / "global_step_2.orbax-checkpoint-tmp").mkdir()  # a partial save
        raise OSError(errno.ENOSPC, "No space left on device", str(run_dir / "metrics.jsonl"))

    c = grpo.get_config("tiny")
    c.trainer.default_local_dir = str(run_dir)
    monkeypatch.setattr(main_mod, "_CONFIG", type("F", (), {"value": c})())
    monkeypatch.setattr(main_mod, "_STOP", None)
    for fail, expected in [
        (
            lambda: nan_mgr.compute(_batch(["a", "b"])),
            "error: reward function test_failures_during_training_are_one_line.<locals>.<lambda> failed on 2 of 2 "
            "responses (100%, 0 timeouts; limit reward_model.max_error_fraction=0.5). First failure, row 0 "
            "(data_source='my/source'), in process: ValueError: reward nan is not a finite number",
        ),
        (
            tool_failure,
            "error: 7 of 7 tool calls failed in this step (0 timeouts; limit rollout.multi_turn.max_error_fraction=0.5)"
            ". First failure: tool 'lookup': Error: KeyError: 'x' (more text)",
        ),
        (
            lambda: (_ for _ in ()).throw(FilterGroupsError("3 generation batches gave 1 of 4 groups")),
            "error: 3 generation batches gave 1 of 4 groups",
        ),
        (
            disk_full,
            f"error: writing {run_dir / 'metrics.jsonl'} failed: no space left on device; the last complete "
            f"checkpoint {run_dir / 'checkpoints' / 'global_step_1'} is intact. Free disk space, then rerun the "
            f"command to resume (traceback: {run_dir / 'error.log'})",
        ),
    ]:
        closed = []

        class FakeTrainer:  # fit() fails as the real one would, from inside the step
            global_steps, resumed_from, checkpointer = 1, None, ckpt

            def __init__(self, cfg):
                pass

            def fit(self, stop=None, fail=fail):
                return fail()

            def close(self, closed=closed):
                closed.append(True)

        monkeypatch.setattr(trainer_mod, "RLTrainer", FakeTrainer)
        with pytest.raises(SystemExit) as e:
            main_mod.main([])
        assert e.value.code == 2 and closed == [True]
        assert capsys.readouterr().err.splitlines() == [expected]
    log = (run_dir / "error.log").read_text()
    assert "Traceback (most recent call last)" in log and "in disk_full" in log and "No space left" in log
    assert os.listdir(run_dir / "checkpoints") == ["global_step_1"]
    ckpt.close()


def test_orbax_tracebacks_are_kept_for_the_error_log(monkeypatch):
    """A failed save's noise: orbax's ERROR records with a traceback and tensorstore's unraisable "Event loop is
    closed" errors are kept (for error.log), everything else reaches the console as before."""
    import logging
    import sys
    from types import SimpleNamespace

    from jaxrl_post.engine.run.error_log import OrbaxTracebacks

    passed = []
    monkeypatch.setattr(sys, "unraisablehook", passed.append)
    f = OrbaxTracebacks()
    try:
        raise OSError(28, "No space left on device")
    except OSError:
        exc_info = sys.exc_info()
    orbax_file = os.path.join("site-packages", "orbax", "checkpoint", "x.py")

    def record(path, level, exc):
        return logging.LogRecord("absl", level, path, 1, "save failed", None, exc)

    assert f.filter(record(orbax_file, logging.ERROR, exc_info)) is False
    assert f.filter(record(orbax_file, logging.WARNING, exc_info)) is True  # warnings pass
    assert f.filter(record(orbax_file, logging.ERROR, None)) is True  # an error without a traceback passes
    assert f.filter(record("jaxrl_post/x.py", logging.ERROR, exc_info)) is True  # not orbax's
    closed = SimpleNamespace(exc_type=RuntimeError, exc_value=RuntimeError("Event loop is closed"), exc_traceback=None)
    other = SimpleNamespace(exc_type=ValueError, exc_value=ValueError("x"), exc_traceback=None)
    f.unraisable(closed)
    f.unraisable(other)
    assert passed == [other] and len(f.records) == 2
    assert "save failed" in f.records[0] and "OSError: [Errno 28] No space left on device" in f.records[0]
    assert f.records[1].strip() == "RuntimeError: Event loop is closed"
    # asyncio's "Task exception was never retrieved" for one of orbax's write tasks: kept; another task's: passes
    ns = {}
    exec(compile("def write():\n    raise OSError(28, 'No space left on device')\n", orbax_file, "exec"), ns)
    try:
        ns["write"]()
    except OSError:
        orbax_exc = sys.exc_info()
    task = lambda exc: logging.LogRecord("asyncio", logging.ERROR, "base_events.py", 1, "Task exception", None, exc)
    assert f.filter(task(orbax_exc)) is False and len(f.records) == 3
    assert f.filter(task(exc_info)) is True
