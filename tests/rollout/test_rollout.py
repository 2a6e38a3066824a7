"""Rollout (issue 4): greedy parity with transformers, log-prob parity with the training path, EOS handling,
compile-once bucketing, sharded == unsharded on 8 fake CPU devices, SmolLM2 greedy parity (slow)."""

import dataclasses
import json
import os
import pathlib
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl_post.algos.core_algos import logprobs_from_logits
from jaxrl_post.batch.protocol import DataProto
from jaxrl_post.models import ModelConfig, init_model, load_hf_dir
from jaxrl_post.rollout import (
    TRACE_COUNTS,
    Generator,
    SamplingParams,
    bucket_size,
    compaction_sizes,
    generate_sequences,
)
from jaxrl_post.rollout import generate as gen_mod
from tests.cheap_compile import CHEAP_COMPILE_FLAGS

REPO = pathlib.Path(__file__).resolve().parents[2]
SLIDING, FULL = "sliding_attention", "full_attention"

TINY = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    eos_token_id=None,
    pad_token_id=0,
    bos_token_id=1,
)
FAMILIES = {
    "llama": dict(family="llama"),
    "qwen2": dict(family="qwen2", qkv_bias=True, tie_word_embeddings=True),
    "qwen3": dict(family="qwen3", qk_norm=True),
    "gemma2": dict(
        family="gemma2",
        norm_offset=1.0,
        embed_scale=True,
        post_norms=True,
        hidden_act="gelu_pytorch_tanh",
        tie_word_embeddings=True,
        attn_logit_softcap=50.0,
        final_logit_softcap=30.0,
        sliding_window=6,
        query_pre_attn_scalar=16,
        layer_types=(SLIDING, FULL),
    ),
    "gemma3": dict(
        family="gemma3",
        norm_offset=1.0,
        embed_scale=True,
        post_norms=True,
        qk_norm=True,
        hidden_act="gelu_pytorch_tanh",
        tie_word_embeddings=True,
        sliding_window=6,
        query_pre_attn_scalar=16,
        rope_local_base_freq=10000.0,
        layer_types=(SLIDING, FULL),
    ),
}


def _left_padded_prompts(lengths, p, vocab, seed=0):
    rng = np.random.default_rng(seed)
    ids = np.zeros((len(lengths), p), np.int32)
    mask = np.zeros((len(lengths), p), np.int32)
    for i, n in enumerate(lengths):
        ids[i, p - n :] = rng.integers(3, vocab, size=n)
        mask[i, p - n :] = 1
    return ids, mask


def _sharpen(model, scale=6.0):
    """Scale matrices so logits of a random model are well separated (no float near-ties in argmax)."""
    state = nnx.state(model, nnx.Param)
    nnx.update(model, jax.tree.map(lambda x: x * scale if x.ndim >= 2 else x, state))
    return model


def _tiny(seed=0, **overrides):
    return _sharpen(init_model(ModelConfig(**{**TINY, **overrides}), seed=seed))


# ------------------------------------------------------------------------ greedy parity with HF


def _hf_tiny(tmp_path, fam):
    torch = pytest.importorskip("torch")
    import transformers

    cfg = ModelConfig(**{**TINY, **FAMILIES[fam]})
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_hf_config()))
    hf_cfg = transformers.AutoConfig.from_pretrained(tmp_path)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(hf_cfg, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        for _name, p in hf.named_parameters():
            if p.ndim >= 2:
                p.normal_(0.0, 0.15)
            else:  # norms: random around the family's identity so the offset convention matters
                p.copy_(torch.randn_like(p) * 0.1 + (0.0 if cfg.norm_offset else 1.0))
    hf.save_pretrained(tmp_path / "hf", safe_serialization=True)
    return hf, cfg


@pytest.mark.parametrize("fam", sorted(FAMILIES))
@pytest.mark.slow
def test_greedy_matches_transformers(tmp_path, fam):
    import torch

    hf, cfg = _hf_tiny(tmp_path, fam)
    model = load_hf_dir(tmp_path / "hf", "float32")
    ids, mask = _left_padded_prompts([7, 3, 10, 5], 10, cfg.vocab_size, seed=1)
    with torch.no_grad():
        ref = hf.generate(
            input_ids=torch.from_numpy(ids).long(),
            attention_mask=torch.from_numpy(mask).long(),
            do_sample=False,
            max_new_tokens=32,
            min_new_tokens=32,
            pad_token_id=0,
            eos_token_id=None,
        ).numpy()[:, ids.shape[1] :]
    out = generate_sequences(
        model,
        DataProto.from_dict({"input_ids": ids, "attention_mask": mask}),
        SamplingParams(max_new_tokens=32, do_sample=False),
    )
    assert ref.shape == (4, 32)
    np.testing.assert_array_equal(out.batch["responses"], ref)
    assert out.batch["truncated"].all()


# ------------------------------------------------------------------------ log-probs, EOS, outputs


@pytest.fixture(scope="module")
def tiny_model():
    return _tiny(seed=3)


# Shared shapes/params so the tests below reuse compiled functions (batch bucket 4, prompt bucket 16, R=16).
EOS = (5, 7)
SAMPLED = SamplingParams(max_new_tokens=16, temperature=1.3, top_p=0.8, eos_token_ids=EOS, seed=11)
FILTERED = SamplingParams(
    max_new_tokens=16, temperature=0.7, top_k=20, top_p=0.9, min_p=0.02, eos_token_ids=EOS, seed=11
)
GREEDY = SamplingParams(max_new_tokens=16, do_sample=False)


def _prompts(seed, lengths=(6, 2, 9, 4), p=9):
    ids, mask = _left_padded_prompts(list(lengths), p, 256, seed=seed)
    return ids, mask, DataProto.from_dict({"input_ids": ids, "attention_mask": mask})


_forward = jax.jit(lambda model, ids, mask: model(ids, mask))  # the plain forward, compiled (eager: op by op)


def _full_forward_logprobs(model, out, temperature):
    p = out.batch["prompts"].shape[1]
    logits = _forward(model, jnp.asarray(out.batch["input_ids"]), jnp.asarray(out.batch["attention_mask"]))
    return np.asarray(logprobs_from_logits(logits[:, p - 1 : -1], jnp.asarray(out.batch["responses"]), temperature))


@pytest.mark.parametrize("params", [SAMPLED, FILTERED, GREEDY], ids=["temp-top_p", "top_k-top_p-min_p", "greedy"])
@pytest.mark.slow
def test_rollout_log_probs_equal_training_path(tiny_model, params):
    ids, mask, dp = _prompts(2)
    out = generate_sequences(tiny_model, dp, params)
    b = out.batch
    rm = b["response_attention_mask"].astype(bool)
    ref = _full_forward_logprobs(tiny_model, out, params.temperature if not params.greedy else 1.0)
    np.testing.assert_allclose(np.where(rm, b["rollout_log_probs"], 0), np.where(rm, ref, 0), atol=1e-5)
    # output layout
    np.testing.assert_array_equal(b["prompts"], ids)
    np.testing.assert_array_equal(b["input_ids"], np.concatenate([ids, b["responses"]], 1))
    np.testing.assert_array_equal(b["attention_mask"], np.concatenate([mask, b["response_attention_mask"]], 1))
    pos = np.maximum(np.cumsum(b["attention_mask"], 1) - 1, 0)
    valid = b["attention_mask"].astype(bool)
    np.testing.assert_array_equal(b["position_ids"][valid], pos[valid])
    np.testing.assert_array_equal(np.diff(b["position_ids"][:, 9:], axis=1), 1)
    assert b["rollout_log_probs"].dtype == np.float32 and b["responses"].dtype == np.int32
    assert np.all(b["rollout_log_probs"][~rm] == 0) and np.all(b["responses"][~rm] == 0)
    is_eos = np.isin(b["responses"], params.eos_token_ids) & rm
    np.testing.assert_array_equal(b["truncated"], ~is_eos.any(1))
    assert np.all(b["rollout_log_probs"][rm] <= 0)


@pytest.mark.slow  # rollout and replayed training-path compiles (33 s on 2 shared, loaded cores)
def test_truncated_rollout_log_probs_equal_replayed_training_path(tiny_model):
    """Mask replay: with `truncated_log_probs`, the rollout's log-probs (of the truncated distribution it
    drew from) equal the training forward's `truncated_logprobs_from_logits` with the returned thresholds,
    so an on-policy ratio is 1 with top-k/top-p/min-p on; the full-softmax training log-prob is not."""
    from jaxrl_post.algos.core_algos import truncated_logprobs_from_logits

    params = dataclasses.replace(FILTERED, truncated_log_probs=True)
    _, _, dp = _prompts(3)
    out = generate_sequences(tiny_model, dp, params)
    b = out.batch
    rm = b["response_attention_mask"].astype(bool)
    p = b["prompts"].shape[1]
    logits = tiny_model(jnp.asarray(b["input_ids"]), jnp.asarray(b["attention_mask"]))[:, p - 1 : -1]
    th = b["sampling_logit_threshold"]
    assert th.shape == rm.shape and np.all(np.isfinite(th[rm])) and np.all(th[~rm] == -np.inf)
    replay = np.asarray(
        truncated_logprobs_from_logits(logits, jnp.asarray(b["responses"]), jnp.asarray(th), params.temperature)
    )
    np.testing.assert_allclose(np.where(rm, b["rollout_log_probs"], 0), np.where(rm, replay, 0), atol=1e-5)
    full = _full_forward_logprobs(tiny_model, out, params.temperature)
    assert np.max(np.where(rm, b["rollout_log_probs"] - full, 0)) > 0.05  # truncation renormalizes: lp rises


@pytest.mark.slow
def test_bf16_rollout_keeps_a_float32_kv_cache_on_cpu(monkeypatch):
    """bf16 compute on CPU: the KV cache defaults to float32 (XLA:CPU would copy every bf16 cache segment on
    each slot write); the float32 slots hold the bf16 keys/values exactly, so tokens and log-probs equal a
    bf16-cache rollout bit for bit, and both match the bf16 training forward to bf16 rounding."""
    from jaxrl_post.rollout import generate as gen_mod
    from jaxrl_post.rollout import kv_cache_dtype

    model = _sharpen(init_model(ModelConfig(**TINY), seed=3, dtype="bfloat16", param_dtype="bfloat16"))
    assert jax.default_backend() == "cpu"
    assert kv_cache_dtype(model) == "float32" and kv_cache_dtype(model, "bfloat16") == "bfloat16"
    assert kv_cache_dtype(_tiny(seed=3)) == "float32"
    used, prefill = [], gen_mod._prefill
    monkeypatch.setattr(gen_mod, "_prefill", lambda *a, **kw: used.append(kw["cache_dtype"]) or prefill(*a, **kw))
    _, _, dp = _prompts(2)
    outs = [Generator(model, cache_dtype=c, cache_segment_len=8)(dp, SAMPLED) for c in (None, "bfloat16")]  # 3 segments
    assert used == ["float32", "bfloat16"]
    (f32, bf16) = (o.batch for o in outs)
    np.testing.assert_array_equal(f32["responses"], bf16["responses"])
    np.testing.assert_array_equal(f32["rollout_log_probs"], bf16["rollout_log_probs"])
    rm = f32["response_attention_mask"].astype(bool)
    ref = _full_forward_logprobs(model, outs[0], SAMPLED.temperature)
    # bf16 forward: different op shapes (one cached token vs the full sequence) round differently
    np.testing.assert_allclose(np.where(rm, f32["rollout_log_probs"], 0), np.where(rm, ref, 0), atol=0.05)


def test_sampling_seeded_and_reproducible(tiny_model):
    ids, mask, dp = _prompts(4)
    a = generate_sequences(tiny_model, dp, SAMPLED).batch["responses"]
    b = generate_sequences(tiny_model, dp, SAMPLED).batch["responses"]
    c = generate_sequences(tiny_model, dp, SAMPLED, seed=6).batch["responses"]
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    # a row's result does not depend on the rest of the batch (per-row keys; 3 rows + 1 filler row)
    d = generate_sequences(tiny_model, DataProto.from_dict({"input_ids": ids[:3], "attention_mask": mask[:3]}), SAMPLED)
    np.testing.assert_array_equal(d.batch["responses"], a[:3])


def test_eos_handling(tiny_model):
    _ids, _mask, dp = _prompts(5)
    free = generate_sequences(tiny_model, dp, GREEDY).batch["responses"]
    # EOS = row 1's first token (EOS at the first step) and pad == EOS
    eos = int(free[1, 0])
    out = generate_sequences(
        tiny_model, dp, SamplingParams(max_new_tokens=16, do_sample=False, eos_token_ids=(eos,), pad_token_id=eos)
    ).batch
    for r in range(4):
        hits = np.flatnonzero(free[r] == eos)
        if hits.size == 0:
            np.testing.assert_array_equal(out["responses"][r], free[r])
            assert out["response_attention_mask"][r].all() and out["truncated"][r]
        else:
            k = hits[0]
            np.testing.assert_array_equal(out["responses"][r, : k + 1], free[r, : k + 1])
            assert np.all(out["responses"][r, k + 1 :] == eos)  # pad == EOS
            np.testing.assert_array_equal(out["response_attention_mask"][r], np.arange(16) <= k)
            assert not out["truncated"][r]
    assert out["response_attention_mask"][1].sum() == 1
    # several EOS ids, pad distinct; every row's first token is an EOS -> early exit after one chunk
    eos2 = tuple(int(t) for t in free[:, 0])
    out2 = generate_sequences(
        tiny_model, dp, SamplingParams(max_new_tokens=16, do_sample=False, eos_token_ids=eos2, pad_token_id=0)
    ).batch
    np.testing.assert_array_equal(out2["response_attention_mask"].sum(1), [1, 1, 1, 1])
    np.testing.assert_array_equal(out2["responses"][:, 0], free[:, 0])
    assert np.all(out2["responses"][:, 1:] == 0) and not out2["truncated"].any()


def test_input_validation(tiny_model):
    ids = np.array([[5, 6, 0]], np.int32)
    with pytest.raises(ValueError, match="left-padded"):
        generate_sequences(
            tiny_model,
            DataProto.from_dict({"input_ids": ids, "attention_mask": [[1, 1, 0]]}),
            SamplingParams(max_new_tokens=2),
        )
    with pytest.raises(ValueError, match="real token"):
        generate_sequences(
            tiny_model,
            DataProto.from_dict({"input_ids": ids, "attention_mask": [[0, 0, 0]]}),
            SamplingParams(max_new_tokens=2),
        )


def test_bucket_size():
    assert bucket_size(5, None, minimum=16) == 16
    assert bucket_size(17, None, minimum=16) == 32
    assert bucket_size(3, None) == 4
    assert bucket_size(3, None, multiple_of=8) == 8
    assert bucket_size(33, (32, 64, 128)) == 64
    assert bucket_size(9, (8, 12), multiple_of=8) == 16
    with pytest.raises(ValueError):
        bucket_size(200, (64, 128))


def test_compaction_sizes():
    assert compaction_sizes(64) == (64, 32, 16, 8)
    assert compaction_sizes(64, min_rows=20) == (64, 32)
    assert compaction_sizes(48, groups=4, min_rows=2) == (48, 24, 12)  # 12 rows = 3 per shard: odd, stop
    assert compaction_sizes(16, groups=4, min_rows=1) == (16, 8, 4)  # never below one row per shard
    assert compaction_sizes(8, min_rows=8) == (8,) and compaction_sizes(8, min_rows=64) == (8,)


@pytest.mark.slow
def test_compacting_finished_rows_changes_no_sample():
    """Decode at 16 -> 8 -> 4 -> 2 rows as rows finish gives exactly the tokens, thresholds and log-probs of
    the uncompacted decode (per-row keys: a row draws the same numbers wherever it sits), and the smaller
    sizes really ran (rows of very different lengths: some end at once, some run to the limit)."""
    model = _tiny(seed=4, vocab_size=64)
    ids, mask = _left_padded_prompts([10, 3, 7, 1, 9, 5, 8, 2, 6, 4, 10, 7, 3, 9, 1, 5], 10, 64, seed=3)
    dp = DataProto.from_dict({"input_ids": ids, "attention_mask": mask})
    params = SamplingParams(max_new_tokens=40, temperature=1.0, top_p=0.95, eos_token_ids=(4, 5, 6, 7, 8), seed=1)
    plain = Generator(model, compact_min_rows=None, decode_chunk=4, cache_segment_len=16)  # 4 cache segments
    compact = Generator(model, compact_min_rows=2, decode_chunk=4, cache_segment_len=16)
    a, b = plain(dp, params).batch, compact(dp, params).batch
    lengths = a["response_attention_mask"].sum(1)
    assert lengths.min() <= 2 and lengths.max() == 40 and (lengths == 40).sum() == 3, lengths
    assert plain.last_decode_stats == {"sizes": (16,), "stage_end_step": [40]}
    assert compact.last_decode_stats["sizes"] == (16, 8, 4, 2)
    # each size's loop ends at the first chunk boundary (4 steps) where <= the next size of rows are unfinished
    unfinished = [np.sum((lengths > t) | a["truncated"]) for t in range(41)]
    ends, t = [], 0
    for nxt in (8, 4, 2, 0):
        while t < 40 and unfinished[t] > nxt:
            t += 4
        ends.append(t)
    assert ends[0] < ends[1] < ends[2] == 40, ends  # the 8- and 4-row loops ran steps (3 rows run to the end)
    assert compact.last_decode_stats["stage_end_step"] == ends
    for k in ("responses", "response_attention_mask", "truncated", "sampling_logit_threshold", "position_ids"):
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    np.testing.assert_allclose(a["rollout_log_probs"], b["rollout_log_probs"], atol=1e-6)


@pytest.mark.slow
def test_n_samples_per_prompt_share_one_prefill():
    """`generate(prompts, n=3)` == generating from `prompts.repeat(3, interleave=True)` (same tokens, masks,
    thresholds, non-tensor data; log-probs to float32 rounding: the prefill ran at another batch size), with
    the prefill traced for 3 prompts (its input is the unique prompts, its cache rows are then copied)."""
    model = _tiny(seed=6, vocab_size=96)
    ids, mask = _left_padded_prompts([6, 2, 9], 9, 96, seed=5)
    dp = DataProto.from_dict({"input_ids": ids, "attention_mask": mask}, {"uid": np.array(["a", "b", "c"])})
    params = SamplingParams(max_new_tokens=12, temperature=1.0, top_p=0.9, eos_token_ids=(4, 5, 6), seed=2)
    gen = Generator(model, decode_chunk=4, compact_min_rows=2)
    a = gen.generate(dp.repeat(3, interleave=True), params)
    shapes = []
    real_prefill = gen_mod._prefill
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(
            gen_mod,
            "_prefill",
            lambda g, s, i, *args, **kw: shapes.append(i.shape) or real_prefill(g, s, i, *args, **kw),
        )
        b = gen.generate(dp, params, n=3)
    assert shapes == [(4, 16)], shapes  # 3 prompts (bucket 4), not 9 rows
    assert len(b) == 9 and list(b.non_tensor_batch["uid"]) == list(a.non_tensor_batch["uid"])
    for k in (
        "prompts",
        "responses",
        "input_ids",
        "attention_mask",
        "position_ids",
        "response_attention_mask",
        "truncated",
    ):
        np.testing.assert_array_equal(a.batch[k], b.batch[k], err_msg=k)
    np.testing.assert_allclose(a.batch["sampling_logit_threshold"], b.batch["sampling_logit_threshold"], atol=1e-5)
    np.testing.assert_allclose(a.batch["rollout_log_probs"], b.batch["rollout_log_probs"], atol=1e-5)
    assert len({tuple(r) for r in b.batch["responses"][:3]}) > 1  # the samples of one prompt differ
    for bad in (0, 2.5, True):
        with pytest.raises(ValueError, match="n \\(responses per prompt\\) must be an integer >= 1"):
            gen.generate(dp, params, n=bad)
    plain = Generator(model, decode_chunk=4, compact_min_rows=None)  # no compaction means none with n > 1 too
    c = plain.generate(dp, params, n=3)
    assert plain.last_decode_stats["sizes"] == (12,), plain.last_decode_stats
    np.testing.assert_array_equal(a.batch["responses"], c.batch["responses"])


def test_default_cache_segments_are_long(monkeypatch):
    """Default segment length: an eighth of the cache (a multiple of 16), never under 128 slots, so short
    caches (the default GRPO run: 112 slots) have one segment (each segment adds compile time and a slot
    write per step and layer). The prefill is intercepted: nothing compiles."""

    class Seen(Exception):
        pass

    def spy(*a, max_len, segment_len, **kw):
        raise Seen(max_len, segment_len)

    monkeypatch.setattr(gen_mod, "_prefill", spy)
    ids, mask = _left_padded_prompts([10, 4], 10, 64, seed=0)
    dp = DataProto.from_dict({"input_ids": ids, "attention_mask": mask})
    model = _tiny(seed=0, vocab_size=64)
    for new, seg, want in [
        (96, None, (112, 112)),
        (1008, None, (1024, 128)),
        (2032, None, (2048, 256)),
        (96, 8, (112, 8)),
    ]:
        with pytest.raises(Seen) as e:
            Generator(model, cache_segment_len=seg).generate(dp, SamplingParams(max_new_tokens=new, temperature=1.0))
        assert e.value.args == want, (new, seg, e.value.args)


@pytest.mark.slow
def test_compile_once_across_prompt_lengths_and_batch_sizes():
    # a model structure no other test uses, so the jit cache starts empty for it
    model = _tiny(seed=1, vocab_size=200, intermediate_size=96)
    gen = Generator(model, decode_chunk=4)
    params = SamplingParams(max_new_tokens=8, temperature=1.0, top_p=0.9, eos_token_ids=(3,))
    before = dict(TRACE_COUNTS)
    for i, (b, p) in enumerate([(3, 5), (4, 9), (3, 16), (4, 13), (3, 1)]):
        ids, mask = _left_padded_prompts([max(1, p - j) for j in range(b)], p, 200, seed=i)
        out = gen(DataProto.from_dict({"input_ids": ids, "attention_mask": mask}), params, seed=i)
        assert out.batch["responses"].shape == (b, 8)
    assert TRACE_COUNTS["prefill"] - before["prefill"] == 1
    assert TRACE_COUNTS["decode"] - before["decode"] == 1
    # a new Generator / the functional entry point reuses the same compiled functions
    generate_sequences(model, DataProto.from_dict({"input_ids": ids, "attention_mask": mask}), params, seed=9)
    assert TRACE_COUNTS["prefill"] - before["prefill"] == 1
    # crossing a prompt bucket (16 -> 32) compiles a new prefill and decode (cache length changes)
    ids, mask = _left_padded_prompts([17, 4], 17, 200)
    gen(DataProto.from_dict({"input_ids": ids, "attention_mask": mask}), params)
    assert TRACE_COUNTS["prefill"] - before["prefill"] == 2


# ------------------------------------------------------------------------ sharded == unsharded

_SHARDED_SCRIPT = textwrap.dedent("""
    import os, sys
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8 " + sys.argv[2]
    os.environ["JAX_PLATFORMS"] = "cpu"
    sys.path.insert(0, sys.argv[1])
    import jax, numpy as np
    from flax import nnx
    from jaxrl_post.models import ModelConfig, init_model
    from jaxrl_post.batch.protocol import DataProto
    from jaxrl_post.rollout import Generator, SamplingParams
    from jaxrl_post.runtime.sharding import make_mesh, shard_params
    assert jax.device_count() == 8
    cfg = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=16, eos_token_id=None, pad_token_id=0)
    model = init_model(cfg, seed=0)
    state = nnx.state(model, nnx.Param)
    nnx.update(model, jax.tree.map(lambda x: x * 6.0 if x.ndim >= 2 else x, state))
    graphdef, state = nnx.split(model)
    mesh = make_mesh(data=2, fsdp=2, tensor=2)
    sharded = nnx.merge(graphdef, shard_params(state, mesh))
    rng = np.random.default_rng(0)
    lengths = [7, 3, 10, 5, 8, 1]
    ids = np.zeros((6, 10), np.int32); mask = np.zeros((6, 10), np.int32)
    for i, n in enumerate(lengths):
        ids[i, 10 - n:] = rng.integers(3, 256, size=n); mask[i, 10 - n:] = 1
    dp = DataProto.from_dict({"input_ids": ids, "attention_mask": mask})
    for params in (SamplingParams(max_new_tokens=20, do_sample=False, eos_token_ids=(4,)),
                   SamplingParams(max_new_tokens=20, temperature=0.8, top_k=40, top_p=0.95, seed=3,
                                  eos_token_ids=(4, 9))):
        a = Generator(model, cache_segment_len=8).generate(dp, params).batch  # 4 segments
        b = Generator(sharded, mesh=mesh, cache_segment_len=8).generate(dp, params).batch
        for k in ("responses", "response_attention_mask", "input_ids", "attention_mask", "position_ids", "truncated"):
            np.testing.assert_array_equal(a[k], b[k], err_msg=k)
        np.testing.assert_allclose(a["rollout_log_probs"], b["rollout_log_probs"], atol=1e-5)
    # compaction shard by shard (4 batch shards of 4 rows -> 2 -> 1) == the unsharded uncompacted decode
    ids = np.tile(ids, (3, 1))[:16]; mask = np.tile(mask, (3, 1))[:16]
    dp = DataProto.from_dict({"input_ids": ids, "attention_mask": mask})
    params = SamplingParams(max_new_tokens=24, temperature=1.0, seed=5, eos_token_ids=tuple(range(4, 40)))
    a = Generator(model, compact_min_rows=None).generate(dp, params).batch
    gen = Generator(sharded, mesh=mesh, compact_min_rows=4, decode_chunk=2)
    b = gen.generate(dp, params).batch
    assert gen.last_decode_stats["sizes"] == (16, 8, 4), gen.last_decode_stats
    assert gen.last_decode_stats["stage_end_step"][0] < 24, (gen.last_decode_stats, a["response_attention_mask"].sum(1))
    for k in ("responses", "response_attention_mask", "truncated"):
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    np.testing.assert_allclose(a["rollout_log_probs"], b["rollout_log_probs"], atol=1e-5)
    # n samples per prompt from one prefill (6 prompts -> 8 padded, cache rows copied to 16) == repeated batch
    dp = DataProto.from_dict({"input_ids": ids[:6], "attention_mask": mask[:6]})
    a = Generator(model).generate(dp.repeat(2, interleave=True), params).batch
    b = Generator(sharded, mesh=mesh, compact_min_rows=4).generate(dp, params, n=2).batch
    for k in ("responses", "response_attention_mask", "input_ids", "truncated"):
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    np.testing.assert_allclose(a["rollout_log_probs"], b["rollout_log_probs"], atol=1e-5)
    print("SHARDED_OK")
""")


@pytest.mark.slow
def test_sharded_equals_unsharded_on_8_fake_devices(tmp_path):
    script = tmp_path / "sharded.py"
    script.write_text(_SHARDED_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    proc = subprocess.run(
        [sys.executable, str(script), str(REPO), CHEAP_COMPILE_FLAGS],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0 and "SHARDED_OK" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-6000:]


# SmolLM2 greedy parity with transformers: tests/models/test_gguf_tokenizer.py (it shares the file's loaded models).
