"""XLA flags the `jaxrl_post.main` job sets before JAX starts, unless the user's `XLA_FLAGS` sets them.

`--xla_cpu_enable_concurrency_optimized_scheduler=false`: XLA:CPU's default scheduler orders a program for
running independent ops side by side, which keeps their buffers alive together. Measured on the SmolLM2-135M
GRPO update (30 layers, 2 packed micro-batches of 2944 tokens, float32, this 2-core CPU): preallocated temp
9.2 -> 6.1 GB and the call ~47 -> ~41 s with the list scheduler instead. A CPU-only option (accelerator
programs are not affected). XLA reads `XLA_FLAGS` once, when JAX creates its first backend, and ignores
per-program `compiler_options` for this flag, so it has to be in the environment before that.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

DEFAULT_XLA_FLAGS = ("--xla_cpu_enable_concurrency_optimized_scheduler=false",)


def set_default_xla_flags(environ: MutableMapping[str, str] | None = None) -> list[str]:
    """Append each flag of `DEFAULT_XLA_FLAGS` to `environ["XLA_FLAGS"]` (default `os.environ`) unless that
    flag name is already there (the user's value wins). Returns the flags added. Call it before JAX creates
    a backend (before the first `jax.devices()` / computation); later calls have no effect on this process."""
    env = os.environ if environ is None else environ
    current = env.get("XLA_FLAGS", "")
    names = {tok.split("=", 1)[0] for tok in current.split()}
    added = [f for f in DEFAULT_XLA_FLAGS if f.split("=", 1)[0] not in names]
    if added:
        env["XLA_FLAGS"] = " ".join([current.strip()] + added if current.strip() else added)
    return added
