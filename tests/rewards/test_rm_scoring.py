"""Reward-model scoring in the RL loop (rewards/rm_scorer.py, RewardManager's `rm_scores`, the
`reward_model.enable` keys): a tiny GRPO run with the RM as the only reward, re-rendering for an RM with
another chat template, and a custom reward combining the RM score with a rule score."""

import os
import sys

import jax
import numpy as np
import pytest
from flax import nnx

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from configs import grpo
from jaxrl_post.batch.protocol import DataProto
from jaxrl_post.errors import ConfigError
from jaxrl_post.models import ModelConfig
from jaxrl_post.models.char_tokenizer import build_char_tokenizer
from jaxrl_post.models.hf_io import load_reward_model, save_reward_model
from jaxrl_post.models.reward_model import RewardModel
from jaxrl_post.rewards import RewardManager
from jaxrl_post.rewards.rm_scorer import RewardModelScorer
from jaxrl_post.rl.config_check import validate_config

TINY_RM = ModelConfig(
    family="llama",
    vocab_size=128,
    hidden_size=32,
    intermediate_size=48,
    num_layers=1,
    num_heads=2,
    num_kv_heads=1,
    head_dim=16,
    tie_word_embeddings=True,
)


def _save_rm(path, tokenizer=None, seed=0):
    rm = RewardModel(TINY_RM, rngs=nnx.Rngs(seed))
    rm.score[...] = rm.score[...] * 20.0  # O(1) scores that differ between trajectories
    save_reward_model(rm, tokenizer, path, pad_token_id=2)
    return str(path)


def _direct_scores(rm, ids, mask):
    """Each row without its padding, right-aligned into one batch (a layout the scorer never builds from a
    rollout's left-padded prompts), one plain jitted forward (padding handling: test_reward_model.py)."""
    rows = [np.asarray(ids[i][mask[i].astype(bool)], np.int32) for i in range(ids.shape[0])]
    width = max(len(r) for r in rows)
    ids2 = np.array([np.pad(r, (0, width - len(r))) for r in rows], np.int32)
    mask2 = np.array([[1] * len(r) + [0] * (width - len(r)) for r in rows], np.int32)
    return np.asarray(_jit_rm(rm, ids2, mask2), np.float32)


_jit_rm = jax.jit(lambda m, i, k: m(i, k))


@pytest.mark.slow  # a tiny GRPO run with validation: ~1-2 min on a loaded 2-core CPU
def test_grpo_tiny_with_the_reward_model_as_the_only_reward(tmp_path):
    from jaxrl_post.rl.trainer import RLTrainer

    c = grpo.get_config("tiny")
    c.trainer.default_local_dir = str(tmp_path / "run")
    c.custom_reward_function.path = None
    c.reward_model.enable = True
    c.reward_model.model.path = _save_rm(tmp_path / "rm")
    c.reward_model.micro_batch_size_per_gpu = 3  # 16 rows -> padded to 18, 6 micro-batches
    c.trainer.total_training_steps = 1
    c.trainer.val_before_train, c.trainer.val_at_end = True, False  # validation is scored by the RM too
    trainer = RLTrainer(c)
    seen = []
    compute = trainer.reward_fn.compute

    def spy(data):
        out = compute(data)
        seen.append((np.asarray(data.batch["input_ids"]), np.asarray(data.batch["attention_mask"]), out))
        return out

    trainer.reward_fn.compute = spy
    try:
        hist = trainer.fit()["history"]
        assert trainer.reward_fn.rm_scorer is not None and not trainer.reward_fn.rm_scorer.rerender
        assert trainer.compile_counts()["rm"] == 1
    finally:
        trainer.close()
    assert len(seen) == 2 and len(hist) == 1  # validation before training, then step 1
    tok = build_char_tokenizer()
    rm = load_reward_model(c.reward_model.model.path)
    for k, (ids, mask, out) in enumerate(seen):
        # each trajectory alone, unpadded, as the policy saw it; rows whose decoded text re-encodes to the
        # same ids (the random policy also samples ids the char tokenizer cannot decode) through the text
        ref = _direct_scores(rm, ids, mask)
        same_text = []
        for i in range(len(ids)):
            own = ids[i][mask[i].astype(bool)]
            enc = tok(tok.decode(own, skip_special_tokens=False), add_special_tokens=False)["input_ids"]
            same_text.append(list(enc) == own.tolist())
        assert any(same_text)
        assert np.std(ref) > 1e-3  # the scores differ between trajectories
        np.testing.assert_allclose(out.scores, ref, atol=1e-5)
        np.testing.assert_allclose(out.token_level_scores.sum(-1), ref, atol=1e-5)
        if k == 1:
            m = hist[0]
            assert m["reward_model/score_mean"] == pytest.approx(float(ref.mean()), abs=1e-5)
            assert m["critic/score/mean"] == pytest.approx(float(ref.mean()), abs=1e-5)


def _rollout_batch(tok, prompts, responses, p=24, r=10):
    """A rollout-shaped DataProto: left-padded prompts (chat-templated), right-padded responses."""
    rows_p = [tok.apply_chat_template(m, add_generation_prompt=True, tokenize=True) for m in prompts]
    rows_p = [list(x["input_ids"]) if hasattr(x, "keys") else list(x) for x in rows_p]
    rows_r = [tok(t, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for t in responses]
    b = len(prompts)
    pr, pm = np.full((b, p), 2, np.int32), np.zeros((b, p), np.int32)
    rr, rmask = np.full((b, r), 2, np.int32), np.zeros((b, r), np.int32)
    for i, (a, z) in enumerate(zip(rows_p, rows_r)):
        pr[i, p - len(a) :], pm[i, p - len(a) :] = a, 1
        rr[i, : len(z)], rmask[i, : len(z)] = z, 1
    batch = {
        "input_ids": np.concatenate([pr, rr], 1),
        "attention_mask": np.concatenate([pm, rmask], 1),
        "responses": rr,
        "response_attention_mask": rmask,
    }
    raw = np.empty((b,), object)
    for i, m in enumerate(prompts):
        raw[i] = m
    nt = {
        "raw_prompt": raw,
        "data_source": np.array(["toy"] * b, object),
        "ground_truth": np.array(["7"] * b, object),
    }
    return DataProto(batch, nt)


PROMPTS = [
    [{"role": "user", "content": "2+5?"}],
    [{"role": "user", "content": "3*3?"}],
    [{"role": "user", "content": "hi"}],
]
RESPONSES = ["7", "It is 9", "hello"]


@pytest.mark.slow  # four small compiles: ~50 s on a loaded 2-core CPU
def test_rm_with_another_chat_template_rerenders_the_conversation(tmp_path):
    import copy

    policy_tok = build_char_tokenizer()
    rm_tok = copy.deepcopy(policy_tok)
    rm_tok.chat_template = "{% for m in messages %}[{{ m['role'] }}]: {{ m['content'] }}\n{% endfor %}"
    path = _save_rm(tmp_path / "rm", tokenizer=rm_tok, seed=1)
    from jaxrl_post.models.tokenizer import load_tokenizer

    rm_tok = load_tokenizer(path)
    rm = load_reward_model(path)
    data = _rollout_batch(policy_tok, PROMPTS, RESPONSES)
    scorer = RewardModelScorer(rm, policy_tok, rm_tokenizer=rm_tok, micro_batch_size=2, max_length=40)
    assert scorer.rerender
    got = scorer(data)
    texts = [f"[user]: {m[0]['content']}\n[assistant]: {r}\n" for m, r in zip(PROMPTS, RESPONSES)]
    enc = [rm_tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    ids = np.array([e + [2] * (40 - len(e)) for e in enc], np.int32)
    mask = np.array([[1] * len(e) + [0] * (40 - len(e)) for e in enc], np.int32)
    np.testing.assert_allclose(got, _direct_scores(rm, ids, mask), atol=1e-5)
    assert scorer.last_metrics["reward_model/num_truncated"] == 0
    # a budget shorter than the rendering keeps the end (the token the RM reads) and counts the cut
    short = RewardModelScorer(rm, policy_tok, rm_tokenizer=rm_tok, micro_batch_size=2, max_length=16)
    got = short(data)
    n = sum(len(e) > 16 for e in enc)
    assert n >= 1 and short.last_metrics["reward_model/num_truncated"] == n
    cut = [e[-16:] for e in enc]
    ref = _direct_scores(
        rm,
        np.array([e + [2] * (16 - len(e)) for e in cut]),
        np.array([[1] * len(e) + [0] * (16 - len(e)) for e in cut]),
    )
    np.testing.assert_allclose(got, ref, atol=1e-5)


def combine(data_source, solution_str, ground_truth, extra_info=None):
    rule = float(solution_str.strip().endswith(ground_truth))
    return {"score": rule + 0.5 * extra_info["rm_score"], "acc": rule}


def test_custom_reward_combines_rm_score_with_a_rule_score():
    tok = build_char_tokenizer()
    data = _rollout_batch(tok, PROMPTS, RESPONSES)
    rm_scores = np.array([0.2, -1.0, 3.0], np.float32)
    calls = []

    def scorer(d):
        calls.append(len(d))
        return rm_scores

    with RewardManager(combine, tok, num_workers=0, rm_scorer=scorer) as mgr:
        out = mgr.compute(data)
    np.testing.assert_allclose(out.scores, [1.0 + 0.1, 0.0 - 0.5, 0.0 + 1.5], atol=1e-6)
    np.testing.assert_allclose(out.extra_infos["acc"], [1, 0, 0])
    assert out.metrics["reward_model/score_mean"] == pytest.approx(rm_scores.mean())
    assert calls == [3]
    assert "rm_score" not in (data.non_tensor_batch.get("extra_info") or [{}])[0]  # rows' dicts untouched
    # rm_scores already in the batch (verl's key): used as they are, the scorer is not called
    data.batch["rm_scores"] = -rm_scores
    with RewardManager(combine, tok, num_workers=0, rm_scorer=scorer) as mgr:
        out = mgr.compute(data)
    np.testing.assert_allclose(out.scores, [1.0 - 0.1, 0.5, -1.5], atol=1e-6)
    assert calls == [3]
    data.batch["rm_scores"] = np.array([0.0, np.nan, 1.0], np.float32)
    with RewardManager(combine, tok, num_workers=0) as mgr, pytest.raises(ValueError, match="not finite"):
        mgr.compute(data)


def test_reward_model_config_errors_name_the_key(tmp_path):
    c = grpo.get_config("tiny")
    c.reward_model.enable = True
    with pytest.raises(ConfigError, match="reward_model.model.path"):
        validate_config(c)
    c.reward_model.model.path = str(tmp_path)
    c.reward_model.micro_batch_size_per_gpu = 0
    with pytest.raises(ConfigError, match="reward_model.micro_batch_size_per_gpu"):
        validate_config(c)


_SHARDED = """
import os
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
import sys
sys.path.insert(0, {repo!r})
import numpy as np
from flax import nnx
from jaxrl_post.models.reward_model import RewardModel
from jaxrl_post.batch.protocol import DataProto
from jaxrl_post.rewards.rm_scorer import RewardModelScorer
from jaxrl_post.runtime.sharding import make_mesh
from jaxrl_post.models.char_tokenizer import build_char_tokenizer
from tests.rewards.test_rm_scoring import TINY_RM

tok = build_char_tokenizer()
rng = np.random.RandomState(0)
ids = rng.randint(4, 100, (6, 12)).astype(np.int32)
mask = np.ones((6, 12), np.int32)
mask[0, :3] = 0
mask[1, 8:] = 0
d = DataProto({{"input_ids": ids, "attention_mask": mask}}, {{}})
one = RewardModelScorer(RewardModel(TINY_RM, rngs=nnx.Rngs(0)), tok, micro_batch_size=2)(d)
mesh = make_mesh(data=4, fsdp=2, tensor=1)
many = RewardModelScorer(RewardModel(TINY_RM, rngs=nnx.Rngs(0)), tok, micro_batch_size=1, mesh=mesh)(d)
assert many.shape == (6,) and np.abs(one - many).max() < 1e-5, (one, many)
print("OK")
"""


@pytest.mark.slow  # a fresh process with 8 fake devices and two compiles: ~40 s on this loaded machine
def test_sharded_scoring_equals_one_device():
    """8 fake CPU devices (data 4 x fsdp 2): 6 rows padded to 8, params sharded -> the one-device scores."""
    import subprocess

    out = subprocess.run(
        [sys.executable, "-c", _SHARDED.format(repo=REPO)], capture_output=True, text=True, timeout=600, cwd=REPO
    )
    assert out.returncode == 0 and "OK" in out.stdout, out.stderr[-3000:]


def test_rm_reward_with_acc_returns_rm_score_and_rule_accuracy():
    """configs/rm_reward.py (configs/ppo.py:rm): the reward is the RM score, `acc` the rule score beside it."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("rm_reward", os.path.join(REPO, "configs", "rm_reward.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    fn = mod.rm_score_with_acc
    assert fn("openai/gsm8k", "so #### 42", "42", {"rm_score": -0.25}) == {"score": -0.25, "acc": 1.0}
    assert fn("openai/gsm8k", "so #### 41", "42", {"rm_score": 1.5}) == {"score": 1.5, "acc": 0.0}
    with pytest.raises(KeyError, match="rm_score"):
        fn("openai/gsm8k", "so #### 42", "42", {})
