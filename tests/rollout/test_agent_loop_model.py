"""Agent loop on a real (tiny, random) model: the rollout log-probs of the model's tokens equal the training
forward's in float32 with the observation tokens in context (zero train/rollout mismatch), and a tiny GRPO run
with multi-turn rollouts and a calculator trains 2 steps."""

import os
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_post.batch.protocol import DataProto
from jaxrl_post.models.char_tokenizer import build_char_tokenizer
from jaxrl_post.rollout import Generator, SamplingParams
from jaxrl_post.rollout.agent_loop import AgentLoop, MultiTurnLimits
from jaxrl_post.rollout.environments import Environment, StepResult

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOK = build_char_tokenizer()
EOT = TOK.convert_tokens_to_ids("<|im_end|>")


class GoOn(Environment):
    """Answers every turn with 'go on' (a user message): every turn the model ends is followed by observation
    tokens."""

    def reset(self, row):
        return [{"role": "user", "content": row["q"]}]

    def step(self, action):
        return StepResult([{"role": "user", "content": "go on"}])


def _model():
    from jaxrl_post.models import ModelConfig, init_model

    cfg = ModelConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_layers=1,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        tie_word_embeddings=False,
    )
    model = init_model(cfg, seed=3)
    w = np.array(model.lm_head[...])
    w[:, EOT] = 0.0
    w[0, EOT] = 8.0  # EOS logit = 8 * (normed hidden)[0]: turns of a few tokens end often
    model.lm_head[...] = jnp.asarray(w)
    return model


@pytest.mark.slow
def test_rollout_log_probs_equal_training_forward_with_observations_in_context():
    from jaxrl_post.engine import steps, update_core

    model = _model()
    b, p, r = 6, 32, 48
    prompts = DataProto({"input_ids": np.zeros((b, p), np.int32)}, {"q": [f"q{i}" for i in range(b)]})
    params = SamplingParams(max_new_tokens=r, temperature=1.0, eos_token_ids=(EOT,), pad_token_id=EOT)
    loop = AgentLoop(Generator(model), TOK, lambda row: GoOn(), MultiTurnLimits(max_assistant_turns=4))
    out = loop.generate(prompts, params, seed=1).batch
    loss, exists = out["loss_mask"].astype(bool), out["response_attention_mask"].astype(bool)
    holes = exists & ~loss
    assert holes.sum() >= 3 * 14  # observation tokens ("\n<|im_start|>user\ngo on<|im_end|>\n<|im_start|>assistant\n")
    # model tokens after an observation: their log-probs were computed with the observation in context
    after = loss & (np.cumsum(holes, axis=1) > 0)
    assert after.sum() >= 10, after.sum()
    graphdef, weights, rest = steps.split_model(model)
    fn = update_core.make_log_prob_fn(
        steps.padded_layout(micro_batch_size=b), graphdef, rest, temperature=1.0, with_entropy=False
    )
    keys = ("input_ids", "attention_mask", "position_ids", "responses")
    lp = np.asarray(fn(weights, {k: jnp.asarray(out[k]) for k in keys})[0])
    diff = np.abs(lp - out["rollout_log_probs"])[loss]
    assert diff.max() < 1e-5, diff.max()
    assert (out["rollout_log_probs"][~loss] == 0).all()
    # a wrong context (observation tokens dropped from the attention) changes the log-probs after them
    bad = dict(out)
    bad["attention_mask"] = out["attention_mask"].copy()
    bad["attention_mask"][:, p:][holes] = 0
    lp_bad = np.asarray(fn(weights, {k: jnp.asarray(bad[k]) for k in keys})[0])
    assert np.abs(lp_bad - out["rollout_log_probs"])[after].max() > 1e-3


def _tiny_multi_turn(tmp_path, env):
    if REPO not in sys.path:
        sys.path.insert(0, REPO)
    from configs import grpo

    c = grpo.get_config("tiny")
    c.trainer.default_local_dir = str(tmp_path / env)
    c.trainer.save_freq = -1
    c.trainer.val_before_train = False  # validation with the agent loop runs once, at the end
    c.rollout.multi_turn.enable = True
    c.rollout.multi_turn.env = env
    c.rollout.multi_turn.tool_num_workers = 1
    return c


def _check_history(hist):
    assert len(hist) == 2
    for m in hist:
        for k in ("num_turns/mean", "num_turns/min", "num_turns/max", "tool_calls/mean", "tool/errors"):
            assert k in m, k
        assert m["num_turns/min"] >= 1 and np.isfinite(m["actor/pg_loss"]) and np.isfinite(m["actor/grad_norm"])
        assert 0.0 <= m["response/observation_fraction"] < 1.0


@pytest.mark.slow  # ~100 s on a busy 2-core machine (two training steps + validation through the agent loop)
def test_tiny_grpo_with_calculator_trains_two_steps(tmp_path):
    from jaxrl_post.rl.trainer import RLTrainer

    c = _tiny_multi_turn(tmp_path, "tools")
    # characters: the reasoning-gym prompt + the injected tool prompt render to 798-800 (every training and held-out
    # row); the prompts are left-padded to this width, so a tight one keeps every program small (1024: ~25% longer)
    c.data.max_prompt_length = 832
    c.data.max_response_length = 24
    trainer = RLTrainer(c)
    try:
        assert trainer.rollout.agent_loop is not None and trainer.rollout.agent_loop.inject_tools
        result = trainer.fit()
    finally:
        trainer.close()
    _check_history(result["history"])  # a random model writes no tool call: every trajectory is one turn
    va = result["val_after"]
    assert "val-core/reasoning_gym/basic_arithmetic/reward/mean@1" in va
    assert va["val-aux/reasoning_gym/basic_arithmetic/tool_call_rate/mean@1"] == 0.0  # no call, as in training
    assert va["val-aux/reasoning_gym/basic_arithmetic/num_turns/mean@1"] == 1.0


@pytest.mark.slow  # ~100 s on a busy 2-core machine
def test_tiny_grpo_multi_turn_game_trains_on_turns_with_feedback(tmp_path):
    """The number-guessing game answers every ended turn, so the updates see loss_mask holes (feedback tokens)."""
    from jaxrl_post.rl.trainer import RLTrainer

    c = _tiny_multi_turn(tmp_path, "guess_number")
    # the game's first message renders to 143 tokens (every training and held-out row; tiny's default: 192)
    c.data.max_prompt_length = 160
    c.data.max_response_length = 64
    c.rollout.multi_turn.max_assistant_turns = 3
    c.custom_reward_function.path = os.path.join(REPO, "jaxrl_post", "rollout", "environments.py")
    c.custom_reward_function.name = "guess_number_score"
    trainer = RLTrainer(c)
    try:
        emb = trainer.state.actor.params["embedding"]
        w = np.array(emb[...])
        w[EOT] = 0.0
        w[EOT, 0] = 8.0  # as _model(): the model ends turns often, so there are second and third turns
        emb[...] = jnp.asarray(w)
        trainer.sync_weights()
        result = trainer.fit()
    finally:
        trainer.close()
    hist = result["history"]
    _check_history(hist)
    assert max(m["num_turns/max"] for m in hist) >= 3  # model, feedback, model at least
    assert max(m["response/observation_fraction"] for m in hist) > 0.05
