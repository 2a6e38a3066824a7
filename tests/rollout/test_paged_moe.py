"""MoE layers in the paged rollout engine and its routing replay output (issues 56 item 6, 58 item 4): the paged
forward's experts of a ragged prefill chunk equal the training forward's, and the chunk's padded token slots change
no real token's experts or hidden state; a tiny random Qwen3-MoE (one dense layer between two MoE layers) decodes
greedy the dense `Generator`'s tokens with log-probs within 1e-5 and `routed_experts` equal bit for bit (float32,
layers scanned, a pool so small that sequences are preempted and recomputed); a batch stopped at a dispatch and
resumed after a JSON round trip of its state keeps the experts recorded before the stop."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_post.batch.protocol import DataProto
from jaxrl_post.rl.async_training.partial import PartialGeneration
from jaxrl_post.rollout import Generator, SamplingParams
from jaxrl_post.rollout.paged import forward
from jaxrl_post.rollout.paged.allocator import PageAllocator
from jaxrl_post.rollout.paged.engine import PagedGenerator
from jaxrl_post.rollout.paged.kv_pool import init_pool, token_slots
from tests.models.test_moe import _random_model, _tiny_cfg

GREEDY = SamplingParams(max_new_tokens=12, do_sample=False, eos_token_ids=(7, 8, 9), seed=2)


def _prefill_chunk(model, prompts, budget, filler):
    """The paged forward (layers unrolled) of one prefill chunk holding `prompts` back to back in a `budget`-token
    chunk whose padded slots hold `filler` tokens. Returns (hidden `[T_real, D]`, routes `[T_real, M, k]`)."""
    c, ps = model.config, 4
    alloc = PageAllocator(num_pages=32, page_size=ps)
    for i, x in enumerate(prompts):
        alloc.allocate(i, len(x))
    s = len(prompts)
    tables = np.asarray(alloc.page_table(list(range(s)), 8))
    lens = np.array([len(x) for x in prompts], np.int32)
    real = int(lens.sum())
    tok = np.concatenate([*prompts, filler[: budget - real]]).astype(np.int32)
    pos = np.concatenate([np.arange(n) for n in lens] + [np.zeros(budget - real, int)]).astype(np.int32)
    seq = np.concatenate([np.repeat(np.arange(s), lens), np.zeros(budget - real, int)])
    mask = np.arange(budget) < real
    slots = np.where(mask, np.asarray(token_slots(jnp.asarray(pos), jnp.asarray(tables[seq]), ps)), 0)
    rag = forward.Ragged(
        tokens=jnp.asarray(tok[None]),
        positions=jnp.asarray(pos[None]),
        slots=jnp.asarray(slots, jnp.int32),
        kv_lens=jnp.asarray(lens),
        page_indices=jnp.asarray(tables),
        cu_q_lens=jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32),
        num_seqs=jnp.array([s], jnp.int32),
        token_mask=jnp.asarray(mask[None]),
    )
    kv = init_pool(c.num_layers, 32, ps, c.num_kv_heads, c.head_dim, jnp.float32).kv
    fn = jax.jit(forward.hidden_states, static_argnums=(1, 5, 6))
    h, _, routes = fn(model, None, None, kv, rag, "xla", True)
    return np.asarray(h)[0, :real], np.asarray(routes)[0, :real]


def test_paged_prefill_routes_equal_the_training_forward_and_ignore_padded_slots():
    """Three prompts in a 32-token chunk: each real token's experts are those the decoder's training forward
    (`Transformer(..., with_moe=True)`, no cache) picks for it, in `[T, M, k]` uint8 with M = the 2 MoE layers
    (layer 1 is dense); other tokens in the 8 padded slots give bitwise the same hidden states and experts."""
    model = _random_model(_tiny_cfg(num_layers=3, mlp_only_layers=(1,)), seed=3)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 61, n).astype(np.int32) for n in (7, 12, 5)]
    h, routes = _prefill_chunk(model, prompts, 32, np.zeros(32, np.int32))
    h2, routes2 = _prefill_chunk(model, prompts, 32, rng.integers(3, 61, 32))
    assert routes.shape == (24, 2, 2) and routes.dtype == np.uint8
    np.testing.assert_array_equal(routes2, routes)
    np.testing.assert_array_equal(h2, h)
    ids, mask = np.zeros((3, 12), np.int32), np.zeros((3, 12), np.int32)
    for i, x in enumerate(prompts):
        ids[i, 12 - len(x) :], mask[i, 12 - len(x) :] = x, 1
    _, moe = jax.jit(lambda i, m: model(i, m, with_moe=True))(ids, mask)  # left-padded [3, 12], no cache
    np.testing.assert_array_equal(routes, np.asarray(moe.routed_experts)[mask.astype(bool)])


@pytest.mark.slow  # a dense Generator and a paged engine compiled: ~45 s on 2 loaded cores
def test_paged_moe_greedy_equals_the_dense_generator_with_routes():
    """5 prompts (2-12 tokens) x n 2 through 4 slots, a 16-token prefill budget and 12 pages (sequences preempted and
    recomputed), layers scanned (period 2: MoE, dense; the last MoE layer unrolled): the dense `Generator`'s tokens
    and masks, log-probs within 1e-5, `routed_experts [10, 24, 2, 2]` uint8 equal bit for bit (0 at padding and
    after EOS). Stopped after 3 dispatches and resumed from a JSON round trip of the partial state (with the recorded
    experts of the unfinished sequences changed in between): the resumed rows carry the changed experts for the
    tokens fed before the stop, the dense routes after, and the same tokens."""
    model = _random_model(_tiny_cfg(num_layers=3, mlp_only_layers=(1,)), seed=3)
    rng = np.random.default_rng(0)
    ids, mask = np.zeros((5, 12), np.int32), np.zeros((5, 12), np.int32)
    for i, n in enumerate([5, 9, 2, 12, 7]):
        ids[i, 12 - n :], mask[i, 12 - n :] = rng.integers(3, 61, n), 1
    dp = DataProto.from_dict({"input_ids": ids, "attention_mask": mask})
    dense = Generator(model, decode_chunk=4, compact_min_rows=None, return_routed_experts=True).generate(
        dp, GREEDY, n=2
    )
    ends = dense.batch["response_attention_mask"].sum(1)
    assert len(set(ends)) >= 3 and (ends < 12).any()  # rows end at different steps, some at an EOS
    eng = PagedGenerator(
        model,
        max_num_seqs=4,
        max_num_batched_tokens=16,
        page_size=4,
        steps_per_dispatch=4,
        num_pages=13,
        scan_layers=True,
        return_routed_experts=True,
    )
    out = eng.generate(dp, GREEDY, n=2)
    assert eng.last_stats["preemptions"] > 0
    for k in ("responses", "attention_mask", "truncated"):
        np.testing.assert_array_equal(out.batch[k], dense.batch[k], err_msg=k)
    np.testing.assert_allclose(out.batch["rollout_log_probs"], dense.batch["rollout_log_probs"], atol=1e-5, rtol=0)
    want = dense.batch["routed_experts"]
    assert out.batch["routed_experts"].shape == want.shape == (10, 24, 2, 2) and want.dtype == np.uint8
    assert out.batch["routed_experts"].dtype == want.dtype
    np.testing.assert_array_equal(out.batch["routed_experts"], want)

    part = PartialGeneration(dp, seed=GREEDY.seed, n=2)
    part.run(eng, GREEDY, version=0, max_dispatches=3)
    fed = {s.row: sum(len(r) for r in s.routes) for s in part.unfinished}
    assert any(fed.values()) and all(fed[s.row] in (0, len(s.prompt) + len(s.tokens)) for s in part.unfinished)
    for s in part.unfinished:  # other experts for what was fed before the stop
        s.routes = [((r.astype(np.int32) + 1) % 4).astype(r.dtype) for r in s.routes]
    state = json.loads(json.dumps(part.state_dict()))
    resumed = PartialGeneration.from_state_dict(state)
    resumed.run(eng, GREEDY, version=1)
    got = resumed.out.batch["routed_experts"]
    np.testing.assert_array_equal(resumed.out.batch["responses"], dense.batch["responses"])
    for row, n in fed.items():
        p0 = 12 - int(mask[row // 2].sum())
        np.testing.assert_array_equal(got[row, p0 : p0 + n], (want[row, p0 : p0 + n].astype(np.int32) + 1) % 4)
        np.testing.assert_array_equal(got[row, p0 + n :], want[row, p0 + n :])
    done = [r for r in range(10) if r not in fed]
    np.testing.assert_array_equal(got[done], want[done])
