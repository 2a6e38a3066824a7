"""Prefix caching in the agent loop (`rollout/turn_cache.py`): each turn prefills only the appended tokens onto
the KV cache the previous turn left, with a per-row write slot (a prompt that several rows share is prefilled
once). On the tiny random model in float32 the
trajectories equal those of the full re-prefill (`enable_prefix_caching=False`) -- token ids, masks, turn
counts, log-probs within 1e-5 -- with a tool and with a multi-turn environment, rows finishing at different
turns; the log-probs equal the training forward's; turns reuse compiled programs."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl_post.batch.protocol import DataProto
from jaxrl_post.rollout import Generator, SamplingParams
from jaxrl_post.rollout import turn_cache as tc_mod
from jaxrl_post.rollout.agent_loop import AgentLoop, MultiTurnLimits
from jaxrl_post.rollout.decode import TRACE_COUNTS as DECODE_TRACES
from jaxrl_post.rollout.environments import Environment, GuessNumberEnv, StepResult
from jaxrl_post.rollout.tools import calculator
from tests.rollout.test_agent_loop_model import EOT, TOK, _model


class CalculatorEnv(Environment):
    """Runs the calculator on the row's expression after every model turn and answers with a `tool` message
    (whatever the random model wrote); row `k` ends after `k % 3 + 1` tool turns."""

    def reset(self, row):
        self.expr, self.left = row["expr"], int(row["k"]) % 3 + 1
        return [{"role": "user", "content": f"compute {self.expr}"}]

    def step(self, action):
        self.left -= 1
        msgs = [{"role": "tool", "content": calculator(self.expr)}]
        return StepResult(msgs, 1.0, self.left <= 0, {"tool_calls": 1, "tool_errors": 0})


class FewGuesses(GuessNumberEnv):
    """The guessing game (feedback after every turn: a format hint or too low / too high) that row `k` ends after
    `k % 3 + 1` turns."""

    def reset(self, row):
        self.left = int(row["k"]) % 3 + 1
        return super().reset(row)

    def step(self, action):
        self.left -= 1
        res = super().step(action)
        return dataclasses.replace(res, done=res.done or self.left <= 0)


def _rollout(env, prefix, temperature, b=6, p=160, r=64, seed=1, model=None, turns=4):
    model = model if model is not None else _model()
    nt = {"expr": [f"{i + 2}*{7 * i + 3}" for i in range(b)], "k": list(range(b))}
    nt["extra_info"] = [{"secret": 10 + i} for i in range(b)]
    prompts = DataProto({"input_ids": np.zeros((b, p), np.int32)}, nt)
    params = SamplingParams(max_new_tokens=r, temperature=temperature, eos_token_ids=(EOT,), pad_token_id=EOT)
    loop = AgentLoop(
        Generator(model),
        TOK,
        lambda row: env(),
        MultiTurnLimits(max_assistant_turns=turns),
        enable_prefix_caching=prefix,
    )
    return loop.generate(prompts, params, seed=seed), loop.last_stats, model


def _assert_same(a, c):
    for k in ("responses", "loss_mask", "response_attention_mask", "attention_mask", "position_ids", "truncated"):
        np.testing.assert_array_equal(a.batch[k], c.batch[k], err_msg=k)
    for k in ("num_turns", "tool_calls"):
        np.testing.assert_array_equal(a.non_tensor_batch[k], c.non_tensor_batch[k], err_msg=k)
    np.testing.assert_allclose(a.batch["rollout_log_probs"], c.batch["rollout_log_probs"], rtol=0, atol=1e-5)


def _training_log_probs(model, out):
    from jaxrl_post.engine import steps, update_core

    graphdef, weights, rest = steps.split_model(model)
    fn = update_core.make_log_prob_fn(
        steps.padded_layout(micro_batch_size=len(out)), graphdef, rest, temperature=1.0, with_entropy=False
    )
    keys = ("input_ids", "attention_mask", "position_ids", "responses")
    return np.asarray(fn(weights, {k: jnp.asarray(out.batch[k]) for k in keys})[0])


@pytest.mark.slow  # ~10-20 s each on a busy 2-core machine (two rollouts, compiles)
@pytest.mark.parametrize("env,temperature,r", [(CalculatorEnv, 0.0, 64), (FewGuesses, 1.0, 160)])
def test_prefix_caching_equals_full_reprefill(env, temperature, r):
    model = _model()
    full, s_full, _ = _rollout(env, False, temperature, model=model, r=r)
    cached, s_cached, _ = _rollout(env, True, temperature, model=model, r=r)
    _assert_same(full, cached)
    turns = full.non_tensor_batch["num_turns"]
    assert len(set(turns.tolist())) > 1, turns  # rows finished at different turns
    assert turns.max() >= 5, turns  # at least three model turns, so some turn appends onto a cache twice
    holes = full.batch["response_attention_mask"].astype(bool) & ~full.batch["loss_mask"].astype(bool)
    assert holes.sum() > 0
    # each distinct prompt once (the game's rows all start from the same prompt: one prefill copied to every
    # row), plus per turn only the observation tokens, against the whole context every turn
    ids, am = full.batch["input_ids"][:, :160], full.batch["attention_mask"][:, :160]
    distinct = {tuple(i[m.astype(bool)].tolist()) for i, m in zip(ids, am)}
    assert len(distinct) == (1 if env is FewGuesses else len(ids)), len(distinct)
    assert s_cached["prefill_tokens"] == sum(map(len, distinct)) + int(holes.sum())
    assert s_full["prefill_tokens"] > s_cached["prefill_tokens"], (s_full, s_cached)
    if True:  # the rollout log-probs (untempered at temperature 0) equal the training forward's
        loss = cached.batch["loss_mask"].astype(bool)
        lp = _training_log_probs(model, cached)
        assert np.abs(lp - cached.batch["rollout_log_probs"])[loss].max() < 1e-5
        assert (cached.batch["rollout_log_probs"][~loss] == 0).all()


@pytest.mark.slow
def test_turns_reuse_compiled_programs():
    model = _model()
    before = dict(tc_mod.TRACE_COUNTS), dict(DECODE_TRACES)
    out, stats, _ = _rollout(CalculatorEnv, True, 1.0, model=model, seed=3, r=40)  # a budget no other test uses
    extend = tc_mod.TRACE_COUNTS["extend"] - before[0]["extend"]
    decode = DECODE_TRACES["decode"] - before[1]["decode"]
    # batch buckets 8, 4, 2, 1 at most; append chunks of 16 or 32 tokens; the first turn's prompt chunk
    assert 1 <= extend <= min(stats["turns_run"], 1 + 4 * 2), (extend, stats)
    assert 1 <= decode <= min(stats["turns_run"], 4), (decode, stats)
    again = dict(tc_mod.TRACE_COUNTS), dict(DECODE_TRACES)
    out2, _, _ = _rollout(CalculatorEnv, True, 1.0, model=model, seed=3, r=40)
    assert again[0] == tc_mod.TRACE_COUNTS and again[1] == DECODE_TRACES  # same shapes: nothing recompiles
    np.testing.assert_array_equal(out.batch["responses"], out2.batch["responses"])


# slow: the unsegmented case (it was ~20-57 s on 2 cores run op by op, before the forward was jitted); the
# segmented case stays in the fast tier and covers the same per-row write code
@pytest.mark.parametrize("segment_len", [pytest.param(None, marks=pytest.mark.slow), 8])
def test_per_row_cache_index_equals_the_full_forward(segment_len):
    """Rows at different lengths append chunks at their own slots (right-padded chunks, one segment or several);
    each row's logits equal the forward of its whole sequence; a write past the last slot is dropped."""
    model = _model()
    # jitted (as the rollout runs it): one compile per shape instead of op-by-op dispatch of the whole-cache attention
    fwd = nnx.jit(lambda m, ids, mask, cache=None: m(ids, mask, cache=cache))
    rng = np.random.default_rng(0)
    seqs = [rng.integers(3, 100, n).tolist() for n in (9, 14, 5)]
    cuts = [(4, 7), (10, 12), (1, 5)]  # each row: chunk 1 = [0, c1), chunk 2 = [c1, c2), chunk 3 = [c2, end)
    cache = model.init_cache(3, 24, segment_len=segment_len)
    cache = cache.replace(index=jnp.zeros((3,), jnp.int32))
    index = np.zeros(3, np.int32)
    got = [[] for _ in seqs]
    for c in range(3):
        parts = [s[([0, *cut][c]) : ([*cut, len(s)][c])] for s, cut in zip(seqs, cuts)]
        width = max(len(x) for x in parts)
        ids, mask = np.zeros((3, width), np.int32), np.zeros((3, width), np.int32)
        for j, x in enumerate(parts):
            ids[j, : len(x)], mask[j, : len(x)] = x, 1
        logits, cache = fwd(model, jnp.asarray(ids), jnp.asarray(mask), cache=cache.replace(index=jnp.asarray(index)))
        for j, x in enumerate(parts):
            got[j].append(np.asarray(logits[j, : len(x)]))
        index = index + np.asarray([len(x) for x in parts], np.int32)
    for j, s in enumerate(seqs):
        ref = np.asarray(fwd(model, jnp.asarray([s]), jnp.ones((1, len(s)), jnp.int32))[0])
        np.testing.assert_allclose(np.concatenate(got[j]), ref, rtol=0, atol=2e-5)
    # row 1 (14 tokens) at slot 14 writes a 16-token chunk: slots 24.. are dropped, slots 0..13 stay as they were
    k_before = np.concatenate([np.asarray(x) for x in cache.k[0]], -1)
    _, after = fwd(
        model, jnp.ones((3, 16), jnp.int32), jnp.ones((3, 16), jnp.int32), cache=cache.replace(index=jnp.asarray(index))
    )
    k_after = np.concatenate([np.asarray(x) for x in after.k[0]], -1)
    np.testing.assert_array_equal(k_after[1, ..., :14], k_before[1, ..., :14])
    assert not np.array_equal(k_after[1, ..., 14:], k_before[1, ..., 14:])
    assert jax.tree.structure(after) == jax.tree.structure(cache)
