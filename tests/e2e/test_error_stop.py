"""A run stopped by an error keeps its completed steps; resuming with another config says so.

* A reward function that starts failing mid-run (`RewardFunctionError`): the last completed step is
  checkpointed before the error propagates (RNG and data position put back), and resuming with a working
  reward repeats exactly the uninterrupted run. Also when the failure is in the validation after a step.
* `python -m jaxrl_post.main`: exit 1 with the traceback and one line saying where the step was saved; a
  rerun with other overrides warns with the changed keys and keeps the previous config.json; a model that
  does not fit the checkpoint is one `error:` line (exit 2), no orbax shutdown noise.

Reuses test_resume.py's tiny config, XLA cache and straight 4-step run.
"""

import json
import os
import subprocess
import sys

import pytest
from test_resume import REPO, _assert_bitwise, _cfg, _host, _read_jsonl, _strip_time, jax_cache, straight_run

from jaxrl_post.engine.run import checkpoint as ckpt

__all__ = ["jax_cache", "straight_run"]  # module fixtures used here

_FLAKY = """
import importlib.util, os
_spec = importlib.util.spec_from_file_location("_tiny_reward", {tiny!r})
_tiny = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_tiny)

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if os.path.exists({marker!r}):
        raise RuntimeError("reward service down")
    return _tiny.compute_score(data_source, solution_str, ground_truth, extra_info)
"""


def _flaky_reward(tmp_path):
    from configs import grpo

    marker = tmp_path / "broken"
    path = tmp_path / "flaky_reward.py"
    path.write_text(_FLAKY.format(tiny=grpo.TINY_REWARD, marker=str(marker)))
    return str(path), marker


@pytest.mark.slow
def test_reward_failure_saves_the_last_step_and_resume_is_exact(straight_run, tmp_path):
    from configs import grpo
    from jaxrl_post.rewards import RewardFunctionError
    from jaxrl_post.rl.trainer import RLTrainer

    reward, marker = _flaky_reward(tmp_path)
    workdir = tmp_path / "run"
    lines = []
    cfg = _cfg(workdir, **{"custom_reward_function.path": reward, "trainer.save_freq": 100})
    t = RLTrainer(cfg, console_write=lines.append)
    try:
        h1 = t.fit(max_steps=2)["history"]
        marker.write_text("")  # the reward function raises from step 3 on
        with pytest.raises(RewardFunctionError, match="reward service down"):
            t.fit()
    finally:
        t.close()
    root = workdir / "checkpoints"
    assert ckpt.list_complete_steps(root) == [2]  # save_freq=100: only the step saved on the error
    assert lines[-1] == (
        f"stopped by an error in step 3; checkpoint of step 2 saved to {root / 'global_step_2'}; "
        "fix the cause and rerun the same command to resume"
    )
    marker.unlink()

    t2 = RLTrainer(_cfg(workdir), console_write=lines.append)  # the working (tiny) reward again
    try:
        assert t2.global_steps == 2
        h2 = t2.fit()["history"]
        params, opt_state = _host(t2.state.actor.params), _host(t2.state.actor.opt_state)
    finally:
        t2.close()
    a = straight_run
    assert [_strip_time(m) for m in h1 + h2] == [_strip_time(m) for m in a["history"]]
    _assert_bitwise(params, a["params"])
    _assert_bitwise(opt_state, a["opt_state"])
    steps_logged = [r["step"] for r in _read_jsonl(workdir / "metrics.jsonl") if "critic/score/mean" in r]
    assert steps_logged == [1, 2, 3, 4]
    # the resume used another reward path and save_freq: one warning names both (and nothing else)
    (warn,) = [s for s in lines if s.startswith("warning: resuming")]
    assert warn.splitlines()[1:] == [
        f"  custom_reward_function.path: {json.dumps(reward)} -> {json.dumps(grpo.TINY_REWARD)}",
        "  trainer.save_freq: 100 -> 2",
    ]


@pytest.mark.slow  # two tiny trainers built and run (66 s on 2 shared, loaded cores)
def test_reward_failure_in_validation_logs_and_saves_the_step(jax_cache, tmp_path):
    from jaxrl_post.rewards import RewardFunctionError
    from jaxrl_post.rl.trainer import RLTrainer

    lines = []
    t = RLTrainer(_cfg(tmp_path, **{"trainer.save_freq": 100}), console_write=lines.append)

    def broken_validate():
        raise RewardFunctionError("validation reward failed")

    t.validate = broken_validate  # test_freq=2: the validation after step 2 fails
    try:
        with pytest.raises(RewardFunctionError):
            t.fit()
    finally:
        t.close()
    assert t.global_steps == 2
    assert ckpt.list_complete_steps(tmp_path / "checkpoints") == [2]
    assert lines[-1].startswith("stopped by an error in the validation after step 2; checkpoint of step 2 saved to")
    steps_logged = [r["step"] for r in _read_jsonl(tmp_path / "metrics.jsonl") if "critic/score/mean" in r]
    assert steps_logged == [1, 2]  # the step's line is there, a resumed run continues with step 3


_COUNTING = """
import importlib.util
_spec = importlib.util.spec_from_file_location("_tiny_reward", {tiny!r})
_tiny = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_tiny)
CALLS = 0

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    global CALLS
    CALLS += 1
    if CALLS > {ok_calls}:  # in process (tiny: reward_model.num_workers=0): steps 1-2 work, step 3 fails
        raise RuntimeError("reward service down")
    return _tiny.compute_score(data_source, solution_str, ground_truth, extra_info)
"""


@pytest.mark.slow
def test_main_reward_failure_config_change_and_model_mismatch(jax_cache, tmp_path):
    from configs import grpo

    c = grpo.get_config("tiny")
    reward = tmp_path / "counting_reward.py"
    reward.write_text(_COUNTING.format(tiny=grpo.TINY_REWARD, ok_calls=2 * c.data.train_batch_size * c.rollout.n))
    workdir = tmp_path / "run"
    base = [
        sys.executable,
        "-m",
        "jaxrl_post.main",
        "--config=configs/grpo.py:tiny",
        f"--config.trainer.default_local_dir={workdir}",
        f"--config.custom_reward_function.path={reward}",
        "--config.trainer.total_training_steps=4",
        "--config.trainer.save_freq=100",
        "--config.trainer.val_before_train=False",
        "--config.trainer.val_at_end=False",
    ]
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR=jax_cache)
    env.update(JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    run = lambda *extra: subprocess.run(
        base + list(extra), cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    root = workdir / "checkpoints"

    r = run()
    assert r.returncode == 2, r.stderr[-3000:]  # the user's reward code failed: exit 2, its error first
    err = r.stderr[r.stderr.index("error: reward function") :]
    assert "RuntimeError: reward service down" in err and "the reward function's traceback:" in err
    assert (
        f"stopped by an error in step 3; checkpoint of step 2 saved to {root / 'global_step_2'}; fix the cause "
        "and rerun the same command to resume"
    ) in r.stdout
    assert ckpt.list_complete_steps(root) == [2]
    first_config = (workdir / "config.json").read_text()

    # a rerun with other overrides (training already finished at step 2): warned, previous config.json kept
    r = run("--config.actor.optim.lr=0.5", "--config.rollout.n=2", "--config.trainer.total_training_steps=2")
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout.splitlines()
    assert f"resumed from step 2 ({root / 'global_step_2'})" in out
    i = out.index(
        f"warning: resuming from {root / 'global_step_2'} with a config that differs from the config saved with "
        "it in 2 key(s) (the steps so far were trained with the old values):"
    )
    assert out[i + 1 : i + 3] == ["  actor.optim.lr: 0.001 -> 0.5", "  rollout.n: 4 -> 2"]
    assert any(s.startswith("training already finished at step 2 (total_training_steps=2); ") for s in out)
    (aside,) = [
        n for n in os.listdir(workdir) if n.startswith("config.") and n.endswith(".json") and n != "config.json"
    ]
    assert (workdir / aside).read_text() == first_config
    assert json.loads((workdir / "config.json").read_text())["actor"]["optim"]["lr"] == 0.5

    # back to the run's own config: no warning (compared with the config saved in the checkpoint, not with
    # config.json, which the previous start rewrote)
    r = run("--config.trainer.total_training_steps=2")  # (a changed total is never warned about)
    assert r.returncode == 0 and "warning:" not in r.stdout, (r.stdout, r.stderr[-3000:])

    # a model that does not fit the checkpoint: one plain error line, exit 2, no orbax shutdown noise
    r = run("--config.model.arch.intermediate_size=64")
    assert r.returncode == 2, r.stderr[-3000:]
    assert r.stderr.strip().splitlines()[-1] == (
        "error: the checkpoint's model does not match the config: intermediate_size: checkpoint 128, config 64 "
        f"(checkpoint {root / 'global_step_2'}); pass the run's model config (--config.model.*) or "
        "--config.trainer.resume_mode=disable (the old run is moved aside)"
    )
    assert "Traceback" not in r.stderr and "Exception ignored" not in r.stderr


@pytest.mark.slow  # one tiny run of 2 steps in a subprocess (about 70 s on 2 shared, loaded cores)
def test_main_full_disk_during_a_checkpoint_is_one_line(tmp_path):
    """The run directory on a 1.8 MB tmpfs: step 1's checkpoint (about 1.2 MB) fits, step 2's does not. One
    `error:` line naming the directory and the last intact checkpoint, exit 2, no traceback on the console (it
    is in <run>/error.log, with orbax's), step 2's partial save removed, step 1 resumable. The run also takes
    `--config.trainer.max_actor_ckpt_to_keep=None` (documented "None = all") as None."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs (a disk that fills up) needs root")
    disk = tmp_path / "disk"
    disk.mkdir()
    m = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1800k", "tmpfs", str(disk)], capture_output=True, text=True)
    if m.returncode != 0:
        pytest.skip(f"mount -t tmpfs is not permitted here ({m.stderr.strip()})")
    try:
        workdir, root = disk / "run", disk / "run" / "checkpoints"
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "jaxrl_post.main",
                "--config=configs/grpo.py:tiny",
                f"--config.trainer.default_local_dir={workdir}",
                "--config.trainer.save_freq=1",
                "--config.trainer.max_actor_ckpt_to_keep=None",
                "--config.trainer.val_before_train=False",
                "--config.trainer.val_at_end=False",
            ],
            cwd=REPO,
            env=dict(os.environ, JAX_PLATFORMS="cpu"),
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert r.returncode == 2, r.stderr[-3000:]
        errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
        assert errors == [
            f"error: saving a checkpoint to {root} failed: no space left on device; the last complete checkpoint "
            f"{root / 'global_step_1'} is intact. Free disk space, then rerun the command to resume (traceback: "
            f"{workdir / 'error.log'})"
        ], r.stderr[-3000:]
        assert "Traceback" not in r.stderr and "Event loop is closed" not in r.stderr, r.stderr[-3000:]
        log = (workdir / "error.log").read_text()
        assert "Traceback (most recent call last)" in log and "No space left on device" in log
        assert ckpt.list_complete_steps(root) == [1] and ckpt.unfinished_steps(root) == []
        assert json.loads((workdir / "config.json").read_text())["trainer"]["max_actor_ckpt_to_keep"] is None
    finally:
        subprocess.run(["umount", str(disk)], check=False)


def test_tool_error_in_a_step_or_validation_saves_the_last_step():
    """A tool failing on most calls (`ToolError`, raised by the rollout before any update) is handled like a
    reward function's failure: RNG and data position put back, the last completed step checkpointed, one line,
    the error re-raised (main prints it as one `error:` line); in the validation after a step, that step's
    metrics are logged first."""
    from types import SimpleNamespace

    from jaxrl_post.engine.run.run_dir import RunDir
    from jaxrl_post.rollout.tools import ToolError

    said, saved, restored, logged = [], [], [], []
    fake = SimpleNamespace(
        say=said.append,
        checkpointer=SimpleNamespace(step_path=lambda s: f"/ck/global_step_{s}", wait_until_finished=lambda: None),
        tracker=SimpleNamespace(log=lambda m, step: logged.append((step, m))),
    )
    fake.save_after_error = lambda where, step, save: RunDir.save_after_error(fake, where, step, save)
    save = lambda: saved.append(True) or True
    guard = RunDir.save_on_error_in_step(fake, 2, lambda: "marks", "snapshot", restored.append, save)
    with pytest.raises(ToolError, match="7 of 7"), guard:
        raise ToolError("7 of 7 tool calls failed in this step")
    assert restored == ["snapshot"] and saved == [True]
    assert said == [
        "stopped by an error in step 3; checkpoint of step 2 saved to /ck/global_step_2; fix the cause and rerun the "
        "same command to resume"
    ]
    with pytest.raises(ToolError), RunDir.save_on_error_in_validation(fake, 2, {"score": 0.5}, save):
        raise ToolError("7 of 7 tool calls failed in this step")
    assert logged == [(2, {"score": 0.5})] and len(saved) == 2
    assert said[-1].startswith("stopped by an error in the validation after step 2; checkpoint of step 2 saved")
