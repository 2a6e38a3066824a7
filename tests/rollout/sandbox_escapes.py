"""Escape attempts against the tool sandbox (jaxrl_post/rollout/sandbox.py), one per property it enforces.

tests/rollout/test_sandbox.py copies this file, sandbox.py and unisolated.py (in a `jaxrl_post.rollout` skeleton) into a
world-readable directory and runs
`python sandbox_escapes.py DIR ISOLATE` there (as the test's own user and as uid 65534), with `SECRET_VAR` in the
process's environment from its start; it prints `{escape: [held, output]}` as JSON. ISOLATE 1: the sandbox;
0: isolation switched off (the unisolated path, without its network cut and memory cap), where every escape must
succeed, so each check is shown to catch a broken sandbox. Standard library and the sandbox module only."""

import json
import os
import signal
import socket
import sys
import time

from jaxrl_post.rollout import sandbox, unisolated

SECRET_VAR, SECRET = "JAXRL_POST_FAKE_TOKEN", "fake-secret-6d1f0c"
MAX_PROCESSES = 8
ESCAPES = (
    "read_outside",
    "write_outside",
    "list_dirs",
    "fork_and_return",
    "process_count",
    "memory_4gb",
    "network",
    "environment",
    "tool_environment",
)
_ENV_DUMP = (  # this process's variables, and every variable of any process it can read whose name has TOKEN
    "import glob, os\nprint(dict(os.environ))\nfor p in glob.glob('/proc/[0-9]*/environ'):\n    try:\n"
    "        print(p, [v for v in open(p, 'rb').read().split(b'\\0') if b'TOKEN' in v])\n    except OSError:\n"
    "        pass\n"
)


def _token_pids(token: str) -> list[int]:
    pids = []
    for d in os.listdir("/proc"):
        try:
            with open(f"/proc/{d}/cmdline", "rb") as f:
                if token.encode() in f.read():
                    pids.append(int(d))
        except (OSError, ValueError):
            continue
    return pids


def attempt(name: str, base: str, isolate: bool) -> tuple[bool, str]:
    """Try escape `name` from a sandboxed call; `base` holds `secret.txt` (readable by the caller). Returns
    (held, what the code printed)."""
    limits = {"isolate": isolate, "max_processes": MAX_PROCESSES, "timeout_s": 10.0}
    if not isolate:
        limits["memory_mb"] = 0  # isolation off: no address-space cap either

    def run(code: str, **kw) -> str:
        return sandbox.run_python_sandboxed(code, **{**limits, **kw})[0]

    secret_file = os.path.join(base, "secret.txt")
    if name == "read_outside":
        out = run(f"for p in ({secret_file!r}, '/etc/passwd'):\n    try:\n        print(open(p).read())\n"
                  "    except OSError as e:\n        print(e)")  # fmt: skip
        return SECRET not in out and "root:" not in out, out
    if name == "write_outside":
        target = os.path.join(base, f"escaped_{os.getpid()}.txt")
        out = run(f"open({target!r}, 'w').write('escaped')")
        held = not os.path.exists(target)
        if not held:
            os.remove(target)
        return held, out
    if name == "list_dirs":
        out = run(f"import os\nfor d in ({base!r}, '/', '/proc/1/root'):\n    try:\n        print(os.listdir(d))\n"
                  "    except OSError as e:\n        print(e)")  # fmt: skip
        return "secret.txt" not in out and "'work'" not in out, out
    if name == "fork_and_return":  # children leave the process group and outlive the call unless it kills them
        token = f"fork_and_return_{os.getpid()}_{time.time_ns()}"
        out = run(f"import os, time  # {token}\nfor _ in range(3):\n    if os.fork() == 0:\n        os.setsid()\n"
                  "        time.sleep(60)\n        os._exit(0)\nprint('returned')")  # fmt: skip
        left = _token_pids(token)
        for pid in left:  # our own test children: clean up after a broken sandbox
            os.kill(pid, signal.SIGKILL)
        return not left and "returned" in out, out + f"left: {left}"
    if name == "process_count":
        out = run("import os, time\nn = 0\nfor _ in range(40):\n    try:\n        pid = os.fork()\n"
                  "    except OSError:\n        break\n    if pid == 0:\n        time.sleep(2)\n        os._exit(0)\n"
                  "    n += 1\nprint('forked', n)")  # fmt: skip
        n = int(out.split("forked")[-1].split()[0]) if "forked" in out else -1
        return 0 <= n < MAX_PROCESSES, out
    if name == "memory_4gb":  # an untouched mapping: without a cap it costs nothing
        out = run("import mmap\nm = mmap.mmap(-1, 4 << 30)\nprint('allocated')", memory_mb=512 if isolate else 0)
        return "allocated" not in out, out
    if name == "network":  # a server on the caller's loopback: the sandbox has its own
        with socket.socket() as server:
            server.bind(("127.0.0.1", 0))
            server.listen(1)
            port = server.getsockname()[1]
            out = run(f"import socket\ntry:\n    socket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
                      "    print('connected')\nexcept OSError as e:\n    print(e)")  # fmt: skip
        return "connected" not in out, out
    if name == "environment":
        out = run(_ENV_DUMP)
        return SECRET not in out, out
    if name == "tool_environment":
        tool = os.path.join(base, "env_tool.py")
        with open(tool, "w") as f:
            f.write("def dump():\n    import contextlib, io\n    buf = io.StringIO()\n")
            f.write(
                f"    with contextlib.redirect_stdout(buf):\n        exec({_ENV_DUMP!r})\n    return buf.getvalue()\n"
            )
        os.chmod(tool, 0o644)
        out = sandbox.run_function_sandboxed(tool, "dump", {}, **limits)
        return SECRET not in out, out
    raise ValueError(name)


def main(base: str, isolate: bool) -> dict:
    assert os.environ.get(SECRET_VAR) == SECRET, "start this script with the secret in its environment"
    assert sandbox.__file__.startswith(os.path.dirname(os.path.abspath(__file__))), sandbox.__file__  # the copy
    if not isolate:
        unisolated.network_isolation_available = lambda: False  # isolation off: no `unshare -rn` either
    return {name: attempt(name, base, isolate) for name in ESCAPES}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2] == "1")))
