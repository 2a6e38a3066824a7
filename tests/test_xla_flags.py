"""`jaxrl_post.xla_flags.set_default_xla_flags`: the job's XLA defaults never override the user's flags."""

import subprocess
import sys

from jaxrl_post.xla_flags import DEFAULT_XLA_FLAGS, set_default_xla_flags

FLAG = "--xla_cpu_enable_concurrency_optimized_scheduler"


def test_added_when_absent_and_kept_after_other_flags():
    env = {}
    assert set_default_xla_flags(env) == list(DEFAULT_XLA_FLAGS)
    assert env["XLA_FLAGS"] == f"{FLAG}=false"
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    set_default_xla_flags(env)
    assert env["XLA_FLAGS"] == f"--xla_force_host_platform_device_count=8 {FLAG}=false"
    assert set_default_xla_flags(env) == [] and env["XLA_FLAGS"].count(FLAG) == 1  # idempotent


def test_user_value_wins():
    env = {"XLA_FLAGS": f"{FLAG}=true"}
    assert set_default_xla_flags(env) == []
    assert env["XLA_FLAGS"] == f"{FLAG}=true"


def test_main_sets_it_before_jax_starts():
    """`python -m jaxrl_post.main` (here: its usage error path, no config) sets the flag in its own
    environment first; XLA accepts it (an unknown flag would abort the process when the backend starts)."""
    code = (
        "import os, sys, jax; from jaxrl_post import main\n"
        "try:\n    main.run(['main'])\nexcept SystemExit:\n    pass\n"
        "print(os.environ['XLA_FLAGS']); print(jax.numpy.ones(2).sum())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"{FLAG}=false" in out.stdout and "2.0" in out.stdout
