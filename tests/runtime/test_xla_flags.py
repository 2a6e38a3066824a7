"""`jaxrl_post.runtime.xla_flags.set_default_xla_flags`: the job's XLA defaults never override the user's flags."""

import subprocess
import sys

from jaxrl_post.runtime.xla_flags import DEFAULT_XLA_FLAGS, YNN_FLAG, default_xla_flags, set_default_xla_flags

FLAG = "--xla_cpu_enable_concurrency_optimized_scheduler"
YNN = "--xla_cpu_experimental_ynn_fusion_type"


def test_added_when_absent_and_kept_after_other_flags():
    env = {}
    assert set_default_xla_flags(env) == list(DEFAULT_XLA_FLAGS)
    assert env["XLA_FLAGS"] == " ".join(DEFAULT_XLA_FLAGS) and env["XLA_FLAGS"].startswith(f"{FLAG}=false")
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    set_default_xla_flags(env)
    assert env["XLA_FLAGS"] == " ".join(("--xla_force_host_platform_device_count=8",) + DEFAULT_XLA_FLAGS)
    assert set_default_xla_flags(env) == [] and env["XLA_FLAGS"].count(FLAG) == 1  # idempotent


def test_ynn_flag_only_for_the_jaxlib_it_was_measured_with():
    """XLA aborts on a flag it does not know: jaxlib < 0.8.1 has no YNN fusion flag, so it is added from 0.10 on
    only (the version it was measured with)."""
    assert default_xla_flags((0, 7)) == default_xla_flags((0, 9)) == (f"{FLAG}=false",)
    assert default_xla_flags((0, 10)) == default_xla_flags((1, 2)) == (f"{FLAG}=false", YNN_FLAG)
    assert YNN_FLAG.startswith(f"{YNN}=-") and ",-" in YNN_FLAG  # remove mode: every item has the '-' sign


def test_user_value_wins():
    env = {"XLA_FLAGS": f"{FLAG}=true {YNN}=+LIBRARY_FUSION_TYPE_REDUCE"}
    assert set_default_xla_flags(env) == []
    assert env["XLA_FLAGS"] == f"{FLAG}=true {YNN}=+LIBRARY_FUSION_TYPE_REDUCE"


def test_main_sets_it_before_jax_starts():
    """`python -m jaxrl_post.main` (here: its usage error path, no config) sets the flags in its own
    environment first; XLA accepts them (an unknown flag would abort the process when the backend starts) and
    a reduction and a matmul under them equal numpy's."""
    code = (
        "import os, sys, jax, numpy as np; from jaxrl_post import main\n"
        "try:\n    main.run(['main'])\nexcept SystemExit:\n    pass\n"
        "print(os.environ['XLA_FLAGS']); print(jax.numpy.ones(2).sum())\n"
        "x = np.random.default_rng(0).normal(size=(64, 96)).astype(np.float32)\n"
        "f = jax.jit(lambda a: (jax.nn.softmax(a @ a.T / 8, axis=-1), jax.numpy.square(a).mean(0)))\n"
        "p, m = f(x); z = x.astype(np.float64) @ x.T / 8; e = np.exp(z - z.max(-1, keepdims=True))\n"
        "print(np.allclose(p, e / e.sum(-1, keepdims=True), atol=1e-5), np.allclose(m, (x * x).mean(0), rtol=1e-5))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert all(f in out.stdout for f in DEFAULT_XLA_FLAGS) and "2.0" in out.stdout
    assert "True True" in out.stdout
