"""The main job's persistent compilation cache (runtime/compile_cache.py): where it goes, that a process writes
programs there and a second process loads them instead of compiling, and that '' turns it off. Every process
runs with HOME and XDG_CACHE_HOME in tmp_path, so nothing is written into the user's home."""

import json
import os
import subprocess
import sys

import pytest

from jaxrl_post.runtime import compile_cache as cc

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# A child: the cache as the main job sets it, one jitted program, then what JAX's monitoring events counted.
CHILD = """
import json, sys
import jax, jax.numpy as jnp
import jax.monitoring as m
from jaxrl_post.runtime.compile_cache import enable_compilation_cache
n = {"hits": 0, "requests": 0}
names = {"/jax/compilation_cache/cache_hits": "hits", "/jax/compilation_cache/compile_requests_use_cache": "requests"}
m.register_event_listener(lambda name, **kw: n.__setitem__(names[name], n[names[name]] + 1) if name in names else None)
value = None if sys.argv[1] == "None" else sys.argv[1]
choice = enable_compilation_cache(value)
out = jax.jit(lambda x: jnp.tanh(x @ x.T).sum())(jnp.ones((64, 64))).block_until_ready()
print(json.dumps(dict(n, path=choice.path, source=choice.source, min_s=choice.min_compile_time_s,
                      enabled=jax.config.jax_enable_compilation_cache)))
"""


def _child(value, tmp_path, **env_extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_COMPILATION_CACHE", "JAX_PERSISTENT_CACHE"))}
    env.update(HOME=str(tmp_path / "home"), XDG_CACHE_HOME=str(tmp_path / "xdg"), JAX_PLATFORMS="cpu", **env_extra)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    p = subprocess.run(
        [sys.executable, "-c", CHILD, str(value)], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_the_directory_comes_from_the_config_then_jax_variable_then_the_user_cache(tmp_path):
    env = {"XDG_CACHE_HOME": str(tmp_path / "xdg")}
    assert cc.resolve_cache_dir(None, env) == (str(tmp_path / "xdg" / "jaxrl_post" / "xla"), "default")
    env[cc.ENV_DIR] = str(tmp_path / "jax")
    assert cc.resolve_cache_dir(None, env) == (str(tmp_path / "jax"), cc.ENV_DIR)
    assert cc.resolve_cache_dir(str(tmp_path / "mine"), env) == (str(tmp_path / "mine"), "config")
    assert cc.resolve_cache_dir("", env) == (None, "off")  # '' wins over the environment variable
    home = os.path.expanduser("~")
    assert cc.default_cache_dir({"XDG_CACHE_HOME": ""}) == os.path.join(home, ".cache", "jaxrl_post", "xla")
    assert cc.resolve_cache_dir("~/c", {})[0] == os.path.join(home, "c")


def test_a_configured_directory_gets_the_jobs_minimum_compile_time(tmp_path):
    """In this process (the JAX settings restored after): a directory from the config, JAX's variable ignored,
    and `MIN_COMPILE_TIME_S` unless JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS is set."""
    import jax

    names = ("jax_enable_compilation_cache", "jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs")
    old = {n: getattr(jax.config, n) for n in names}
    try:
        c = cc.enable_compilation_cache(str(tmp_path / "mine"), {cc.ENV_DIR: str(tmp_path / "jax")})
        assert c == (str(tmp_path / "mine"), "config", cc.MIN_COMPILE_TIME_S) and (tmp_path / "mine").is_dir()
        assert jax.config.jax_compilation_cache_dir == str(tmp_path / "mine")
        assert jax.config.jax_persistent_cache_min_compile_time_secs == cc.MIN_COMPILE_TIME_S
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 7.0)
        c = cc.enable_compilation_cache(None, {cc.ENV_DIR: str(tmp_path / "jax"), cc.ENV_MIN_COMPILE_TIME: "7"})
        assert c == (str(tmp_path / "jax"), cc.ENV_DIR, 7.0)  # the user's minimum is kept
        (tmp_path / "file").write_text("")
        c = cc.enable_compilation_cache(str(tmp_path / "file" / "sub"), {})  # cannot be created: off, no error
        assert c.path is None and c.source == "unwritable" and not jax.config.jax_enable_compilation_cache
    finally:
        for n, v in old.items():
            jax.config.update(n, v)


@pytest.mark.slow  # three Python processes that import JAX (~10-20 s on 2 busy cores)
def test_a_second_process_loads_the_programs_the_first_one_cached(tmp_path):
    default_dir = tmp_path / "xdg" / "jaxrl_post" / "xla"
    # min compile time 0: the child's small program is cached (the main job's default is MIN_COMPILE_TIME_S)
    first = _child(None, tmp_path, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    assert (first["path"], first["source"], first["min_s"]) == (str(default_dir), "default", 0.0)
    assert first["requests"] >= 1 and first["hits"] == 0
    entries = sorted(os.listdir(default_dir))
    assert entries, "the first process wrote no cache entry"
    second = _child(None, tmp_path, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    assert second["hits"] == second["requests"] == first["requests"]  # every program loaded, none compiled
    # '' turns it off, also when JAX's own variable names a directory
    off = _child("", tmp_path, JAX_COMPILATION_CACHE_DIR=str(default_dir))
    assert (off["path"], off["source"], off["enabled"], off["requests"]) == (None, "off", False, 0)
    assert sorted(os.listdir(default_dir)) == entries
    assert not (tmp_path / "home").exists()
