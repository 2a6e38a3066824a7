"""Platform defaults in one place: what a config value "auto" becomes on CPU, GPU and TPU.

Config keys whose default is "auto" (configs/base.py) resolve here from `jax.default_backend()`; an explicit
value always wins. `resolve_config(cfg)` writes the resolved values into the config (the trainers call it
first, so everything after sees concrete values) and logs one line with every choice and where it came from.

| key | cpu | gpu | tpu |
|---|---|---|---|
| `model.dtype` (compute) | float32 | bfloat16 | bfloat16 |
| `model.remat` | False | 'nothing_saveable' | 'nothing_saveable' |
| `model.scan_layers` | False | True | True |
| `model.attention_impl` | 'xla' | 'cudnn' (bf16/fp16, no soft-cap) | 'splash' (`attention.resolve_attention_impl`) |
| rollout KV cache segments | an eighth of the cache each | one | one |
| host XLA flags / glibc malloc | `xla_flags.DEFAULT_XLA_FLAGS`, `host_malloc` | none | none |

Why: on CPU, float32 is what its matmuls run fastest and bitwise-reproducibly, remat costs ~20% of the
update, and scanned layers compiled slower (`decoder.Transformer`). On accelerators bf16 is the native
matmul type; remat (the named checkpoint policy that saves nothing per layer) is what makes long rows fit
(docs/performance.md, "Memory plan"); scanned layers keep every FSDP weight all-gather inside the layer loop
(tests/scripts/test_hlo_checks.py), where unrolled layers have XLA hoist them, holding every weight whole on every
device. A KV cache of several segments is a `lax.cond` per segment and layer in every decode step, which
XLA:GPU runs with a host round trip. The CPU-only XLA flag and glibc `mallopt` settings tune XLA:CPU's
buffer scheduling and the host allocator for a CPU run's large host buffers.

Micro-batch sizes are not resolved here (they stay the config's global counts on every platform).
"""

from __future__ import annotations

import importlib.util
import logging
import os
from collections.abc import Mapping, MutableMapping
from typing import Any

log = logging.getLogger(__name__)

AUTO = "auto"
PLATFORMS = ("cpu", "gpu", "tpu")
_ACCEL = {"model.dtype": "bfloat16", "model.remat": "nothing_saveable", "model.scan_layers": True}
DEFAULTS: dict[str, dict[str, Any]] = {
    "cpu": {"model.dtype": "float32", "model.remat": False, "model.scan_layers": False},
    "gpu": dict(_ACCEL),
    "tpu": dict(_ACCEL),
}
ONE_SEGMENT = 1 << 30  # `Generator.cache_segment_len` larger than any cache: one segment


def platform_name(platform: str | None = None) -> str:
    """'cpu' | 'gpu' | 'tpu' of `platform` (default `jax.default_backend()`; 'cuda' / 'rocm' -> 'gpu').
    Raises ValueError for another name."""
    if platform is None:
        import jax

        platform = jax.default_backend()
    p = "gpu" if platform in ("gpu", "cuda", "rocm") else platform
    if p not in PLATFORMS:
        raise ValueError(f"unknown platform {platform!r}; expected one of cpu, gpu, cuda, rocm, tpu")
    return p


def default(key: str, platform: str | None = None) -> Any:
    """The platform's value of `key` (a `DEFAULTS` key). Raises KeyError for a key without a platform default."""
    return DEFAULTS[platform_name(platform)][key]


def resolve(key: str, value: Any, platform: str | None = None) -> Any:
    """`value` unless it is "auto" (then the platform's default of `key`)."""
    return default(key, platform) if isinstance(value, str) and value == AUTO else value


def _get(cfg, dotted: str):
    node = cfg
    for part in dotted.split("."):
        node = node[part]
    return node


def _set(cfg, dotted: str, value) -> None:
    *parents, last = dotted.split(".")
    node = cfg
    for part in parents:
        node = node[part]
    if hasattr(node, "ignore_type"):  # a resolved copy (`copy_and_resolve_references`) types "auto" as str
        with node.ignore_type():
            node[last] = value
    else:
        node[last] = value


def resolve_value(key: str, value: Any, platform: str | None = None) -> Any:
    """`value`, or the platform's default for `key` (a `DEFAULTS` key such as "model.dtype") when it is "auto"
    (for code handed a config that `resolve_config` has not seen, e.g. a role's dtype falling back to
    `model.dtype`)."""
    if isinstance(value, str) and value == AUTO:
        return DEFAULTS[platform_name(platform)][key]
    return value


def log_resolved(resolved: dict[str, tuple[Any, str]], platform: str | None = None) -> None:
    """The one log line of `resolve_config(..., log=False)`'s result (trainers log it once the run directory
    and the data passed their checks, so a start-up error stays the only line)."""
    shown = ", ".join(f"{k}={v!r}" + (" (auto)" if s == "auto" else "") for k, (v, s) in resolved.items())
    log.info("platform defaults on %s: %s", platform_name(platform), shown)


def resolve_config(cfg, platform: str | None = None, *, log_line: bool = True) -> dict[str, tuple[Any, str]]:
    """Replace every "auto" among the `DEFAULTS` keys of `cfg` (an ml_collections ConfigDict or nested dict)
    by the platform's value, in place, and log one line. Idempotent. Keys missing from `cfg` are skipped.

    Returns {key: (value, 'auto' | 'config')}, plus 'model.attention_impl' (resolved for the line only: the
    model builder sets it, `builders.apply_attention_impl`) and 'rollout.cache_segment_len'.
    """
    p = platform_name(platform)
    out: dict[str, tuple[Any, str]] = {}
    for key in DEFAULTS[p]:
        try:
            value = _get(cfg, key)
        except (KeyError, AttributeError):
            continue
        if isinstance(value, str) and value == AUTO:
            _set(cfg, key, DEFAULTS[p][key])
            out[key] = (DEFAULTS[p][key], "auto")
        else:
            out[key] = (value, "config")
    try:
        # here, not at the top: this module runs before JAX starts and imports nothing that imports jax
        from jaxrl_post.models.attention import resolve_attention_impl

        impl = _get(cfg, "model.attention_impl")
        out["model.attention_impl"] = (
            resolve_attention_impl(impl, p, dtype=out.get("model.dtype", ("float32",))[0]),
            "auto" if impl == AUTO else "config",
        )
    except (KeyError, AttributeError, ValueError):  # a bad value is reported by the config check
        pass
    seg = cache_segment_len(p)
    out["rollout.cache_segment_len"] = ("one segment" if seg else "an eighth of the cache", "auto")
    if log_line:
        log_resolved(out, p)
    return out


def cache_segment_len(platform: str | None = None) -> int | None:
    """`Generator(cache_segment_len=...)` for the platform: None (the Generator's own choice, an eighth of
    the cache) on CPU, `ONE_SEGMENT` elsewhere (no per-segment `lax.cond` in decode)."""
    return None if platform_name(platform) == "cpu" else ONE_SEGMENT


def early_platform(environ: Mapping[str, str] | None = None) -> str:
    """The platform JAX will pick, WITHOUT starting a backend (host settings must be in place before): the
    first entry of `JAX_PLATFORMS` when set, else 'tpu' when libtpu is installed, 'gpu' when a CUDA / ROCm
    plugin is, else 'cpu'."""
    env = os.environ if environ is None else environ
    first = env.get("JAX_PLATFORMS", "").split(",")[0].strip().lower()
    if first:
        return "gpu" if first in ("cuda", "rocm", "gpu") else first if first in PLATFORMS else "cpu"
    found = lambda name: importlib.util.find_spec(name) is not None
    if found("libtpu"):
        return "tpu"
    if any(found(m) for m in ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm60_plugin", "jax_rocm7_plugin")):
        return "gpu"
    return "cpu"


def apply_host_defaults(environ: MutableMapping[str, str] | None = None, platform: str | None = None) -> list[str]:
    """Before JAX starts: on CPU only, the CPU XLA flags (`xla_flags.set_default_xla_flags`; the user's own
    value of a flag wins) and the glibc malloc settings (`host_malloc.release_freed_host_memory`; its
    environment variables win). Returns what was applied (flags and mallopt names); [] off CPU."""
    p = platform or early_platform(environ)
    if p != "cpu":
        return []
    # here, not at the top: this module runs before JAX starts and imports nothing that imports jax
    from jaxrl_post.runtime.host_malloc import release_freed_host_memory
    from jaxrl_post.runtime.xla_flags import set_default_xla_flags

    return set_default_xla_flags(environ) + release_freed_host_memory(environ)
