"""In-process reward calls with a per-call timeout (`reward_model.num_workers=0`).

Each call runs on a daemon helper thread; the caller waits at most `timeout_s` for it. A call that does not
return in time is reported as 'timeout' and its thread is abandoned (Python cannot stop a thread): it keeps
running in the background until the function returns, and the next call gets a fresh thread.

Why a thread and not SIGALRM: an alarm works only on the main thread, there is one alarm per process
(math-verify sets its own, which would cancel ours), and it would race with the job's own signal handlers.
The thread needs none of that. Its limit: an abandoned call still uses CPU (and, in pure-C code holding the
GIL, can stall the trainer) until it returns; worker processes (`num_workers > 0`) kill a hung call instead.

In process, a call that ends the process (`os._exit`, a crash in native code) ends the trainer with it: no
Python code runs after it, so nothing can report it. `warn_unprotected` says so at start-up for a user's
reward file (`custom_reward_function.path` outside this project); `sys.exit` is caught and counted.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import traceback
from collections.abc import Callable
from typing import Any

from jaxrl_post.rewards.pool import CallResult

__all__ = ["ThreadCaller", "call_safely", "warn_unprotected"]

log = logging.getLogger(__name__)


# files shipped with the project (the :tiny configs' toy rewards, the agent environments): not user code
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_SHIPPED = (_PACKAGE + os.sep, os.path.join(os.path.dirname(_PACKAGE), "configs") + os.sep)


def call_safely(fn: Callable[..., Any], args: tuple) -> CallResult:
    """fn(*args) -> CallResult 'ok' (value) or 'error' (message, the exception and its traceback text); a
    `sys.exit()` in `fn` is an 'error' too, not the end of the trainer."""
    try:
        return CallResult("ok", value=fn(*args))
    except (Exception, SystemExit) as e:
        msg = f"the function called sys.exit({e.code!r})" if isinstance(e, SystemExit) else f"{type(e).__name__}: {e}"
        return CallResult("error", message=msg, traceback=traceback.format_exc(), exception=e)


def warn_unprotected(fn: Any) -> bool:
    """Log one warning when `fn` is a user's reward file (`CustomRewardFunction` outside this project) scored in
    process: a call that ends the process ends the run without a message. Returns whether it warned."""
    path = getattr(fn, "path", None)
    if not isinstance(path, str) or not hasattr(fn, "name") or os.path.abspath(path).startswith(_SHIPPED):
        return False
    log.warning(
        "reward: %r from %s runs in the trainer process (reward_model.num_workers=0), unprotected: a call that "
        "ends the process (os._exit, a crash in native code) ends the run with no message; "
        "--config.reward_model.num_workers=2 runs it in worker processes, which report such a call",
        fn.name,
        path,
    )
    return True


class ThreadCaller:
    """Runs `fn(*args)` on a daemon thread and waits at most `timeout_s` seconds for each call.

    Args:
      fn: the reward function.
      timeout_s: per-call limit in seconds (> 0).
    Raises:
      ValueError: `timeout_s` is not > 0.
    """

    def __init__(self, fn: Callable[..., Any], timeout_s: float):
        if timeout_s is None or timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self._fn = fn
        self.timeout_s = float(timeout_s)
        self._queue: queue.SimpleQueue | None = None
        self.num_abandoned = 0  # calls that timed out (their threads may still be running)

    def _loop(self, q: queue.SimpleQueue) -> None:
        while True:
            item = q.get()
            if item is None:
                return
            args, box, done = item
            box.append(call_safely(self._fn, args))
            done.set()

    def call(self, args: tuple) -> CallResult:
        """fn(*args) as a CallResult: 'ok', 'error' (the function raised) or 'timeout'. Never raises."""
        if self._queue is None:
            self._queue = queue.SimpleQueue()
            threading.Thread(target=self._loop, args=(self._queue,), daemon=True, name="jaxrl_post-reward").start()
        box: list[CallResult] = []
        done = threading.Event()
        self._queue.put((args, box, done))
        if done.wait(self.timeout_s):
            return box[0]
        self._queue.put(None)  # the abandoned thread exits once the hung call returns
        self._queue = None
        self.num_abandoned += 1
        if self.num_abandoned in (1, 10, 100):
            log.warning(
                "reward: %d call(s) exceeded %g s in process (num_workers=0); they keep running in background "
                "threads. Worker processes (reward_model.num_workers > 0) kill hung calls instead.",
                self.num_abandoned,
                self.timeout_s,
            )
        return CallResult("timeout", message=f"reward call exceeded {self.timeout_s:g} s (in process)")

    def close(self) -> None:
        """Let the idle helper thread exit (idempotent)."""
        if self._queue is not None:
            self._queue.put(None)
            self._queue = None
