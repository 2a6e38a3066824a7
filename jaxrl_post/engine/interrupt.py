"""Clean stop on SIGINT / SIGTERM: finish the current step, checkpoint it, exit with 130 / 143.

`GracefulStop` is a context manager that replaces the SIGINT and SIGTERM handlers while a job runs.
Python runs signal handlers in the main thread between bytecodes, so a handler never runs inside a
jitted call or an XLA compile; it runs as soon as that call returns.

- Before the trainer called `defer()` (that is, before any training step of this process completed:
  start-up, compilation, validation before training, the first step) there is nothing worth saving:
  the handler prints `abort_line` and leaves the process at once with `exit_now`.
- After `defer()`, a signal is only recorded: `RLTrainer.fit` checks `requested` between steps, saves
  a checkpoint of the last completed step and returns; `main.py` closes the trainer (waiting for the
  async save), prints one line and exits with `exit_code`.
- A second signal exits immediately and says what is lost (`lost_line`, set by `main.py`: the checkpoint
  being written, or the steps after the last complete one); orbax writes are atomic, so a half-written
  checkpoint is never resumed, and the next run names the lost step in one line
  (`checkpoint.report_unfinished`).

Why not let KeyboardInterrupt propagate: it fires wherever the main thread happens to be (inside
tracing, a checkpoint write, a garbage-collection callback that only prints "Exception ignored"), and
the interpreter then shuts down while XLA, orbax and reward-pool threads are still running, which is how
a Ctrl-C during compilation ended in a segfault (rc 139). Here no exception is ever raised by a signal,
and the process leaves through `exit_now` (`os._exit` after flushing stdout/stderr), which skips the
interpreter shutdown. Reward worker processes ignore SIGINT and exit when their pipe to the trainer
closes.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)

EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143}  # 128 + signal number, what shells report


def signal_name(signum: int) -> str:
    """'SIGINT' for 2, ... (the number as text when unknown)."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return str(signum)


def exit_code_for(signum: int) -> int:
    """128 + signum (130 for SIGINT, 143 for SIGTERM)."""
    return EXIT_CODES.get(signum, 128 + int(signum))


_AT_EXIT_NOW: list[Callable[[], None]] = []


def at_exit_now(fn: Callable[[], None]) -> None:
    """Register `fn` to run in `exit_now` before the process leaves (`os._exit` skips `atexit`), e.g. the
    release of the run directory's lock (`run_lock.RunLock`). `fn` must be quick; its errors are ignored."""
    _AT_EXIT_NOW.append(fn)


def exit_now(code: int) -> None:
    """Run the `at_exit_now` callbacks, flush stdout/stderr and leave the process at once (`os._exit`: no
    interpreter shutdown, so no crash from threads that XLA or orbax still run). Call after the trainer is
    closed, or when nothing needs closing (a signal before the first completed step)."""
    for fn in _AT_EXIT_NOW:
        try:
            fn()
        except Exception:  # an exit callback must not stop the exit; recorded for a debug log
            log.debug("at_exit_now callback %r failed", fn, exc_info=True)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # a closed or broken stream: nothing left to flush it to
            log.debug("flushing %r failed", stream, exc_info=True)
    os._exit(code)


class GracefulStop:
    """Installs SIGINT/SIGTERM handlers for a training job (see the module docstring).

    Args:
      abort_line: printed when a signal arrives before `defer()` (the caller updates the attribute as it
        learns more, e.g. once the trainer knows the step it resumed from).
      signals: the signals to handle.
      write: where the lines of an immediate exit go (default: stdout, flushed).
      hard_exit: called with the exit code for an immediate exit (default `exit_now`; tests pass a fake).

    `lost_line`: optional callable returning what a second signal loses (printed after "exiting now; ").

    Use as `with GracefulStop(...) as stop: ...`; outside the main thread it installs nothing (Python
    only allows handlers there) and `requested` stays False.
    """

    def __init__(
        self,
        abort_line: str = "interrupted during start-up; nothing was saved",
        signals=(signal.SIGINT, signal.SIGTERM),
        *,
        write: Callable[[str], None] | None = None,
        hard_exit: Callable[[int], None] = exit_now,
    ):
        self.abort_line = abort_line
        self.signals = tuple(signals)
        self.signum: int | None = None
        self.deferred = False
        self._write = write or (lambda s: print(s, flush=True))
        self._hard_exit = hard_exit
        self._previous: dict[int, object] = {}
        self.lost_line: Callable[[], str] | None = None  # what a second signal loses (main sets it)

    @property
    def requested(self) -> bool:
        """True once a stop signal arrived (and was deferred)."""
        return self.signum is not None

    @property
    def exit_code(self) -> int | None:
        """130 (SIGINT) / 143 (SIGTERM) once requested, else None."""
        return None if self.signum is None else exit_code_for(self.signum)

    def defer(self) -> None:
        """From now on a first signal is only recorded (there is a completed step worth saving)."""
        self.deferred = True

    def _handle(self, signum, frame) -> None:
        del frame
        if self.signum is not None:
            lost = "nothing more is saved"
            if self.lost_line is not None:
                try:
                    lost = self.lost_line()
                except Exception as e:  # a handler must exit, whatever happens; the line says why it has no detail
                    lost = f"nothing more is saved (could not tell what is lost: {type(e).__name__}: {e})"
            self._write(f"second {signal_name(signum)}: exiting now; {lost}")
            self._hard_exit(exit_code_for(self.signum))
            return
        self.signum = int(signum)
        if not self.deferred:
            self._write(self.abort_line)
            self._hard_exit(exit_code_for(signum))
            return
        # acknowledged at once: the step may run for minutes, and a user who sees nothing presses Ctrl-C again
        self._write(
            f"{signal_name(signum)} received: finishing the current step, then saving a checkpoint "
            f"({signal_name(signum)} again quits now without saving)"
        )

    def __enter__(self) -> GracefulStop:
        if threading.current_thread() is threading.main_thread():
            for s in self.signals:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for s, old in self._previous.items():
            signal.signal(s, old)
        self._previous = {}
