"""SIGINT / SIGTERM: `interrupt.GracefulStop` in process, and the main job in a subprocess (tiny config):
Ctrl-C after a step -> checkpoint + one line + exit 130, rerun resumes; SIGTERM -> 143; a signal during
start-up or the first compile -> exit 130 at once, nothing saved, no traceback."""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from jaxrl_post.engine.interrupt import GracefulStop, exit_code_for
from jaxrl_post.engine.run import checkpoint as ckpt

# steps of the interrupted runs (~0.25 s each): long enough to interrupt, short enough to finish; 20 = the rerun
# writes the checkpoints of steps 10 and 20 (save_freq 10), so the 2-newest retention has deleted step n's (n < 10)
TOTAL = 20


# ----------------------------------------------------------------------------------------- in process
@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_graceful_stop_defers_after_a_step_and_aborts_before(sig, code):
    lines, exits = [], []
    before = signal.getsignal(sig)
    with GracefulStop("nothing saved", write=lines.append, hard_exit=exits.append) as stop:
        assert not stop.requested and stop.exit_code is None
        os.kill(os.getpid(), sig)  # before defer(): print the abort line, exit at once
        assert (lines, exits) == (["nothing saved"], [code]) and stop.exit_code == code
    assert signal.getsignal(sig) is before  # handlers restored

    lines, exits = [], []
    with GracefulStop("x", write=lines.append, hard_exit=exits.append) as stop:
        stop.defer()
        os.kill(os.getpid(), sig)  # after defer(): only recorded, the loop saves and stops
        assert stop.requested and stop.signum == sig and stop.exit_code == code
        name = signal.Signals(sig).name
        ack = (
            f"{name} received: finishing the current step, then saving a checkpoint "
            f"({name} again quits now without saving)"
        )
        assert (lines, exits) == ([ack], [])  # acknowledged at once, no exit
        os.kill(os.getpid(), signal.SIGINT)  # a second signal forces the exit (with the first one's code)
        assert exits == [code] and lines == [ack, "second SIGINT: exiting now; nothing more is saved"]
    assert exit_code_for(signal.SIGINT) == 130 and exit_code_for(signal.SIGTERM) == 143


_INTERRUPTED_SAVE = """
import os, sys, numpy as np
from jaxrl_post.main import lost_line
from jaxrl_post.engine.run.checkpoint import Checkpointer
from jaxrl_post.engine.interrupt import GracefulStop
Checkpointer(sys.argv[1], async_save=False).save(1, {"host": {}, "x": np.zeros((4,), np.float32)})
c = Checkpointer(sys.argv[1], async_save=True)
trainer = type("T", (), {"global_steps": 2, "checkpointer": c})()
c.save(2, {"host": {}, "x": np.zeros((8_000_000,), np.float32)})  # 32 MB, written in the background
stop = GracefulStop(write=lambda s: print(s, flush=True))
stop.lost_line = lambda: lost_line(trainer)
with stop:
    stop.defer()
    os.kill(os.getpid(), 2)  # the first Ctrl-C: recorded (the loop has saved, close() now waits)
    os.kill(os.getpid(), 2)  # the second, while step 2 is written: exits at once, saying what is lost
"""


def test_second_signal_during_a_save_says_what_is_lost_and_the_rerun_names_the_lost_step(tmp_path):
    from jaxrl_post.main import lost_line

    root = tmp_path / "checkpoints"
    proc = subprocess.run(
        [sys.executable, "-c", _INTERRUPTED_SAVE, str(root)],
        cwd=REPO,
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 130, proc.stderr[-2000:]
    assert proc.stdout.splitlines()[-1] == (
        f"second SIGINT: exiting now; the checkpoint of step 2 being written ({root / 'global_step_2'}) is lost; "
        f"a rerun resumes from step 1 ({root / 'global_step_1'})"
    )
    assert sorted(os.listdir(root)) == ["global_step_1", "global_step_2.orbax-checkpoint-tmp"]
    # the rerun: one line naming the lost step, the leftover removed, step 1 still the one to resume
    assert ckpt.unfinished_steps(root) == [(2, str(root / "global_step_2.orbax-checkpoint-tmp"))]
    line = ckpt.report_unfinished(root, 1)
    assert line == (
        "the checkpoint of step 2 was never finished (its save was interrupted: a second Ctrl-C, a kill or a crash "
        f"while writing); step 2 is lost and its partial directory was removed (global_step_2.orbax-checkpoint-tmp "
        f"in {root}); resuming from step 1"
    )
    assert os.listdir(root) == ["global_step_1"] and ckpt.report_unfinished(root, 1) is None
    c = ckpt.Checkpointer(root, read_only=True)
    assert c.all_steps() == [1] and c.pending_step() is None
    # no save in flight: the steps after the last complete checkpoint are what is lost
    t = type("T", (), {"global_steps": 3, "checkpointer": c})()
    assert lost_line(t) == (
        f"steps 2-3 (not checkpointed) lost; a rerun resumes from step 1 ({root / 'global_step_1'})"
    )
    t.global_steps = 1
    assert lost_line(t) == f"nothing is lost: step 1 is saved ({root / 'global_step_1'})"


def test_reward_workers_ignore_sigint():
    """Ctrl-C reaches the worker processes too: they keep running and the trainer stops them itself."""
    import operator

    from jaxrl_post.rewards.pool import RewardWorkerPool

    with RewardWorkerPool(operator.add, num_workers=1, timeout_s=30) as pool:
        assert [r.value for r in pool.map([(1, 2)])] == [3]
        (w,) = pool._workers
        os.kill(w.proc.pid, signal.SIGINT)
        time.sleep(0.5)
        assert w.proc.is_alive() and [r.value for r in pool.map([(2, 3)])] == [5] and pool.num_restarts == 0
    assert w.proc.exitcode == 0  # stopped by the pool's close(), not by the signal


# ----------------------------------------------------------------------------------------- subprocess
@pytest.fixture(scope="module")
def env(tmp_path_factory):
    # the second and later runs load compiled steps: the session's cache (tests/conftest.py; shared with the other
    # files that run the tiny GRPO job), else one for this module
    cache = os.environ.get("JAX_COMPILATION_CACHE_DIR") or str(tmp_path_factory.mktemp("jax_cache"))
    return dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        HF_HUB_OFFLINE="1",
        JAX_COMPILATION_CACHE_DIR=cache,
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
        JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
    )


def _cmd(workdir, *extra):
    return [
        sys.executable,
        "-m",
        "jaxrl_post.main",
        "--config=configs/grpo.py:tiny",
        f"--config.trainer.default_local_dir={workdir}",
        f"--config.trainer.total_training_steps={TOTAL}",
        "--config.trainer.val_before_train=False",
        "--config.trainer.val_at_end=False",
        *extra,
    ]


class _Run:
    """The job in its own process group (as a terminal runs it); output lines with their arrival time."""

    def __init__(self, cmd, env):
        self.t0 = time.monotonic()
        self.p = subprocess.Popen(
            cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
        )
        self.lines: list[tuple[float, str]] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        for line in self.p.stdout:
            self.lines.append((time.monotonic(), line.rstrip("\n")))

    def wait_for(self, prefix, timeout=240):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.p.poll() is None:
            if any(s.startswith(prefix) for _, s in self.lines):
                return
            time.sleep(0.01)
        raise AssertionError(f"no line starting with {prefix!r}; rc={self.p.poll()}\n{self.text[-3000:]}")

    def finish(self, timeout=240):
        rc = self.p.wait(timeout=timeout)
        self._reader.join(timeout=10)
        return rc, time.monotonic()

    @property
    def text(self):
        return "\n".join(s for _, s in self.lines)


def _assert_clean(text):
    for bad in ("Traceback", "KeyboardInterrupt", "Segmentation fault", "Exception ignored"):
        assert bad not in text, text[-3000:]


def _score_steps(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [r["step"] for r in map(json.loads, f) if "critic/score/mean" in r]


@pytest.mark.slow
def test_sigint_after_a_step_saves_exits_130_and_rerun_resumes(env, tmp_path):
    workdir = str(tmp_path / "run")
    cmd = _cmd(workdir, "--config.reward_model.num_workers=2")  # reward worker processes get Ctrl-C too
    run = _Run(cmd, env)
    run.wait_for("step 1 |")
    t_sig = time.monotonic()
    os.killpg(run.p.pid, signal.SIGINT)  # what Ctrl-C in a terminal does: the whole process group
    rc, t_exit = run.finish()
    assert rc == 130, run.text[-3000:]
    _assert_clean(run.text)
    stop_lines = [s for _, s in run.lines if s.startswith("interrupted")]
    assert len(stop_lines) == 1, run.text[-3000:]
    ack = [s for _, s in run.lines if s.startswith("SIGINT received: finishing the current step")]
    assert len(ack) == 1, run.text[-3000:]  # said at once, not only when the step ends
    n = int(stop_lines[0].split()[3].rstrip(";"))
    root = os.path.join(workdir, "checkpoints")
    assert stop_lines[0] == (
        f"interrupted at step {n}; checkpoint saved to {os.path.join(root, f'global_step_{n}')}; "
        "rerun the same command to resume"
    )
    assert 1 <= n < TOTAL - 10 and ckpt.list_complete_steps(root) == [n]  # n: deleted by the rerun's retention
    assert t_exit - t_sig < 15, t_exit - t_sig  # the current step (~0.3 s) + the save + shutting down
    print(f"SIGINT -> exit: {t_exit - t_sig:.2f} s (stopped after step {n})")

    again = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-3000:]
    resumed = [s for s in again.stdout.splitlines() if s.startswith("resumed from")]
    assert resumed == [f"resumed from step {n} of {TOTAL} ({os.path.join(root, f'global_step_{n}')})"]
    # defaults: a checkpoint every 10 steps, the newest 2 kept; older ones (and step n) are gone from disk
    assert sorted(os.listdir(root)) == [f"global_step_{TOTAL - 10}", f"global_step_{TOTAL}"]
    assert _score_steps(workdir) == list(range(1, TOTAL + 1))  # each step logged once, across both runs


@pytest.mark.slow
def test_sigterm_after_a_step_exits_143_with_a_checkpoint(env, tmp_path):
    workdir = str(tmp_path / "run")
    run = _Run(_cmd(workdir), env)
    run.wait_for("step 1 |")
    os.kill(run.p.pid, signal.SIGTERM)  # `kill PID`, `docker stop`: the main process only
    rc, _ = run.finish()
    assert rc == 143, run.text[-3000:]
    _assert_clean(run.text)
    (line,) = [s for _, s in run.lines if s.startswith("interrupted")]
    n = int(line.split()[3].rstrip(";"))
    assert f"checkpoint saved to {os.path.join(workdir, 'checkpoints', f'global_step_{n}')};" in line
    assert ckpt.list_complete_steps(os.path.join(workdir, "checkpoints")) == [n]


@pytest.mark.parametrize("when", ["start-up", "first compile"])
@pytest.mark.slow
def test_sigint_before_the_first_step_exits_130_without_saving(env, tmp_path, when):
    workdir = str(tmp_path / "run")
    run = _Run(_cmd(workdir), env)
    if when == "start-up":
        time.sleep(1.0)  # importing jax / building the trainer
        want = "interrupted during start-up; nothing was saved"
    else:
        run.wait_for("step 0 |")  # data statistics are logged just before step 1 compiles
        want = "interrupted before the first step finished; nothing was saved"
    t_sig = time.monotonic()
    os.killpg(run.p.pid, signal.SIGINT)
    rc, t_exit = run.finish()
    assert rc == 130, run.text[-3000:]
    _assert_clean(run.text)
    assert [s for _, s in run.lines if s.startswith("interrupted")] == [want], run.text[-3000:]
    assert t_exit - t_sig < 10  # right after the current XLA call, not after the whole step
    assert ckpt.list_complete_steps(os.path.join(workdir, "checkpoints")) == []


@pytest.mark.slow
def test_fit_saves_the_last_completed_step_and_stops(env, tmp_path):
    """fit(stop=...) with a stop requested during step 2: checkpoint of step 2 (save_freq off), no validation
    of step 2 (test_freq), loop ends.
    (Last in this file: it reads the tiny steps from the compilation cache the subprocesses filled.)"""
    import jax
    from jax._src import compilation_cache

    from configs import grpo
    from jaxrl_post.rl.trainer import RLTrainer

    class FakeStop:
        def __init__(self):
            self.deferred, self.calls = False, 0

        def defer(self):
            self.deferred, self.calls = True, self.calls + 1

        @property
        def requested(self):
            return self.calls >= 2

    c = grpo.get_config("tiny")
    c.trainer.default_local_dir = str(tmp_path)
    c.trainer.total_training_steps = 5
    c.trainer.save_freq = -1
    c.trainer.test_freq = 2  # step 2 would validate; a stop skips that, to save and exit sooner
    c.trainer.val_before_train = c.trainer.val_at_end = False
    names = {
        "jax_compilation_cache_dir": env["JAX_COMPILATION_CACHE_DIR"],
        "jax_persistent_cache_min_compile_time_secs": 0.0,
        "jax_persistent_cache_min_entry_size_bytes": 0,
    }
    old = {n: getattr(jax.config, n) for n in names}
    for n, v in names.items():
        jax.config.update(n, v)
    try:
        t = RLTrainer(c, console_write=lambda s: None)
        try:
            result = t.fit(stop=FakeStop())
        finally:
            t.close()
    finally:
        for n, v in old.items():
            jax.config.update(n, v)
        compilation_cache.reset_cache()
    assert result["stopped_at"] == 2 and len(result["history"]) == 2 and t.global_steps == 2
    assert "critic/score/mean" in result["history"][1] and not any(k.startswith("val-") for k in result["history"][1])
    assert ckpt.list_complete_steps(os.path.join(tmp_path, "checkpoints")) == [2]
