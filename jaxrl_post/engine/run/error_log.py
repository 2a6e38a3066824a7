"""The main job's failures during training: one `error:` line on the console, the traceback in a file.

A failure the user can act on (a full disk, a reward function or tool that fails on most calls, a diverging
run, a bad batch shape) is printed by `main.py` as one `error:` line saying what failed and where; the
Python traceback, which helps only to report a bug, goes to `<trainer.default_local_dir>/error.log`
(appended; `write_error_log`), and the line names that file.

A failed asynchronous checkpoint save makes orbax log ERROR records with tracebacks of its own background
threads (dozens of frames each), and tensorstore print a traceback per write still in flight, before our
`CheckpointError` names the directory and the last complete checkpoint; `OrbaxTracebacks` keeps those off
the console and hands them to the error log. After a
full disk, the failed save's partial directory (`checkpoint_layout.unfinished_steps`, what the next run would
remove) is removed first (`remove_unfinished`), so that the log fits where the save did not.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import sys
import tempfile
import time
import traceback

from jaxrl_post.engine.nonfinite import NonFiniteError
from jaxrl_post.engine.run import checkpoint as ckpt
from jaxrl_post.engine.run.checkpoint_layout import unfinished_steps

__all__ = ["ERROR_LOG", "OrbaxTracebacks", "failure_text", "is_disk_full", "remove_unfinished", "write_error_log"]

ERROR_LOG = "error.log"
_MAX_RECORDS = 8
_NO_SPACE = ("No space left on device", "Disk quota exceeded", "os_error_code='28'")  # orbax/tensorstore wrap errno


class OrbaxTracebacks(logging.Filter):
    """Keeps a failed save's tracebacks (the last 8, formatted) in `records` instead of printing them: orbax's
    ERROR records that carry one (a filter on the `absl` logger), asyncio's "Task exception was never retrieved"
    records of orbax's write tasks (a filter on the `asyncio` logger) and tensorstore's "Event loop is closed"
    RuntimeErrors (`sys.unraisablehook`: its writes finishing after orbax closed the failed save's event loop).
    Every other record and unraisable exception passes as before."""

    def __init__(self):
        super().__init__()
        self.records: list[str] = []
        self._unraisablehook = sys.unraisablehook

    def _keep(self, text: str) -> None:
        self.records = [*self.records, text][-_MAX_RECORDS:]

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR or not record.exc_info:
            return True
        orbax = f"{os.sep}orbax{os.sep}"
        if orbax not in (record.pathname or ""):  # asyncio's "Task exception was never retrieved" of orbax's writes
            tb = "".join(traceback.format_exception(*record.exc_info))
            if record.name != "asyncio" or orbax not in tb:
                return True
        self._keep(logging.Formatter("%(levelname)s %(pathname)s: %(message)s").format(record))
        return False

    def unraisable(self, u) -> None:
        if isinstance(u.exc_value, RuntimeError) and str(u.exc_value) == "Event loop is closed":
            self._keep("".join(traceback.format_exception(u.exc_type, u.exc_value, u.exc_traceback)))
        else:
            self._unraisablehook(u)

    @classmethod
    def install(cls) -> OrbaxTracebacks:
        """The filter on the `absl` logger (orbax logs through absl) and the unraisable hook, installed once."""
        logger = logging.getLogger("absl")
        for f in logger.filters:
            if isinstance(f, cls):
                return f
        f = cls()
        logger.addFilter(f)
        logging.getLogger("asyncio").addFilter(f)
        sys.unraisablehook = f.unraisable
        return f


def is_disk_full(e: BaseException) -> bool:
    """Whether `e` is an OSError for a full disk or an exhausted quota (ENOSPC, EDQUOT)."""
    return isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT)


def remove_unfinished(checkpoint_dir: str | None) -> list[str]:
    """Remove orbax's partial `global_step_<N>.orbax-checkpoint-tmp*` directories in `checkpoint_dir` (call only
    when no save is running); returns the removed paths. One that cannot be removed is left (orbax skips it)."""

    removed = []
    for _, path in unfinished_steps(checkpoint_dir) if checkpoint_dir else []:
        try:
            shutil.rmtree(path)
            removed.append(path)
        except OSError as e:  # left in place: the next run reports it (checkpoint.report_unfinished)
            logging.getLogger(__name__).warning("could not remove the partial checkpoint %s: %s", path, e)
    return removed


def write_error_log(run_dir: str | None, exc: BaseException | None, extra: list[str] = ()) -> str | None:
    """Append `exc`'s traceback (its causes included; none for None) and the `extra` texts to
    `<run_dir>/error.log`, or, when that cannot be written (no run directory yet, a full disk), to a new file in
    the temporary directory.

    Returns: the path written, or None when neither could be written (the line then says so)."""
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)) if exc is not None else ""
    body = f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} pid {os.getpid()}\n{text}" + "".join(f"\n{x}\n" for x in extra)
    if run_dir:
        path = os.path.join(run_dir, ERROR_LOG)
        try:
            with open(path, "a") as f:
                f.write(body)
            return path
        except OSError:
            pass  # a full disk or an unwritable directory: the temporary directory below
    try:
        fd, path = tempfile.mkstemp(prefix="jaxrl_post_error_", suffix=".log")
        with os.fdopen(fd, "w") as f:
            f.write(body)
        return path
    except OSError:
        return None


def failure_text(e: BaseException, trainer, run_dir: str | None, kept_records: list[str] | None = None) -> str:
    """The one `error:` line main prints for a failure of `fit` the user can act on (a reward function's:
    `main.reward_error_text`). A full disk (an OSError, or a checkpoint save that ran out of space) names the
    directory and the last complete checkpoint; the failed save's partial directory is removed and the traceback
    (with `kept_records`: orbax's; the list is emptied once written) goes to `<run_dir>/error.log`, as does a
    failed save's or a diverging run's."""

    if not isinstance(e, (ckpt.CheckpointError, NonFiniteError)) and not is_disk_full(e):
        return f"error: {e}"
    line = " ".join(str(e).split())  # one line, whatever orbax's message holds
    c = getattr(trainer, "checkpointer", None)
    if c is not None and (is_disk_full(e) or any(s in line for s in _NO_SPACE)):
        done = ckpt.list_complete_steps(c.directory)
        kept = f"the last complete checkpoint {c.step_path(done[-1])} is intact" if done else "no checkpoint was saved"
        what = f"writing {e.filename}" if getattr(e, "filename", None) else f"saving a checkpoint to {c.directory}"
        line = f"{what} failed: no space left on device; {kept}. Free disk space, then rerun the command to resume"
    if not isinstance(e, NonFiniteError):
        remove_unfinished(c.directory if c is not None else None)
    log = write_error_log(run_dir, e, list(kept_records or ()))
    if kept_records:
        kept_records.clear()
    return f"error: {line} (traceback: {log})" if log else f"error: {line} (the traceback could not be written)"
