"""`rollout.name='paged'` (issue 56): the keys are validated with one error naming the key, the engine is built from
them, and a tiny GRPO run trains two steps with the paged engine generating (slow), its prompts sharing the chat
template's head by content (the `rollout/prefix_cache_*` metrics are the engine's counts)."""

import os
import sys

import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from configs import grpo
from jaxrl_post.errors import ConfigError
from jaxrl_post.models import ModelConfig, init_model
from jaxrl_post.rl.config_check import validate_config
from jaxrl_post.rollout.paged.engine import PagedGenerator
from jaxrl_post.rollout.paged.from_config import paged_generator_from_config


def _paged(**keys):
    c = grpo.get_config("tiny")
    c.rollout.name = "paged"
    for k, v in keys.items():
        c.rollout[k] = v
    return c


def test_paged_keys_are_validated():
    validate_config(_paged(), n_devices=1)
    validate_config(_paged(num_gpu_blocks_override=14), n_devices=1)  # one longest sequence fits
    validate_config(_paged(cudagraph_capture_sizes=(1, 2, 4, 8)), n_devices=1)
    cases = [
        (dict(name="vllm"), r"config\.rollout\.name='vllm': valid: 'dense', 'paged'"),
        (dict(max_num_seqs=0), r"config\.rollout\.max_num_seqs=0: must be an integer >= 1"),
        (dict(block_size=0), r"config\.rollout\.block_size=0: must be an integer >= 1"),
        (dict(gpu_memory_utilization=1.5), r"config\.rollout\.gpu_memory_utilization=1\.5: must be in \(0, 1\]"),
        (dict(num_gpu_blocks_override=1), r"config\.rollout\.num_gpu_blocks_override=1"),
        (dict(max_num_seqs=3), r"config\.rollout\.max_num_seqs=3: must be >= rollout\.n=4"),
        (dict(cudagraph_capture_sizes=(8, 0)), r"config\.rollout\.cudagraph_capture_sizes=\(8, 0\): must be None or"),
        (dict(cudagraph_capture_sizes=()), r"config\.rollout\.cudagraph_capture_sizes=\(\): must be None or"),
        # tiny: 192 prompt + 12 response tokens = 13 pages of 16, + the null page
        (
            dict(num_gpu_blocks_override=13),
            r"^invalid config:\n  config\.rollout\.num_gpu_blocks_override=13: must be >= 14: one sequence of "
            r"data\.max_prompt_length \+ data\.max_response_length = 204 tokens needs 13 pages of "
            r"rollout\.block_size=16, plus the null page$",
        ),
    ]
    for keys, msg in cases:
        with pytest.raises(ConfigError, match=msg):
            validate_config(_paged(**keys), n_devices=1)
    with pytest.raises(ConfigError, match=r"config\.rollout\.name='paged': 'paged' runs on one device .*replicas"):
        validate_config(_paged(), n_devices=8)
    c = _paged()
    c.rollout.tensor_model_parallel_size = 1  # 4 one-device replicas, an engine each
    validate_config(c, n_devices=4)
    c = _paged()
    c.rollout.multi_turn.enable = True  # the agent loop runs on the paged engine (rollout/paged/session.py)
    validate_config(c, n_devices=1)


def test_engine_from_the_rollout_keys():
    model = init_model(
        ModelConfig(
            vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8
        ),
        seed=0,
    )
    r = _paged(
        max_num_seqs=3, max_num_batched_tokens=64, block_size=8, num_scheduler_steps=4, num_gpu_blocks_override=40
    ).rollout
    eng = paged_generator_from_config(model, r)
    assert isinstance(eng, PagedGenerator)
    assert (eng.max_num_seqs, eng.max_num_batched_tokens, eng.page_size, eng.steps_per_dispatch, eng.num_pages) == (
        3,
        64,
        8,
        4,
        40,
    )
    assert eng.enable_prefix_caching and eng.prefix_caching  # verl's / vLLM's default
    r.enable_prefix_caching = False
    assert not paged_generator_from_config(model, r).prefix_caching
    assert eng.decode_sizes == (3,)  # max_num_seqs 3: one decode batch size
    r.max_num_seqs, r.cudagraph_capture_sizes = 64, (4, 16, 128)
    assert paged_generator_from_config(model, r).decode_sizes == (4, 16, 64)
    r.num_gpu_blocks_override, r.gpu_memory_utilization = None, 0.5
    with pytest.raises(ConfigError) as e:
        paged_generator_from_config(model, r)  # XLA:CPU devices report no memory stats
    assert str(e.value) == (
        "config.rollout.gpu_memory_utilization=0.5: the device (cpu) reports no memory limit; "
        "set rollout.num_gpu_blocks_override (pages) instead"
    )


def test_page_budget_per_device_of_a_replicated_mesh():
    """`gpu_memory_utilization` on a data 2 x tensor 2 rollout mesh: the pages that fit one device of the mesh
    (each device holds its replica's pool split over 2 kv-head shards), counted by hand; a budget too small for the
    run's longest sequence is one config line at build time."""
    import types

    model = init_model(
        ModelConfig(
            vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2, num_kv_heads=2, head_dim=8
        ),
        seed=0,
    )
    device = types.SimpleNamespace(memory_stats=lambda: {"bytes_limit": 1_000_000, "bytes_in_use": 100_000})
    mesh = types.SimpleNamespace(
        shape={"data": 2, "fsdp": 1, "expert": 1, "tensor": 2}, devices=np.array([[[[device]]]], dtype=object)
    )
    r = _paged(block_size=8, gpu_memory_utilization=0.5).rollout
    eng = paged_generator_from_config(model, r, mesh=mesh)
    # a page: 1 layer x 8 tokens x (2 kv heads x key, value) x 8 dims x 4 bytes = 1024 B, 512 B per tensor shard
    assert eng.num_pages == (500_000 - 100_000) // 512 == 781
    assert eng.replicas == 2 and eng.max_num_seqs == r.max_num_seqs  # the sizes are per replica
    # the longest sequence must fit with the null page: 6240 tokens = 780 pages + 1 fits 781; 6241 needs 781 + 1
    assert paged_generator_from_config(model, r, mesh=mesh, max_seq_len=6240).num_pages == 781
    with pytest.raises(ConfigError) as e:
        paged_generator_from_config(model, r, mesh=mesh, max_seq_len=6241)
    assert str(e.value) == (
        "config.rollout.gpu_memory_utilization=0.5: leaves 781 KV pages after the bytes in use (one sequence of 6241 "
        "tokens needs 782); raise it or set rollout.num_gpu_blocks_override"
    )


@pytest.mark.slow  # a tiny GRPO run, two steps (~60 s on 2 loaded cores)
def test_grpo_tiny_trains_with_the_paged_engine(tmp_path):
    from jaxrl_post.rl.trainer import RLTrainer

    # 27 pages: one longest sequence (204 tokens) + the null page; two groups of 4 outgrow it (a preemption a call)
    c = _paged(
        max_num_seqs=8, max_num_batched_tokens=64, block_size=8, num_scheduler_steps=4, num_gpu_blocks_override=27
    )
    c.trainer.default_local_dir = str(tmp_path / "run")
    trainer = RLTrainer(c, console_write=lambda s: None)
    try:
        assert isinstance(trainer.rollout.generator, PagedGenerator)
        role, calls = trainer.rollout, []
        count = role._count_engine_stats
        role._count_engine_stats = lambda: (calls.append(dict(role.generator.last_stats)), count())
        hist = trainer.fit()["history"]
        assert len(hist) == 2 and all(np.isfinite(v) for m in hist for v in m.values())
        assert all(m["response_length/max"] <= c.data.max_response_length for m in hist)
        st = trainer.rollout.generator.last_stats
        assert st["emitted"] > 0 and st["decode_dispatches"] > 0
        # each step's prompts share the chat template's head by content: its metrics are its call's counts
        assert len(calls) == 2
        for m, call in zip(hist, calls):
            assert m["rollout/prefix_cache_queries"] == call["prefix_cache_queries"] > 0
            assert m["rollout/prefix_cache_hits"] == call["prefix_cache_hits"] > 0
            assert m["rollout/prefix_cache_hit_rate"] == call["prefix_cache_hits"] / call["prefix_cache_queries"]
            assert m["rollout/num_preemptions"] == call["preemptions"]
        assert sum(call["preemptions"] for call in calls) > 0
    finally:
        trainer.close()
