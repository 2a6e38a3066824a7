"""The paged engine (issue 56) against today's dense `Generator` on CPU float32 with the same per-row keys: same
tokens, masks and truncation, log-probs and sampling thresholds to float rounding (1e-5: prefill and decode batch
differently), with n = 3 samples per prompt, more sequences than slots, EOS at different steps (at the first one
too), prompts longer than the prefill budget (chunked prefill), and a pool so small that sequences are preempted
and recomputed (layers scanned there, unrolled elsewhere); a call stopped at a dispatch boundary and resumed gives
the same result, and with the weights swapped at the boundary the rows that had not started are the new model's;
programs compile once."""

import copy

import numpy as np
import pytest

from jaxrl_post.batch.protocol import DataProto
from jaxrl_post.models import ModelConfig, init_model
from jaxrl_post.rollout import Generator, SamplingParams
from jaxrl_post.rollout.paged import programs
from jaxrl_post.rollout.paged.engine import PagedGenerator

TINY = dict(
    vocab_size=96,
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
SAMPLED = SamplingParams(max_new_tokens=20, temperature=1.0, top_p=0.9, eos_token_ids=(4, 5, 6), seed=2)
EXACT = ("prompts", "responses", "input_ids", "attention_mask", "position_ids", "response_attention_mask", "truncated")
ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=16, page_size=4, steps_per_dispatch=4)


def left_padded_prompts(seed: int) -> DataProto:
    """5 random prompts of 5, 9, 2, 12 and 7 tokens (ids 7..95), left-padded to 12, uids 'a'..'e'."""
    rng = np.random.default_rng(seed)
    ids, mask = np.zeros((5, 12), np.int32), np.zeros((5, 12), np.int32)
    for i, n in enumerate([5, 9, 2, 12, 7]):
        ids[i, 12 - n :], mask[i, 12 - n :] = rng.integers(7, 96, n), 1
    return DataProto.from_dict({"input_ids": ids, "attention_mask": mask}, {"uid": np.array(list("abcde"))})


@pytest.fixture(scope="module")
def setup():
    model = init_model(ModelConfig(**TINY), seed=3)
    dp = left_padded_prompts(0)
    dense = Generator(model, decode_chunk=4).generate(dp, SAMPLED, n=3)
    return model, dp, dense


def _assert_same(a, b):
    for k in EXACT:
        np.testing.assert_array_equal(a.batch[k], b.batch[k], err_msg=k)
    np.testing.assert_allclose(a.batch["rollout_log_probs"], b.batch["rollout_log_probs"], atol=1e-5, rtol=0)
    np.testing.assert_allclose(
        a.batch["sampling_logit_threshold"], b.batch["sampling_logit_threshold"], atol=1e-5, rtol=0
    )
    assert list(a.non_tensor_batch["uid"]) == list(b.non_tensor_batch["uid"])


@pytest.mark.slow  # two engines' compiles, ~40 s on 2 loaded cores
def test_paged_engine_equals_the_dense_generator(setup):
    model, dp, dense = setup
    ends = dense.batch["response_attention_mask"].sum(1)
    assert len(set(ends)) >= 5 and dense.batch["truncated"].any() and not dense.batch["truncated"].all()
    eng = PagedGenerator(model, **ENGINE)
    _assert_same(eng.generate(dp, SAMPLED, n=3), dense)
    st = eng.last_stats
    assert st["prefill_dispatches"] >= 5 and st["preemptions"] == 0  # 15 sequences through 4 slots
    assert st["emitted"] == dense.batch["response_attention_mask"].sum()
    traces = dict(programs.TRACE_COUNTS)
    _assert_same(eng.generate(dp[:3], SAMPLED, n=2), Generator(model, decode_chunk=4).generate(dp[:3], SAMPLED, n=2))
    assert traces == programs.TRACE_COUNTS, "another batch of the same prompt bucket compiled again"
    small = PagedGenerator(model, **ENGINE, num_pages=13, scan_layers=True)  # 12 pages: 1.5 longest sequences
    _assert_same(small.generate(dp, SAMPLED, n=3), dense)
    assert small.last_stats["preemptions"] > 0
    # greedy, the EOS set to a token some rows draw first: EOS at step 0
    greedy = SamplingParams(max_new_tokens=20, do_sample=False, eos_token_ids=(4, 5, 6), seed=2)
    first = Generator(model, decode_chunk=4).generate(dp, greedy)
    eos = SamplingParams(max_new_tokens=20, do_sample=False, eos_token_ids=(int(first.batch["responses"][2, 0]),))
    want = Generator(model, decode_chunk=4).generate(dp, eos)
    assert want.batch["response_attention_mask"][2].sum() == 1
    _assert_same(eng.generate(dp, eos), want)


@pytest.mark.slow  # shares the compiles above when run after it; ~15 s alone
def test_stopped_and_resumed_equals_uninterrupted(setup):
    model, dp, dense = setup
    eng = PagedGenerator(model, **ENGINE)
    part = eng.generate(dp, SAMPLED, n=3, should_stop=lambda d: d >= 8)
    left = eng.unfinished
    have = {s.row: len(s.tokens) for s in left}
    assert left and part.batch["response_attention_mask"].sum() < dense.batch["response_attention_mask"].sum()
    for row, k in have.items():  # what was handed back is what the stopped call returned
        np.testing.assert_array_equal(part.batch["responses"][row, :k], dense.batch["responses"][row, :k])
        assert part.batch["response_attention_mask"][row].sum() == k and part.batch["truncated"][row]
    done = [r for r in range(15) if r not in have]  # finished rows are final
    for key in EXACT:
        np.testing.assert_array_equal(part.batch[key][done], dense.batch[key][done], err_msg=key)
    snapshot = copy.deepcopy(left)
    rest = eng.generate(dp, SAMPLED, n=3, resume=left)
    for row in have:
        np.testing.assert_array_equal(rest.batch["responses"][row], dense.batch["responses"][row])
        np.testing.assert_allclose(
            rest.batch["rollout_log_probs"][row], dense.batch["rollout_log_probs"][row], atol=1e-5, rtol=0
        )
    assert not eng.unfinished
    # weight swap at the boundary: the handed-back rows go on under model B; rows that had not started yet are
    # then wholly B's (same keys), rows with a prefix keep A's prefix
    model_b = init_model(ModelConfig(**TINY), seed=4)
    dense_b = Generator(model_b, decode_chunk=4).generate(dp, SAMPLED, n=3)
    eng.update_weights(model_b)
    fresh = [s.row for s in snapshot if not s.tokens]
    started = {s.row: list(s.tokens) for s in snapshot if s.tokens}
    assert fresh and started
    swapped = eng.generate(dp, SAMPLED, n=3, resume=snapshot)
    for key in EXACT[1:]:
        np.testing.assert_array_equal(swapped.batch[key][fresh], dense_b.batch[key][fresh], err_msg=key)
    for row, tokens in started.items():
        np.testing.assert_array_equal(swapped.batch["responses"][row, : len(tokens)], tokens)
    assert not np.array_equal(swapped.batch["responses"][fresh], dense.batch["responses"][fresh])
