"""A small process pool for reward calls with a per-call timeout that kills hung workers.

`concurrent.futures.ProcessPoolExecutor` cannot stop one hung call (future.cancel() does nothing once
it runs), so each worker here is a `multiprocessing.Process` with its own Pipe. A call that exceeds
`timeout_s` has its worker killed (SIGKILL) and replaced; a worker that dies mid-call (segfault,
os._exit) is replaced too. Workers are started with the 'forkserver' context on POSIX ('spawn'
elsewhere): never 'fork', because forking a process that runs JAX (threads, accelerator runtime) is
unsafe. The timer of a call starts when it is handed to an already started, ready worker, so slow
interpreter start-up never counts against a reward call. Workers ignore SIGINT (the trainer shuts
them down after a Ctrl-C, see `engine/interrupt.py`).
"""

from __future__ import annotations

import importlib
import logging
import multiprocessing as mp
import pickle
import signal
import sys
import time
import traceback
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import wait
from typing import Any

log = logging.getLogger(__name__)

__all__ = ["CallResult", "RewardWorkerPool", "default_mp_context"]

_READY = "__ready__"


def default_mp_context() -> str:
    return "forkserver" if sys.platform != "win32" else "spawn"


@dataclass
class CallResult:
    """Outcome of one call: status 'ok' (value set), 'error' (message set) or 'timeout'.

    For an exception raised by the function, `traceback` holds its formatted traceback and, when the call
    ran in this process, `exception` the exception itself.
    """

    status: str
    value: Any = None
    message: str = ""
    traceback: str = ""
    exception: BaseException | None = None


def _worker_main(conn, fn: Callable[..., Any], preload: tuple[str, ...] = ()) -> None:  # runs in the child process
    # Ctrl-C in a terminal reaches the whole process group: the parent finishes its step and stops the
    # workers itself (`close`), so a worker ignores SIGINT instead of dying with a KeyboardInterrupt
    # traceback mid-call. SIGTERM keeps its default (a quiet exit), so `kill` still works on a stray one.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    for name in preload:  # slow imports before READY: under startup_timeout_s, not a call's timeout
        try:
            importlib.import_module(name)
        except ImportError as e:  # the call that needs the module reports it; one line on stderr here
            print(f"{name} not preloaded in a worker: {e}", file=sys.stderr)
    conn.send(_READY)
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        idx, args = msg
        try:
            out = ("ok", fn(*args))
        except BaseException as e:
            out = ("error", f"{type(e).__name__}: {e}", traceback.format_exc())
        try:
            conn.send((idx, *out))
        except Exception as e:  # unpicklable result
            conn.send((idx, "error", f"cannot send result back: {type(e).__name__}: {e}"))


class _Worker:
    def __init__(self, ctx, fn, label: str = "reward", preload: tuple[str, ...] = ()):
        self.conn, child = ctx.Pipe(duplex=True)
        args = (child, fn, preload)
        self.proc = ctx.Process(target=_worker_main, args=args, daemon=True, name=f"jaxrl_post-{label}")
        self.proc.start()
        child.close()
        self.spawned_at = time.monotonic()
        self.ready = False
        self.task: int | None = None
        self.started = 0.0

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(timeout=5)
        self.conn.close()

    def stop(self) -> None:
        try:
            self.conn.send(None)
        except (OSError, BrokenPipeError):
            pass
        self.proc.join(timeout=2)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(timeout=5)
        self.conn.close()


class RewardWorkerPool:
    """`num_workers` processes that run `fn(*args)` with a per-call timeout.

    Args:
      fn: the function; must be picklable (module-level function, functools.partial of one, or a
        `CustomRewardFunction`).
      num_workers: number of processes (>= 1).
      timeout_s: per-call limit in seconds; a call over it is killed and reported as 'timeout'.
      mp_context: 'forkserver' or 'spawn' ('fork' is refused: unsafe with JAX).
      startup_timeout_s: how long a new worker may take to import and report ready.
      label: what the calls are, in process names and messages ('reward'; the agent loop's tools: 'tool').
      preload: modules each worker imports before it reports ready, so a slow first import (reasoning-gym's
        takes seconds, tens on a loaded machine) counts against `startup_timeout_s`, not against the first call
        of every new worker (a timed-out worker is replaced, and its replacement would time out on it again).
    Raises:
      TypeError: `fn` is not picklable. ValueError: bad arguments.
      RuntimeError: a worker failed to start within `startup_timeout_s`.
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        num_workers: int,
        timeout_s: float,
        mp_context: str | None = None,
        startup_timeout_s: float = 120.0,
        label: str = "reward",
        preload: Sequence[str] = (),
    ):
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        if timeout_s is None or timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        mp_context = mp_context or default_mp_context()
        if mp_context == "fork":
            raise ValueError("mp_context='fork' is unsafe with JAX; use 'forkserver' or 'spawn'")
        try:
            pickle.dumps(fn)
        except Exception as e:
            raise TypeError(
                f"reward function {fn!r} is not picklable ({e}); define it at module level, load it with "
                "load_custom_reward_fn(path, name), or use num_workers=0 (in process, on a helper thread)"
            ) from e
        self._fn = fn
        self._ctx = mp.get_context(mp_context)
        self.num_workers = num_workers
        self.timeout_s = float(timeout_s)
        self.startup_timeout_s = float(startup_timeout_s)
        self._workers: list[_Worker] = []
        self.num_restarts = 0
        self.label = label
        self.preload = tuple(preload)

    def _ensure_workers(self) -> None:
        while len(self._workers) < self.num_workers:
            self._workers.append(_Worker(self._ctx, self._fn, self.label, self.preload))

    def _replace(self, w: _Worker) -> None:
        w.kill()
        self._workers[self._workers.index(w)] = _Worker(self._ctx, self._fn, self.label, self.preload)
        self.num_restarts += 1

    def map(self, arg_tuples: Sequence[tuple]) -> list[CallResult]:
        """Run fn(*args) for every tuple; results in input order. Never raises for a failing call."""
        self._ensure_workers()
        n = len(arg_tuples)
        results: list[CallResult | None] = [None] * n
        pending = deque(range(n))
        done = 0
        while done < n:
            now = time.monotonic()
            for w in self._workers:
                if w.ready and w.task is None and pending:
                    idx = pending.popleft()
                    w.conn.send((idx, tuple(arg_tuples[idx])))
                    w.task, w.started = idx, time.monotonic()
            deadlines = [
                (w.started + self.timeout_s) if w.ready else (w.spawned_at + self.startup_timeout_s)
                for w in self._workers
                if w.task is not None or not w.ready
            ]
            wait_s = max(0.0, min(deadlines) - now) if deadlines else None
            ready_conns = wait([w.conn for w in self._workers], timeout=wait_s)
            by_conn = {id(w.conn): w for w in self._workers}
            for conn in ready_conns:
                w = by_conn[id(conn)]
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    w.proc.join(timeout=2)
                    code = w.proc.exitcode
                    if w.task is not None:
                        results[w.task] = CallResult("error", message=f"{self.label} worker died (exit code {code})")
                        done += 1
                    elif not w.ready:
                        self._raise_startup(w, f"exited with code {code} before becoming ready")
                    self._replace(w)
                    continue
                if msg == _READY:
                    w.ready = True
                    continue
                idx, status, payload, *tb = msg
                results[idx] = (
                    CallResult("ok", value=payload)
                    if status == "ok"
                    else CallResult("error", message=payload, traceback=tb[0] if tb else "")
                )
                done += 1
                w.task = None
            now = time.monotonic()
            for w in list(self._workers):
                if w.task is not None and now - w.started > self.timeout_s:
                    results[w.task] = CallResult("timeout", message=f"{self.label} call exceeded {self.timeout_s:g} s")
                    done += 1
                    self._replace(w)
                elif not w.ready and now - w.spawned_at > self.startup_timeout_s:
                    self._raise_startup(w, f"not ready after {self.startup_timeout_s:g} s")
        return results  # type: ignore[return-value]

    def _raise_startup(self, w: _Worker, why: str) -> None:
        w.kill()
        self.close()
        raise RuntimeError(f"{self.label} worker process failed to start ({why}); try num_workers=0")

    def close(self) -> None:
        """Stop all workers (idempotent)."""
        for w in self._workers:
            w.stop()
        self._workers = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # at interpreter shutdown modules may be gone; close() ran or the workers are ending
            log.debug("%s.close() at garbage collection failed", type(self).__name__, exc_info=True)
