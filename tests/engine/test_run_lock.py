"""One run per working directory (`engine/run/run_lock.py`): a second live run refuses with one `error:` line
(exit 2) and moves nothing; a stale lock of a dead run is taken over with one line; the lock is released on
close, at exit and on the signal path (`interrupt.exit_now`)."""

import json
import os
import socket
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from jaxrl_post.engine.run.run_lock import LOCK_FILE, RunDirBusyError, RunLock, read_lock
from jaxrl_post.errors import ConfigError


def _earlier_run(run):
    """A run directory as an earlier (live) run leaves it: metrics.jsonl and a checkpoint step directory."""
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "critic/score/mean": 0.5}\n')
    (run / "checkpoints" / "global_step_1").mkdir(parents=True)
    return sorted(str(p.relative_to(run)) for p in run.rglob("*"))


def _lock_held_by(run, pid, host=None):
    info = {"pid": pid, "host": host or socket.gethostname(), "start": 0.0, "command": "python -m x", "token": "t"}
    (run / LOCK_FILE).write_text(json.dumps(info))


@pytest.fixture
def live_pid():
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    yield p.pid
    p.kill()
    p.wait()


def test_second_run_refuses_with_one_line_and_moves_nothing(tmp_path, live_pid):
    run = tmp_path / "run"
    before = _earlier_run(run)
    _lock_held_by(run, live_pid)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "jaxrl_post.main",
            "--config=configs/grpo.py:tiny",
            f"--config.trainer.default_local_dir={run}",
        ],
        cwd=REPO,
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [s for s in proc.stderr.splitlines() if s.strip()]
    assert len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith(f"error: config.trainer.default_local_dir={str(run)!r}: another run is using this ")
    assert f"pid {live_pid} on {socket.gethostname()}" in lines[0] and f"kill -INT {live_pid}" in lines[0]
    # nothing moved aside, the live run's lock untouched
    assert sorted(str(p.relative_to(run)) for p in run.rglob("*")) == sorted([*before, LOCK_FILE])
    assert read_lock(str(run))["pid"] == live_pid


def test_acquire_is_atomic_against_a_live_holder_and_takes_over_a_stale_one(tmp_path, live_pid):
    run = tmp_path / "run"
    run.mkdir()
    _lock_held_by(run, live_pid)
    with pytest.raises(RunDirBusyError) as e:
        RunLock.acquire(str(run))
    assert isinstance(e.value, ConfigError)  # main prints it as one `error:` line, exit 2
    assert read_lock(str(run))["pid"] == live_pid
    # a lock of another host cannot be checked: refused, with the file to delete
    _lock_held_by(run, 1, host="some-other-host")
    with pytest.raises(RunDirBusyError, match=f"if that run is gone, delete {run / LOCK_FILE}"):
        RunLock.acquire(str(run))
    # a dead pid on this host: stale, taken over with one line
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    _lock_held_by(run, dead.pid)
    lock, notice = RunLock.acquire(str(run), command="python -m jaxrl_post.main --config=c.py")
    assert notice == (
        f"{run / LOCK_FILE}: taking over the stale lock of a run that is no longer alive (pid {dead.pid} on "
        f"{socket.gethostname()}, started "
        f"{__import__('time').strftime('%Y-%m-%d %H:%M:%S', __import__('time').localtime(0))}: python -m x)"
    )
    d = read_lock(str(run))
    assert d["pid"] == os.getpid() and d["command"] == "python -m jaxrl_post.main --config=c.py"
    # a garbled lock (writer died mid-write) is stale too
    lock.release()
    assert not (run / LOCK_FILE).exists()
    (run / LOCK_FILE).write_text("")
    lock, notice = RunLock.acquire(str(run))
    assert "an unreadable lock" in notice
    # a release never removes another run's lock
    _lock_held_by(run, live_pid)
    lock.release()
    assert read_lock(str(run))["pid"] == live_pid


@pytest.mark.parametrize("how", ["exit_now", "atexit", "exception"])
def test_lock_released_at_exit(tmp_path, how):
    run = tmp_path / "run"
    run.mkdir()
    code = {
        "exit_now": "from jaxrl_post.engine.interrupt import exit_now; exit_now(130)",
        "atexit": "pass",
        "exception": "raise RuntimeError('boom')",
    }[how]
    prog = (
        "import os, sys\nfrom jaxrl_post.engine.run.run_lock import RunLock\n"
        f"lock, _ = RunLock.acquire({str(run)!r})\nassert os.path.exists({str(run / LOCK_FILE)!r})\n{code}\n"
    )
    proc = subprocess.run([sys.executable, "-c", prog], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == {"exit_now": 130, "atexit": 0, "exception": 1}[how], proc.stderr
    assert not (run / LOCK_FILE).exists()
