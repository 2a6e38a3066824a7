"""One run per working directory: `<trainer.default_local_dir>/run.lock`.

Two runs started into one directory would mix silently (the second moves the first's live
`metrics.jsonl` aside, both write `checkpoints/global_step_<N>`). A run therefore holds its directory
with a lock file, created atomically (`os.O_CREAT | os.O_EXCL`) before anything in it is moved aside,
holding JSON `{"pid", "host", "start", "command", "token"}`:

- a second live run refuses with one line naming the holder (`RunDirBusyError`, a `ConfigError`:
  `main.py` prints it as `error: ...` and exits 2) and touches nothing;
- a lock whose pid is not alive on this host (a run killed by SIGKILL, an OOM kill, a crash) is stale:
  the next run takes it over and says so in one line; a lock from another host cannot be checked and is
  refused (the message says which file to delete if that run is gone);
- the lock is released by `release()` (`RLTrainer.close()`), at interpreter exit (`atexit`), and by
  `interrupt.exit_now` (the signal path, which skips the interpreter's shutdown); a release removes the
  file only while it still holds this lock's token.

Multi-host runs: only process 0 locks (`distributed.is_main`); the others share its directory.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import shlex
import socket
import sys
import time
import uuid

from jaxrl_post.engine import interrupt
from jaxrl_post.errors import ConfigError

LOCK_FILE = "run.lock"

__all__ = ["LOCK_FILE", "RunDirBusyError", "RunLock", "check_not_busy", "read_lock"]


class RunDirBusyError(ConfigError):
    """Another live run holds `trainer.default_local_dir` (its `run.lock`)."""


def _pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists on this host (a zombie counts as gone)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by another user
        return True
    try:  # a zombie (exited, not yet reaped by its parent) holds nothing
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def read_lock(workdir: str) -> dict | None:
    """The lock's JSON (`pid`, `host`, `start`, `command`, `token`), `{}` when the file exists but is not
    readable JSON (its writer died between create and write), or None when there is no lock."""
    path = os.path.join(workdir, LOCK_FILE)
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        return None
    except OSError:
        return {}
    try:
        d = json.loads(text)
    except ValueError:
        return {}
    return d if isinstance(d, dict) else {}


def _holder(d: dict) -> str:
    start = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(d.get("start", 0))))
    return f"pid {d.get('pid')} on {d.get('host')}, started {start}: {d.get('command')}"


def _is_stale(d: dict) -> bool:
    """A lock of this host whose pid is gone, or an empty/garbled one (its writer died mid-write)."""
    if not d:
        return True
    return d.get("host") == socket.gethostname() and not _pid_alive(int(d.get("pid", -1)))


def _busy(workdir: str, d: dict) -> RunDirBusyError:
    path = os.path.join(workdir, LOCK_FILE)
    if d.get("host") != socket.gethostname():
        fix = f"if that run is gone, delete {path}"
    else:
        fix = f"wait for it, stop it (kill -INT {d.get('pid')}), or choose another directory"
    return RunDirBusyError(
        f"config.trainer.default_local_dir={workdir!r}: another run is using this directory ({_holder(d)}); "
        f"{fix} (--config.trainer.default_local_dir=runs/other_run)"
    )


def check_not_busy(workdir: str) -> None:
    """Raise `RunDirBusyError` when a live run holds `workdir` (read-only: called before the model loads;
    `RunLock.acquire` is the atomic check). A lock held by this process is not a conflict."""
    d = read_lock(workdir)
    if d is None or _is_stale(d) or (d.get("pid") == os.getpid() and d.get("host") == socket.gethostname()):
        return
    raise _busy(workdir, d)


class RunLock:
    """The lock of one run (see the module docstring). `acquire` creates it; `release` removes it."""

    def __init__(self, workdir: str, token: str):
        self.workdir = workdir
        self.path = os.path.join(workdir, LOCK_FILE)
        self.token = token
        self._pid = os.getpid()  # a forked child (reward workers) never releases its parent's lock
        self._released = False
        atexit.register(self.release)

        interrupt.at_exit_now(self.release)

    @classmethod
    def acquire(cls, workdir: str, command: str | None = None) -> tuple[RunLock, str | None]:
        """Create `<workdir>/run.lock` (the directory must exist).

        Returns:
          (the lock, a one-line notice when a stale lock of a dead run, or an earlier lock of this same
          process, was taken over, else None).

        Raises:
          RunDirBusyError: a live run (another pid, or a lock of another host) holds the directory.
          OSError: the file cannot be created.
        """
        path = os.path.join(workdir, LOCK_FILE)
        info = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "start": time.time(),
            "command": command or " ".join(shlex.quote(a) for a in sys.argv),
            "token": uuid.uuid4().hex,
        }
        notice = None
        for _ in range(3):
            try:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                d = read_lock(workdir)
                if d == {}:  # being written right now, or its writer died mid-write: look again shortly
                    time.sleep(0.2)
                    d = read_lock(workdir)
                if d is None:
                    continue
                mine = d.get("pid") == os.getpid() and d.get("host") == info["host"]
                if not mine and not _is_stale(d):
                    raise _busy(workdir, d) from None
                if not mine:
                    what = _holder(d) if d else "an unreadable lock"
                    notice = f"{path}: taking over the stale lock of a run that is no longer alive ({what})"
                with contextlib.suppress(FileNotFoundError):
                    os.remove(path)
                continue
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(info, f)
                f.flush()
                os.fsync(f.fileno())
            return cls(workdir, info["token"]), notice
        raise _busy(workdir, read_lock(workdir) or {})

    def release(self) -> None:
        """Remove the lock file if it still holds this lock (idempotent; never raises)."""
        if self._released or os.getpid() != self._pid:
            return
        self._released = True
        with contextlib.suppress(Exception):
            d = read_lock(self.workdir)
            if d and d.get("token") == self.token:
                os.remove(self.path)
