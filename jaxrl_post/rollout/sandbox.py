"""The `python` tool's sandbox: code in a `python -I` subprocess with an empty environment, its own temporary
working directory, resource limits, a capped output file and, where `unshare -rn` works, no network."""

from __future__ import annotations

import functools
import math
import os
import shutil
import subprocess
import sys
import tempfile

__all__ = ["network_isolation_available", "python", "run_python_sandboxed"]


@functools.lru_cache(maxsize=1)
def network_isolation_available() -> bool:
    """True when `unshare -rn` (a new user + network namespace: no interfaces but loopback) works here."""
    exe = shutil.which("unshare")
    if exe is None:
        return False
    try:
        return subprocess.run([exe, "-rn", "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def _sandbox_limits(memory_mb: int, cpu_s: int, file_bytes: int) -> None:  # runs in the child before exec
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (memory_mb << 20, memory_mb << 20))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s))
    resource.setrlimit(resource.RLIMIT_FSIZE, (file_bytes, file_bytes))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    os.setsid()


def run_python_sandboxed(
    code: str, *, timeout_s: float = 5.0, memory_mb: int = 512, max_output_bytes: int = 16384
) -> tuple[str, int | None, bool]:
    """Run `code` with `python -I` in a subprocess: its own temporary directory as cwd (deleted after), an
    empty environment (no inherited variables, so no secrets), isolated mode (no user site, no
    PYTHON* variables), address space `memory_mb`, CPU time and wall time `timeout_s`, stdout + stderr written
    to a file capped at `max_output_bytes` (RLIMIT_FSIZE: a flood stops the child), and no network when
    `network_isolation_available()` (`unshare -rn`; otherwise the code can reach the network).

    Returns `(output, returncode, timed_out)`: output is stdout + stderr (decoded, replacement characters for
    bad bytes), returncode None when timed out."""
    workdir = tempfile.mkdtemp(prefix="jaxrl_post_py_")
    try:
        out_path = os.path.join(workdir, ".output")
        cmd = [sys.executable, "-I", "-c", code]
        if network_isolation_available():
            cmd = [shutil.which("unshare"), "-rn", *cmd]
        limits = functools.partial(_sandbox_limits, memory_mb, max(1, math.ceil(timeout_s)), max_output_bytes)
        with open(out_path, "wb") as out:
            proc = subprocess.Popen(
                cmd, cwd=workdir, env={}, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                preexec_fn=limits, close_fds=True,
            )  # fmt: skip
            try:
                rc, timed_out = proc.wait(timeout=timeout_s), False
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
                proc.wait()
                rc, timed_out = None, True
        with open(out_path, "rb") as f:
            text = f.read(max_output_bytes).decode("utf-8", errors="replace")
        return text, rc, timed_out
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def python(code: str) -> str:
    """Run Python code in a sandbox and return what it prints (stdout and stderr).

    Args:
        code: a complete Python program; print the values you want to see
    """
    text, rc, timed_out = run_python_sandboxed(code)
    if timed_out:
        return text + "\n[timed out]"
    if rc:
        return text + f"\n[exit code {rc}]"
    return text
