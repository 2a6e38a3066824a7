"""glibc malloc settings of the CLI job (`jaxrl_post.runtime.host_malloc`): freed large blocks go back to the OS."""

import pathlib
import subprocess
import sys
import textwrap

import pytest

from jaxrl_post.runtime.host_malloc import release_freed_host_memory

REPO = pathlib.Path(__file__).resolve().parents[2]
LINUX = sys.platform.startswith("linux")

# Free a 24 MiB block (glibc then raises its dynamic mmap threshold to 24 MiB), allocate 256 MiB in 4 MiB
# blocks (heap blocks now, below the raised threshold), keep a small block above them, free the blocks.
_SCRIPT = textwrap.dedent("""
    import sys
    import numpy as np
    sys.path.insert(0, sys.argv[1])
    if sys.argv[2] == "on":
        from jaxrl_post.runtime.host_malloc import release_freed_host_memory
        assert release_freed_host_memory({}) == ["M_MMAP_THRESHOLD", "M_TRIM_THRESHOLD", "M_ARENA_MAX"]
    rss = lambda: int(open("/proc/self/status").read().split("VmRSS:")[1].split()[0]) * 1024
    big = np.ones(24 << 20, np.uint8)
    del big
    base = rss()
    blocks = [np.ones(4 << 20, np.uint8) for _ in range(64)]
    keep = np.ones(64 << 10, np.uint8)
    del blocks
    print((rss() - base) / 2**20)
""")


def _retained_mib(tmp_path, mode: str) -> float:
    script = tmp_path / "malloc.py"
    script.write_text(_SCRIPT)
    env = {"PATH": "/usr/bin:/bin"}  # no MALLOC_* variables from the caller
    proc = subprocess.run([sys.executable, str(script), str(REPO), mode], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr
    return float(proc.stdout.split()[-1])


@pytest.mark.skipif(not LINUX, reason="glibc mallopt and /proc are Linux-only")
def test_freed_blocks_return_to_the_os(tmp_path):
    assert _retained_mib(tmp_path, "off") > 200  # glibc's default keeps the freed 256 MiB resident
    assert _retained_mib(tmp_path, "on") < 16


def test_user_environment_wins():
    expected = ["M_MMAP_THRESHOLD", "M_TRIM_THRESHOLD"] if LINUX else []
    assert release_freed_host_memory({"MALLOC_ARENA_MAX": "4"}) == expected
    assert release_freed_host_memory({"LD_PRELOAD": "/usr/lib/libtcmalloc.so.4"}) == []
    env = {"MALLOC_MMAP_THRESHOLD_": "1", "MALLOC_TRIM_THRESHOLD_": "1", "MALLOC_ARENA_MAX": "1"}
    assert release_freed_host_memory(env) == []
