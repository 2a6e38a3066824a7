"""The multi-turn agent loop on the paged engine (`rollout/paged/session.py`, issue 56): prefix caching in the
engine's page pools. On the tiny random model in float32, with a fixed seed, `AgentLoop` on a `PagedGenerator`
gives the dense agent loop's trajectories (with its `TurnCache` and with the full re-prefill): token ids, masks,
turn counts, log-probs within 1e-5, greedy and sampled, rows ending at different turns; after the first turn it
prefills only the appended tokens, and distinct prompts share the full pages of their common head
(`prefix_cache.py`; both counted by hand from the output); a pool too small for the trajectories
(evictions of kept pages and preemptions, whole contexts prefilled again) changes nothing, and no page leaks;
turns reuse the engine's programs (one prefill and one decode program for the call, none for a second call); a
tiny multi-turn GRPO run with rollout.name='paged' has the dense run's metrics."""

import os

import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_post.batch.protocol import DataProto
from jaxrl_post.rollout import Generator, SamplingParams
from jaxrl_post.rollout.agent_loop import AgentLoop, MultiTurnLimits
from jaxrl_post.rollout.paged import programs
from jaxrl_post.rollout.paged.engine import PagedGenerator
from jaxrl_post.rollout.paged.session import PagedSession
from tests.rollout.test_agent_loop_kv import CalculatorEnv, FewGuesses, _assert_same
from tests.rollout.test_agent_loop_model import EOT, REPO, TOK, _model

ENGINE = dict(max_num_seqs=8, max_num_batched_tokens=64, page_size=8, steps_per_dispatch=8)
CASES = {"calculator-greedy": (CalculatorEnv, 0.0, 64), "game-sampled": (FewGuesses, 1.0, 160)}
P = 160


def _roll(gen, case, prefix=True, b=6, seed=1, turns=4):
    env, temperature, r = CASES[case]
    nt = {"expr": [f"{i + 2}*{7 * i + 3}" for i in range(b)], "k": list(range(b))}
    nt["extra_info"] = [{"secret": 10 + i} for i in range(b)]
    prompts = DataProto({"input_ids": np.zeros((b, P), np.int32)}, nt)
    params = SamplingParams(max_new_tokens=r, temperature=temperature, eos_token_ids=(EOT,), pad_token_id=EOT)
    loop = AgentLoop(
        gen, TOK, lambda row: env(), MultiTurnLimits(max_assistant_turns=turns), enable_prefix_caching=prefix
    )
    return loop.generate(prompts, params, seed=seed), loop.last_stats


@pytest.fixture(scope="module")
def model():
    return _model()


@pytest.fixture(scope="module")
def dense(model):
    """The dense agent loop's rollouts (TurnCache), computed once per case."""
    cache = {}

    def get(case):
        if case not in cache:
            cache[case] = _roll(Generator(model), case)
        return cache[case]

    return get


@pytest.fixture
def leak_check(monkeypatch):
    """Every `PagedSession.close` leaves each replica's allocator consistent and empty."""
    real, closed = PagedSession.close, []

    def close(self):
        out = real(self)
        for sc in self.scheds:
            sc.alloc.check()
            assert sc.alloc.num_used == 0 and not sc.kept, (sc.alloc.num_used, sc.kept)
        closed.append(out)
        return out

    monkeypatch.setattr(PagedSession, "close", close)
    return closed


def shared_by_hand(prompts, page_size: int = 8) -> int:
    """Prompt tokens that pages shared by content spare, `prompts` (token tuples) in admission order on one
    replica: each prompt's full pages inside its longest common prefix with an earlier one, its last token excluded
    (always prefilled, for the next-token logits)."""
    lcp = lambda a, b: next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return sum(
        min(max(lcp(p, q) for q in prompts[:i]), len(p) - 1) // page_size * page_size
        for i, p in enumerate(prompts)
        if i
    )


def _by_hand(out):
    """Tokens a prefix cache must prefill: each distinct prompt once, then only the observation tokens (the
    response tokens that exist and are not the model's) that a model turn follows (an observation that used up the
    budget ends its trajectory unprefilled); and the tokens of those prompts that pages shared by content spare
    (`shared_by_hand`)."""
    ids, am = out.batch["input_ids"][:, :P], out.batch["attention_mask"][:, :P].astype(bool)
    distinct = list(dict.fromkeys(tuple(i[m].tolist()) for i, m in zip(ids, am)))
    hits = shared_by_hand(distinct)
    loss = out.batch["loss_mask"].astype(bool)
    holes = out.batch["response_attention_mask"].astype(bool) & ~loss
    before_last = np.arange(loss.shape[1])[None] < (loss.shape[1] - np.argmax(loss[:, ::-1], axis=1))[:, None]
    return sum(map(len, distinct)) + int((holes & before_last).sum()), len(distinct), hits


@pytest.mark.slow  # three multi-turn rollouts (dense cached, dense re-prefill, paged), ~30-60 s on 2 loaded cores
@pytest.mark.parametrize("case", list(CASES))
def test_paged_agent_loop_equals_the_dense_one(model, dense, leak_check, case):
    ref, s_ref = dense(case)
    full, _ = _roll(Generator(model), case, prefix=False)
    _assert_same(ref, full)
    out, stats = _roll(PagedGenerator(model, **ENGINE), case)
    _assert_same(out, ref)
    turns = out.non_tensor_batch["num_turns"]
    assert len(set(turns.tolist())) > 1 and turns.max() >= 5, turns  # rows end at different turns; 3 model turns
    want, distinct, hits = _by_hand(out)
    assert distinct == (1 if case == "game-sampled" else 6)  # the game's rows share one prompt: one prefill
    assert want == s_ref["prefill_tokens"], (want, s_ref)
    # the calculator's prompts share the chat template's head: its full pages are prefilled once
    assert stats["paged/prefix_cache_hits"] == hits and (hits > 0) == (case != "game-sampled"), (stats, hits)
    assert stats["prefill_tokens"] == want - hits, (stats, want, hits)
    assert stats["paged/preemptions"] == stats["paged/evictions"] == 0
    assert stats["paged/emitted"] == out.batch["loss_mask"].sum()  # every model token decoded once
    assert stats["generate_calls"] == stats["turns_run"] == s_ref["turns_run"] and len(leak_check) == 1


@pytest.mark.slow  # one paged multi-turn rollout with recomputes (+ the dense one when run alone)
def test_a_small_pool_evicts_and_preempts_with_the_same_trajectories(model, dense, leak_check):
    ref, _ = dense("game-sampled")
    # a trajectory of up to 143 + 160 tokens needs 38 pages of 8, the pool has 38; the 6 samples share the prompt's
    # 17 full pages, and 32 decode steps per dispatch reserve 4 pages per running sequence: kept pages are evicted
    # and running sequences preempted
    eng = PagedGenerator(model, **dict(ENGINE, steps_per_dispatch=32), num_pages=39)
    out, stats = _roll(eng, "game-sampled")
    _assert_same(out, ref)
    assert stats["paged/evictions"] > 0 and stats["paged/preemptions"] > 0, stats
    want, _, _ = _by_hand(out)
    assert stats["prefill_tokens"] > want  # evicted and preempted contexts were prefilled again
    assert len(leak_check) == 1


@pytest.mark.slow  # two paged multi-turn rollouts (~20 s)
def test_turns_reuse_the_engine_programs(model):
    # a prefill budget and a dispatch length no other test uses: this call's shapes are traced here first
    eng = PagedGenerator(model, max_num_seqs=8, max_num_batched_tokens=40, page_size=8, steps_per_dispatch=7)
    before = dict(programs.TRACE_COUNTS)
    out, stats = _roll(eng, "calculator-greedy", seed=3)
    assert stats["turns_run"] >= 3, stats
    assert {k: programs.TRACE_COUNTS[k] - before[k] for k in before} == {"prefill": 1, "decode": 1}
    again = dict(programs.TRACE_COUNTS)
    out2, _ = _roll(eng, "calculator-greedy", seed=3)
    assert again == programs.TRACE_COUNTS  # a second call: nothing traced
    np.testing.assert_array_equal(out.batch["responses"], out2.batch["responses"])


def _game_run(tmp_path, run: str, **rollout):
    from jaxrl_post.rl.trainer import RLTrainer
    from tests.rollout.test_agent_loop_model import _tiny_multi_turn

    c = _tiny_multi_turn(tmp_path, "guess_number")
    c.trainer.default_local_dir = str(tmp_path / run)
    c.data.max_response_length = 64
    c.rollout.multi_turn.max_assistant_turns = 3
    c.custom_reward_function.path = os.path.join(REPO, "jaxrl_post", "rollout", "environments.py")
    c.custom_reward_function.name = "guess_number_score"
    c.trainer.val_at_end = False
    for k, v in rollout.items():
        c.rollout[k] = v
    trainer = RLTrainer(c, console_write=lambda s: None)
    try:
        emb = trainer.state.actor.params["embedding"]
        w = np.array(emb[...])
        w[EOT] = 0.0
        w[EOT, 0] = 8.0  # as _model(): the model ends turns often, so there are second and third turns
        emb[...] = jnp.asarray(w)
        trainer.sync_weights()
        return trainer.fit()["history"], trainer
    finally:
        trainer.close()


@pytest.mark.slow  # two tiny multi-turn GRPO runs of 2 steps (~60-120 s on 2 loaded cores)
def test_tiny_multi_turn_grpo_on_the_paged_engine_equals_the_dense_run(tmp_path):
    dense_hist, _ = _game_run(tmp_path, "dense")
    engine = dict(max_num_seqs=16, max_num_batched_tokens=128, block_size=8, num_scheduler_steps=8)
    paged_hist, trainer = _game_run(tmp_path, "paged", name="paged", **engine)
    assert isinstance(trainer.rollout.generator, PagedGenerator)
    st = trainer.rollout.agent_loop.last_stats
    assert st["paged/decode_dispatches"] > 0  # the session generated
    # the session's pool counts are the step's metrics (one generation batch a step, no validation after)
    assert paged_hist[-1]["rollout/num_evictions"] == st["paged/evictions"]
    assert paged_hist[-1]["rollout/num_preemptions"] == st["paged/preemptions"]
    assert "rollout/num_evictions" not in dense_hist[-1]
    assert len(paged_hist) == len(dense_hist) == 2
    assert max(m["num_turns/max"] for m in dense_hist) >= 3  # model, feedback, model at least
    for d, p in zip(dense_hist, paged_hist):
        keys = [k for k in d if k.startswith(("actor/", "critic/", "response", "num_turns", "prompt_length"))]
        assert "actor/pg_loss" in keys and "num_turns/mean" in keys
        for k in keys:
            np.testing.assert_allclose(p[k], d[k], rtol=1e-5, atol=1e-7, err_msg=k)
