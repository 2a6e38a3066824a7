"""Generative judge: score parsing on hand cases, and a judge run end to end through our Generator with a tiny
model whose greedy output is known by construction (a bigram model: the residual blocks write nothing, so
the next token is a fixed function of the current one), so the verdicts are exact."""

import numpy as np
import pytest

from jaxrl_post.rewards import RewardManager
from jaxrl_post.rewards.judge import GenerativeJudge, parse_judge_score


@pytest.mark.parametrize(
    "text, expected",
    [
        ("Score: 7", 7.0),
        ("The answer is right. score = 9.5", 9.5),
        ("**Score:** 3", 3.0),
        ("Final score is 4", 4.0),
        ("First Score: 2, after review Score: 8", 8.0),  # the last one
        ("I give it 6/10.", 6.0),
        ("  10 ", 10.0),
        ("7.", 7.0),
        ("Score: 11", None),  # out of the 0-10 scale
        ("Score: -1", None),
        ("looks fine", None),
        ("", None),
        ("steps 1, 2 and 3", None),  # numbers, but no score
    ],
)
def test_parse_judge_score(text, expected):
    assert parse_judge_score(text) == expected


def test_parse_judge_score_other_scale():
    assert parse_judge_score("Score: 4", 1, 5) == 4.0 and parse_judge_score("Score: 0", 1, 5) is None


# Bigram chains (current char -> next char; '$' = EOS): a response ending in 'A' makes the judge write
# "Score: 7", one ending in 'B' makes it write "XY" (no score).
CHAIN = {"A": "S", "S": "c", "c": "o", "o": "r", "r": "e", "e": ":", ":": " ", " ": "7", "7": "$", "B": "X", "X": "Y"}
CHAIN["Y"] = "$"


TEMPLATE = "Q: {question} | GT: {ground_truth} | R: {response}"
QUESTIONS = ["What is 6*7?", "Name a colour", "x" * 40, "Say hi"]
RESPONSES = ["It is 42 A", "blue B", "long A", "hi A"]  # row 2's judge prompt: 64 chars > max_prompt_length=60


def _bigram_judge_model(tok):
    from flax import nnx

    from jaxrl_post.models import get_preset, init_model

    cfg = get_preset("smollm2_135m").replace(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_layers=1,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        tie_word_embeddings=False,
    )
    model = init_model(cfg, seed=0)
    for block in model.layers:  # blocks add nothing to the residual stream
        block.attn.o_proj.kernel[...] = 0.0
        block.mlp.down_proj.kernel[...] = 0.0
    emb = np.zeros((128, 64), np.float32)
    head = np.zeros((64, 128), np.float32)
    tid = tok.convert_tokens_to_ids
    for k, (cur, nxt) in enumerate(CHAIN.items()):
        emb[tid(cur), k] = 1.0
        head[k, tok.eos_token_id if nxt == "$" else tid(nxt)] = 1.0
    model.embedding[...] = emb
    model.lm_head[...] = head
    assert isinstance(model.lm_head, nnx.Param)
    return model


def _batch(tok, questions, responses):
    from jaxrl_post.batch.protocol import DataProto

    B = len(responses)
    P, R = max(map(len, questions)), max(map(len, responses))
    pr, pm = np.full((B, P), 2, np.int32), np.zeros((B, P), np.int32)
    rs, rm = np.full((B, R), 2, np.int32), np.zeros((B, R), np.int32)
    for i, (q, r) in enumerate(zip(questions, responses, strict=True)):
        q_ids, r_ids = tok(q, add_special_tokens=False)["input_ids"], tok(r, add_special_tokens=False)["input_ids"]
        pr[i, P - len(q_ids) :], pm[i, P - len(q_ids) :] = q_ids, 1
        rs[i, : len(r_ids)], rm[i, : len(r_ids)] = r_ids, 1
    return DataProto.from_dict(
        tensors={"prompts": pr, "responses": rs, "response_attention_mask": rm, "attention_mask": np.hstack([pm, rm])},
        non_tensors={
            "data_source": np.array(["qa"] * B, dtype=object),
            "ground_truth": np.array(["42"] * B, dtype=object),
        },
    )


def test_judge_end_to_end_with_our_generator():
    from jaxrl_post.models.char_tokenizer import build_char_tokenizer
    from jaxrl_post.rollout.generate import Generator

    tok = build_char_tokenizer()
    model = _bigram_judge_model(tok)
    generator = Generator(model)
    judge = GenerativeJudge(
        model,
        tok,
        TEMPLATE,
        max_new_tokens=12,
        max_prompt_length=60,
        default_score=-1.0,
        use_chat_template=False,
        generator=generator,
    )
    assert judge.render("2+2?", "4 A", "4") == "Q: 2+2? | GT: 4 | R: 4 A"
    mgr = RewardManager(judge, tok, max_error_fraction=0.5)
    out = mgr.compute(_batch(tok, QUESTIONS, RESPONSES))
    assert judge.last_verdicts == ["Score: 7", "XY", "", "Score: 7"]
    np.testing.assert_allclose(out.scores, [0.7, -1.0, 0.0, 0.7], rtol=0, atol=1e-6)
    assert out.metrics["judge/num_unparseable"] == 1 and out.metrics["judge/num_judged"] == 3
    assert out.metrics["reward/num_errors"] == 1  # the too-long judge prompt is a failed call
    assert "judge prompt has 64 tokens, over the judge's max_prompt_length=60" in out.errors[0]
    np.testing.assert_array_equal(out.extra_infos["judge_parsed"][[0, 1, 3]], [1.0, 0.0, 1.0])
    # the score sits on the last response token, as for rule rewards
    assert out.token_level_scores[0, len(RESPONSES[0]) - 1] == pytest.approx(0.7)
    # our sampler did the generating: greedy, prompts bucketed, one compiled program reused
    assert judge.generator is generator and generator.last_decode_stats is not None

    # the same judge served over HTTP (scripts/serve_reward.py --judge_path serves it this way): same scores
    from jaxrl_post.rewards.remote import RemoteRewardClient
    from jaxrl_post.rewards.server import make_reward_server, serve_in_thread

    server = make_reward_server(judge)
    serve_in_thread(server)
    try:
        client = RemoteRewardClient(f"http://127.0.0.1:{server.server_address[1]}/get_reward", timeout_s=120)
        remote = RewardManager(client, tok, max_error_fraction=0.5).compute(_batch(tok, QUESTIONS, RESPONSES))
    finally:
        server.shutdown()
        server.server_close()
    np.testing.assert_array_equal(remote.scores, out.scores)
    np.testing.assert_array_equal(remote.extra_infos["judge_parsed"], out.extra_infos["judge_parsed"])
    assert remote.metrics["reward/num_errors"] == 1 and remote.metrics["reward/remote/num_retries"] == 0
    assert "the server's reward function failed: judge prompt has 64 tokens" in remote.errors[0]


def test_judge_refuses_bad_templates():
    from jaxrl_post.models.char_tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    with pytest.raises(ValueError, match="must contain '{response}'"):
        GenerativeJudge(object(), tok, "Q: {question}", generator=object())
    with pytest.raises(ValueError, match="may only use"):
        GenerativeJudge(object(), tok, "{response} {answer}", generator=object())
    with pytest.raises(ValueError, match="max_score"):
        GenerativeJudge(object(), tok, "{response}", min_score=5, max_score=5, generator=object())


def test_judge_from_config(tmp_path):
    """`reward_model.judge.path` (an HF directory, here the bigram judge saved with its tokenizer) builds the
    reward manager's scorer; the config path gives the same verdicts as the direct one."""
    from configs import grpo
    from jaxrl_post.errors import ConfigError
    from jaxrl_post.models.char_tokenizer import build_char_tokenizer
    from jaxrl_post.models.hf_io import save_pretrained
    from jaxrl_post.rl.config_check import validate_config
    from jaxrl_post.rl.reward_builders import build_reward_manager

    tok = build_char_tokenizer()
    save_pretrained(_bigram_judge_model(tok), tok, str(tmp_path / "judge"))
    c = grpo.get_config("tiny")
    c.custom_reward_function.path = None
    jc = c.reward_model.judge
    jc.path, jc.dtype, jc.use_chat_template, jc.max_new_tokens = str(tmp_path / "judge"), "float32", False, 12
    jc.prompt_template, jc.max_prompt_length = TEMPLATE, 60
    validate_config(c)
    mgr = build_reward_manager(c, tok)
    out = mgr.compute(_batch(tok, QUESTIONS, RESPONSES))  # the shapes of the direct test: its programs are reused
    assert mgr.compute_score.last_verdicts == ["Score: 7", "XY", "", "Score: 7"]
    np.testing.assert_allclose(out.scores, [0.7, 0.0, 0.0, 0.7], atol=1e-6)
    jc.prompt_template = "{question} {answer}"
    with pytest.raises(ConfigError, match="reward_model.judge.prompt_template"):
        validate_config(c)
    jc.prompt_template, c.reward_model.remote.url = None, "http://127.0.0.1:1/"
    with pytest.raises(ConfigError, match="reward_model.judge.path: pick one reward source"):
        validate_config(c)
