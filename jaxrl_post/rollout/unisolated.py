"""The opt-out path of the tool sandbox (`sandbox.py`, `isolate=False`): `python -I` with an empty environment in a
temporary working directory, address-space, CPU-time and file-size limits, and no network where `unshare -rn`
works; no file or process isolation. Used only where the sandbox is unavailable and the run opted out
(`rollout.multi_turn.allow_unsandboxed_tools`), and by the tests as the sandbox switched off."""

from __future__ import annotations

import functools
import math
import os
import shutil
import signal
import subprocess
import sys

__all__ = ["network_isolation_available", "run_unisolated"]


@functools.lru_cache(maxsize=1)
def network_isolation_available() -> bool:
    """True when `unshare -rn` (a new user + network namespace: loopback only) works: the unisolated path's
    network cut."""
    exe = shutil.which("unshare")
    if exe is None:
        return False
    try:
        return subprocess.run([exe, "-rn", "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def _unisolated_limits(memory_mb: int, cpu_s: int, file_bytes: int) -> None:  # runs in the child before exec
    import resource

    if memory_mb:
        resource.setrlimit(resource.RLIMIT_AS, (memory_mb << 20, memory_mb << 20))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s))
    resource.setrlimit(resource.RLIMIT_FSIZE, (file_bytes, file_bytes))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def run_unisolated(program: list[str], stdin: bytes, *, timeout_s, memory_mb, max_output_bytes, workdir):
    """The opt-out path: `python -I` with an empty environment in `workdir`, limits, `unshare -rn` when it
    works; its process group is killed afterwards (a child that leaves the group survives). Returns
    (stdout + stderr bytes, capped; returncode or None; timed_out)."""
    out_path = os.path.join(workdir, ".output")
    cmd = [sys.executable, "-I", *program]
    if network_isolation_available():
        cmd = [shutil.which("unshare"), "-rn", *cmd]
    limits = functools.partial(_unisolated_limits, memory_mb, max(1, math.ceil(timeout_s)), max_output_bytes)
    with open(out_path, "wb") as out:
        proc = subprocess.Popen(
            cmd, cwd=workdir, env={}, stdin=subprocess.PIPE, stdout=out, stderr=subprocess.STDOUT,
            preexec_fn=limits, close_fds=True, start_new_session=True,
        )  # fmt: skip
        try:
            proc.communicate(stdin, timeout=timeout_s)
            rc, timed_out = proc.returncode, False
        except subprocess.TimeoutExpired:
            rc, timed_out = None, True
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    with open(out_path, "rb") as f:
        return f.read(max_output_bytes), rc, timed_out
