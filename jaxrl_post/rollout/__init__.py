"""Rollout: jitted prefill + decode loop with a KV cache, the sampling processors, and the multi-turn agent loop
(tool parsers, tools, environments).

Names are imported lazily (PEP 562), so a tool worker process that unpickles `jaxrl_post.rollout.tools` does
not import jax.
"""

import importlib

_EXPORTS = {
    "TRACE_COUNTS": "decode",
    "compaction_sizes": "decode",
    "Generator": "generate",
    "bucket_size": "generate",
    "cpu_has_native_16bit_matmul": "generate",
    "generate_sequences": "generate",
    "kv_cache_dtype": "generate",
    "SamplingParams": "sampling",
    "apply_min_p": "sampling",
    "apply_temperature": "sampling",
    "apply_top_k": "sampling",
    "apply_top_p": "sampling",
    "filter_logits": "sampling",
    "get_response_mask": "sampling",
    "sample_tokens": "sampling",
}

__all__ = list(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"jaxrl_post.rollout.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'jaxrl_post.rollout' has no attribute {name!r}")


def __dir__():
    return sorted(__all__)
