"""XLA flags the `jaxrl_post.main` job sets before JAX starts, unless the user's `XLA_FLAGS` sets them.

`--xla_cpu_enable_concurrency_optimized_scheduler=false`: XLA:CPU's default scheduler orders a program for
running independent ops side by side, which keeps their buffers alive together. Measured on the SmolLM2-135M
GRPO update (30 layers, 2 packed micro-batches of 2944 tokens, float32, this 2-core CPU): preallocated temp
9.2 -> 6.1 GB and the call ~47 -> ~41 s with the list scheduler instead. A CPU-only option (accelerator
programs are not affected). XLA reads `XLA_FLAGS` once, when JAX creates its first backend, and ignores
per-program `compiler_options` for this flag, so it has to be in the environment before that.

`--xla_cpu_experimental_ynn_fusion_type=-LIBRARY_FUSION_TYPE_REDUCE,-LIBRARY_FUSION_TYPE_ELTWISE` (jaxlib >= 0.10,
where it was measured; the flag does not exist before 0.8.1, and XLA aborts on an unknown flag): XLA:CPU hands
reductions and elementwise fusions to YNNPACK by default, and some of its reductions are slow (openxla/xla#46351;
here the attention backward's softmax row sums and RMSNorm weight gradients). Without those two fusion types
(its matmuls stay in YNNPACK) the DPO update runs ~1.3x faster and SFT is unchanged (docs/performance.md).
"""

from __future__ import annotations

import os
import re
from collections.abc import MutableMapping
from importlib import metadata

SCHEDULER_FLAG = "--xla_cpu_enable_concurrency_optimized_scheduler=false"
YNN_FLAG = "--xla_cpu_experimental_ynn_fusion_type=-LIBRARY_FUSION_TYPE_REDUCE,-LIBRARY_FUSION_TYPE_ELTWISE"
YNN_FLAG_SINCE = (0, 10)  # the jaxlib it was measured with (the flag exists from 0.8.1)


def _jaxlib_version() -> tuple[int, ...]:
    """(major, minor) of the installed jaxlib; (0, 0) if none or unparsable."""
    try:
        m = re.match(r"(\d+)\.(\d+)", metadata.version("jaxlib"))
    except metadata.PackageNotFoundError:
        return (0, 0)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def default_xla_flags(jaxlib_version: tuple[int, ...] | None = None) -> tuple[str, ...]:
    """The CPU defaults for `jaxlib_version` (default: the installed one): the list scheduler, and the YNNPACK
    fusion types from `YNN_FLAG_SINCE` on."""
    v = _jaxlib_version() if jaxlib_version is None else tuple(jaxlib_version)
    return (SCHEDULER_FLAG,) + ((YNN_FLAG,) if v >= YNN_FLAG_SINCE else ())


DEFAULT_XLA_FLAGS = default_xla_flags()


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
