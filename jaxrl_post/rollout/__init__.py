"""Rollout: jitted prefill + decode loop with a KV cache, and the sampling processors."""

from jaxrl_post.rollout.decode import TRACE_COUNTS, compaction_sizes
from jaxrl_post.rollout.generate import (
    Generator,
    bucket_size,
    cpu_has_native_16bit_matmul,
    generate_sequences,
    kv_cache_dtype,
)
from jaxrl_post.rollout.sampling import (
    SamplingParams,
    apply_min_p,
    apply_temperature,
    apply_top_k,
    apply_top_p,
    filter_logits,
    get_response_mask,
    sample_tokens,
)

__all__ = [
    "Generator",
    "TRACE_COUNTS",
    "bucket_size",
    "compaction_sizes",
    "generate_sequences",
    "kv_cache_dtype",
    "cpu_has_native_16bit_matmul",
    "SamplingParams",
    "apply_min_p",
    "apply_temperature",
    "apply_top_k",
    "apply_top_p",
    "filter_logits",
    "get_response_mask",
    "sample_tokens",
]
