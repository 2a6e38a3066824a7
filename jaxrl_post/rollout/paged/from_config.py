"""The paged engine from the `rollout.*` keys (configs/base.py, verl's / vLLM's names) and its page budget from the
device memory (`rollout.gpu_memory_utilization`)."""

from __future__ import annotations

import logging

import jax

from jaxrl_post.errors import ConfigError
from jaxrl_post.rollout.generate import kv_cache_dtype
from jaxrl_post.rollout.paged.engine import PagedGenerator
from jaxrl_post.rollout.paged.kv_pool import pool_bytes

log = logging.getLogger(__name__)


def pages_for_memory(budget_bytes: int, model_config, page_size: int, dtype, tensor: int = 1) -> int:
    """Pages (null page included) whose pool fits in `budget_bytes` per device (e.g. `gpu_memory_utilization` x the
    device memory minus the weights): budget // bytes per page on one device (a page's kv heads split `tensor` ways)."""
    c = model_config
    per_page = pool_bytes(c.num_layers, 1, page_size, c.num_kv_heads, c.head_dim, dtype) // tensor
    return int(budget_bytes) // per_page


def paged_generator_from_config(
    model, rollout, return_routed_experts: bool = False, mesh=None, max_seq_len: int | None = None
) -> PagedGenerator:
    """The engine of `rollout.name='paged'` from the `rollout.*` keys (configs/base.py): `max_num_seqs`,
    `max_num_batched_tokens`, `block_size`, `num_scheduler_steps`, `max_model_len`, `enable_prefix_caching`,
    `cudagraph_capture_sizes`, and the pool from `num_gpu_blocks_override`, else `gpu_memory_utilization` x the
    device's memory limit minus the bytes in use (weights), else None (enough pages for every slot);
    return_routed_experts, mesh: as `PagedGenerator`'s. The sizes are per data-parallel replica (vLLM's engine
    arguments are per DP rank): each of the mesh's devices holds its replica's pool split `tensor` ways, so the page
    count from the memory budget of one device is right for every replica. max_seq_len: the longest sequence
    (prompt + response tokens) the run generates, when known.

    Raises:
      ConfigError: `gpu_memory_utilization` is set on a device without memory stats (XLA:CPU) or leaves no room
        for two pages, or for one sequence of `max_seq_len` tokens (plus the null page): found here, at the start,
        not by the scheduler at the first long batch.
      ValueError: `return_routed_experts` on a model without MoE layers."""
    pages = rollout.num_gpu_blocks_override
    if pages is None and rollout.gpu_memory_utilization is not None:
        device = jax.devices()[0] if mesh is None else mesh.devices.flat[0]  # each device holds the same share
        stats = device.memory_stats() or {}
        if "bytes_limit" not in stats:
            raise ConfigError(
                f"config.rollout.gpu_memory_utilization={rollout.gpu_memory_utilization}: the device "
                f"({getattr(device, 'platform', '?')}) reports no memory limit; "
                "set rollout.num_gpu_blocks_override (pages) instead"
            )
        budget = rollout.gpu_memory_utilization * stats["bytes_limit"] - stats.get("bytes_in_use", 0)
        dtype = kv_cache_dtype(model)
        tp = 1 if mesh is None else int(dict(mesh.shape).get("tensor", 1))
        pages = pages_for_memory(int(budget), model.config, int(rollout.block_size), dtype, tp)
        need = 1 + (1 if max_seq_len is None else -(-int(max_seq_len) // int(rollout.block_size)))
        if pages < max(2, need):
            longest = "" if max_seq_len is None else f" (one sequence of {max_seq_len} tokens needs {need})"
            raise ConfigError(
                f"config.rollout.gpu_memory_utilization={rollout.gpu_memory_utilization}: leaves {pages} KV pages "
                f"after the bytes in use{longest}; raise it or set rollout.num_gpu_blocks_override"
            )
        log.info("paged rollout: %d KV pages of %d tokens (%.2f GB)", pages, rollout.block_size, budget / 1e9)
    return PagedGenerator(
        model,
        max_num_seqs=int(rollout.max_num_seqs),
        max_num_batched_tokens=int(rollout.max_num_batched_tokens),
        page_size=int(rollout.block_size),
        num_pages=pages,
        steps_per_dispatch=int(rollout.num_scheduler_steps),
        max_model_len=rollout.get("max_model_len"),
        enable_prefix_caching=bool(rollout.get("enable_prefix_caching", True)),
        cudagraph_capture_sizes=rollout.get("cudagraph_capture_sizes"),
        return_routed_experts=return_routed_experts,
        mesh=mesh,
    )
