"""JAX's persistent compilation cache for the main job: on by default, so a restart reuses the compiled programs.

`python -m jaxrl_post.main` calls `enable_compilation_cache(config.trainer.compilation_cache_dir)` before it builds
the trainer. The directory, first match wins:

1. `trainer.compilation_cache_dir` when set: a path (`~` expanded), or `''` to turn the cache off;
2. JAX's own `JAX_COMPILATION_CACHE_DIR` environment variable (the test suite points it at a temporary directory);
3. `$XDG_CACHE_HOME/jaxrl_post/xla` (default `~/.cache/jaxrl_post/xla`).

Programs that compile in at least `jax_persistent_cache_min_compile_time_secs` are written (`MIN_COMPILE_TIME_S`
unless `JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS` is set; JAX's own default is 1 s, which leaves out most of a
tiny run's programs). The entry size floor and the size cap are JAX's (`jax_persistent_cache_min_entry_size_bytes`,
`jax_compilation_cache_max_size`: unbounded). JAX keys an entry by the program, the compile options, the devices
and the jax / jaxlib versions, so a changed config or an upgrade compiles anew (nothing stale is loaded); deleting
the directory is always safe. The measured effect is in docs/performance.md ("Persistent compilation cache").
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import NamedTuple

log = logging.getLogger(__name__)

ENV_DIR = "JAX_COMPILATION_CACHE_DIR"  # JAX reads it itself at import; ours only decides the default
ENV_MIN_COMPILE_TIME = "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"
MIN_COMPILE_TIME_S = 0.1  # seconds; see the module docstring


def default_cache_dir(environ: Mapping[str, str] | None = None) -> str:
    """`$XDG_CACHE_HOME/jaxrl_post/xla`, or `~/.cache/jaxrl_post/xla` when XDG_CACHE_HOME is unset or empty."""
    env = os.environ if environ is None else environ
    base = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "jaxrl_post", "xla")


def resolve_cache_dir(value: str | None, environ: Mapping[str, str] | None = None) -> tuple[str | None, str]:
    """(directory or None when off, where it came from: 'config' | ENV_DIR | 'default' | 'off') for the config
    value `value` (`trainer.compilation_cache_dir`: None = not set, '' = off, else a path)."""
    env = os.environ if environ is None else environ
    if value is not None:
        return (os.path.abspath(os.path.expanduser(value)), "config") if value else (None, "off")
    if env.get(ENV_DIR):
        return os.path.abspath(os.path.expanduser(env[ENV_DIR])), ENV_DIR
    return default_cache_dir(env), "default"


class CacheChoice(NamedTuple):
    """What `enable_compilation_cache` set: directory (None: off), where it came from (`resolve_cache_dir`),
    and the minimum compile time of a cached program (seconds)."""

    path: str | None
    source: str
    min_compile_time_s: float


def enable_compilation_cache(value: str | None, environ: Mapping[str, str] | None = None) -> CacheChoice:
    """Point JAX's persistent compilation cache at `resolve_cache_dir(value)` (or turn it off) and set the minimum
    compile time of a cached program. Call before the first compilation; `log_choice` logs the one line (the main
    job logs it once the config passed its checks, so a start-up error stays the only line). A directory that
    cannot be created turns the cache off (logged as a warning; the run goes on without it)."""
    import jax  # here, not at the top: main.py imports this module before it sets the XLA flags

    env = os.environ if environ is None else environ
    path, source = resolve_cache_dir(value, env)
    if path is not None:
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as e:
            log.warning("persistent compilation cache off: cannot create %s (%s)", path, e)
            path, source = None, "unwritable"
    if path is None:
        jax.config.update("jax_enable_compilation_cache", False)
        return CacheChoice(None, source, 0.0)
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_compilation_cache_dir", path)
    if not env.get(ENV_MIN_COMPILE_TIME):
        jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_TIME_S)
    return CacheChoice(path, source, float(jax.config.jax_persistent_cache_min_compile_time_secs))


def log_choice(choice: CacheChoice) -> None:
    """One INFO line: where compiled programs are cached, or that the cache is off and why."""
    if choice.path is None:
        why = "trainer.compilation_cache_dir=''" if choice.source == "off" else "the directory cannot be created"
        log.info("persistent compilation cache: off (%s)", why)
        return
    where = {"config": "trainer.compilation_cache_dir", ENV_DIR: ENV_DIR, "default": "default"}[choice.source]
    log.info(
        "persistent compilation cache: %s (%s; programs compiled in >= %g s)",
        choice.path,
        where,
        choice.min_compile_time_s,
    )
