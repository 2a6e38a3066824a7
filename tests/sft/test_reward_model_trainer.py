"""Reward-model training (sft/rm_step.py, sft/reward_model.py, configs/reward_model.py): the
Bradley-Terry loss and gradients against TRL 1.16 `RewardTrainer.compute_loss` (torch, test-only), the
layout, config errors, and a tiny run through main.py that resumes exactly and exports an RM the RL loop reads."""

import json
import math
import os
import sys
import types

import jax
import numpy as np
import pytest
from flax import nnx

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from configs import reward_model as rm_configs
from jaxrl_post.data.preference import PreferencePair
from jaxrl_post.engine import steps
from jaxrl_post.sft import rm_step


def _pairs(rng, n, vocab):
    out = []
    for i in range(n):
        p = rng.randint(1, vocab, rng.randint(2, 5))
        c, r = rng.randint(1, vocab, rng.randint(1, 5)), rng.randint(1, vocab, rng.randint(1, 5))
        out.append(PreferencePair(*(np.asarray(x, np.int32) for x in (p, c, r)), where=f"row {i}", margin=0.3 * i))
    return out


def test_bradley_terry_loss_by_hand():
    rc, rr, m = np.array([1.0, -0.5]), np.array([0.0, 0.5]), np.array([0.5, 0.0])
    got = np.asarray(rm_step.bradley_terry_loss(rc, rr, m, 0.1))
    want = [math.log1p(math.exp(-0.5)) + 0.1 * 1.0, math.log1p(math.exp(1.0)) + 0.0]
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_layout_pairs_chosen_then_rejected_per_micro_batch():
    pairs = _pairs(np.random.RandomState(0), 4, 50)
    lay = rm_step.layout_pairs(pairs, n_micro=2, pairs_per_micro=2, row_len=10, pad_id=0)
    assert lay["input_ids"].shape == (2, 4, 10) and lay["margin"].shape == (2, 2)
    for k in range(2):
        for j in range(2):
            x = pairs[2 * k + j]
            for row, comp in ((j, x.chosen_ids), (2 + j, x.rejected_ids)):
                seq = np.concatenate([x.prompt_ids, comp])
                np.testing.assert_array_equal(lay["input_ids"][k, row, : len(seq)], seq)
                assert lay["attention_mask"][k, row].sum() == len(seq)
    np.testing.assert_allclose(lay["margin"], [[0.0, 0.3], [0.6, 0.9]], rtol=1e-6)


@pytest.mark.slow  # torch + transformers + TRL import and a TRL trainer (32 s on 2 shared, loaded cores)
def test_loss_metrics_and_grads_match_trl_reward_trainer(tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from trl.trainer.reward_trainer import RewardTrainer

    from jaxrl_post.models.hf_io import _get_variable, load_reward_model, reward_param_map
    from tests.models.test_models import BASE

    cfg = transformers.LlamaConfig(**dict(BASE, tie_word_embeddings=False), num_labels=1, pad_token_id=0)
    torch.manual_seed(0)
    hf = transformers.LlamaForSequenceClassification(cfg)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_((1.0 + 0.1 * torch.randn_like(p)) if "norm" in name else 0.15 * torch.randn_like(p))
    hf.save_pretrained(tmp_path)
    ours = load_reward_model(tmp_path)
    pairs = _pairs(np.random.RandomState(1), 4, cfg.vocab_size)
    lay = rm_step.layout_pairs(pairs, n_micro=2, pairs_per_micro=2, row_len=10, pad_id=0)
    # TRL's batch: [chosen rows; rejected rows] (DataCollatorForPreference order) + the margin column
    flat = lambda x, a, b: np.concatenate([x[k, a:b] for k in range(2)])
    ids = np.concatenate([flat(lay["input_ids"], 0, 2), flat(lay["input_ids"], 2, 4)])
    mask = np.concatenate([flat(lay["attention_mask"], 0, 2), flat(lay["attention_mask"], 2, 4)])
    margin = lay["margin"].reshape(-1)
    fake = types.SimpleNamespace(
        model=types.SimpleNamespace(training=True),
        args=types.SimpleNamespace(center_rewards_coefficient=0.05),
        accelerator=types.SimpleNamespace(gather=lambda x: x, gather_for_metrics=lambda x: x),
        _metrics={"train": {k: [] for k in ("num_tokens", *rm_step.METRIC_KEYS)}},
        _total_train_tokens=0,
        _tp_size=1,
    )
    hf.train()
    inputs = {
        "input_ids": torch.tensor(ids, dtype=torch.long),
        "attention_mask": torch.tensor(mask),
        "margin": torch.tensor(margin),
    }
    loss = RewardTrainer.compute_loss(fake, hf, inputs)
    loss.backward()
    trl_metrics = {k: v[-1] for k, v in fake._metrics["train"].items()}
    g, params, rest = steps.split_model(ours)
    fn = jax.jit(rm_step.make_rm_grads(g, rest, center_coef=0.05))
    j_loss, j_metrics, j_grads = fn(params, {k: np.asarray(v) for k, v in lay.items()})
    np.testing.assert_allclose(float(j_loss), loss.item(), rtol=1e-5, atol=1e-6)
    for k in rm_step.METRIC_KEYS:
        np.testing.assert_allclose(float(j_metrics[k]), trl_metrics[k], rtol=1e-5, atol=1e-6, err_msg=k)
    assert 0 < trl_metrics["accuracy"] < 1 or trl_metrics["margin"] != 0
    g_model = nnx.merge(g, j_grads, rest)
    t_params = dict(hf.named_parameters())
    for hf_name, (path, _, to_hf) in reward_param_map(ours.config).items():
        want = t_params[hf_name].grad.numpy()
        got = to_hf(np.asarray(_get_variable(g_model, path)[...]))
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-4, err_msg=hf_name)


def _tiny(tmp_path, run, **over):
    cfg = rm_configs.get_config("tiny")
    cfg.trainer.default_local_dir = str(tmp_path / run)
    cfg.trainer.logger = ("jsonl",)
    cfg.trainer.progress_bar = False
    for k, v in over.items():
        sec, key = k.split("__")
        cfg[sec][key] = v
    return cfg


def test_config_errors_name_the_keys(tmp_path):
    from jaxrl_post.errors import ConfigError
    from jaxrl_post.sft.reward_model import validate_rm_config

    cfg = _tiny(tmp_path, "x", rm__center_rewards_coefficient=-1.0, data__truncation="right")
    with pytest.raises(ConfigError, match=r"(?s)data.truncation='right'.*rm.center_rewards_coefficient=-1.0"):
        validate_rm_config(cfg)
    cfg = _tiny(tmp_path, "x", data__packing_strategy="bfd")  # DPO's dataset packing is not built for the RM
    with pytest.raises(ConfigError, match=r"data.packing_strategy='bfd': not built for reward-model training"):
        validate_rm_config(cfg)


@pytest.mark.slow  # two tiny trainers, their compiles and an RM scorer (~60-120 s on this loaded machine)
def test_tiny_run_via_main_resumes_exactly_and_exports_for_the_rl_loop(tmp_path, monkeypatch):
    from jaxrl_post import main as main_mod
    from jaxrl_post.models.hf_io import load_reward_model
    from jaxrl_post.sft.reward_model import RewardModelTrainer

    cfg = _tiny(tmp_path, "a")
    monkeypatch.setattr(main_mod, "_CONFIG", type("F", (), {"value": cfg})())
    main_mod.main([])
    lines = [json.loads(s) for s in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    steps_ = [ln for ln in lines if "loss" in ln]
    assert [ln["step"] for ln in steps_] == [1, 2, 3, 4]
    for k in ("loss", "grad_norm", "learning_rate", "num_tokens", "epoch", *rm_step.METRIC_KEYS):
        assert k in steps_[-1] and math.isfinite(steps_[-1][k]), k
    assert 0.0 <= steps_[-1]["accuracy"] <= 1.0
    assert steps_[-1]["min_reward"] <= steps_[-1]["mean_reward"] <= steps_[-1]["max_reward"]
    assert "val/accuracy" in steps_[-1]
    assert any("val/loss" in ln for ln in lines if ln["step"] == 0)  # val_before_train

    # interrupted after step 2 and resumed: the same run
    b = RewardModelTrainer(_tiny(tmp_path, "b"))
    b.fit(max_steps=2)
    b.close()
    b2 = RewardModelTrainer(_tiny(tmp_path, "b"))
    assert b2.global_steps == 2 and b2.resumed_from.endswith("global_step_2")
    last = b2.fit()["last"]
    b2.close()
    assert b2.compile_counts() == {"update": 1, "eval": 1}
    for k in ("loss", "accuracy", "margin", "grad_norm", "val/loss", "val/accuracy"):
        assert last[k] == steps_[-1][k], k

    # the export is a *ForSequenceClassification dir equal to the trained params; the RL loop loads the run dir
    exported = steps.split_model(load_reward_model(tmp_path / "a" / "huggingface"))[1]
    for x, y in zip(jax.tree.leaves(exported), jax.tree.leaves(b2.state.params)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    from configs import grpo
    from jaxrl_post.rl.builders import load_tokenizer
    from jaxrl_post.rl.reward_builders import build_rm_scorer

    rl = grpo.get_config("tiny")
    rl.reward_model.enable, rl.reward_model.model.path = True, str(tmp_path / "a")
    scorer = build_rm_scorer(rl, None, load_tokenizer("char"))
    assert not scorer.rerender  # same char tokenizer and template


def test_margin_column_is_read_per_pair_and_checked():
    from jaxrl_post.data.preference import tokenize_pairs
    from jaxrl_post.data.rows import MalformedRowError
    from jaxrl_post.models.char_tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    rows = [
        ("f, row 0", {"prompt": "1+1=", "chosen": "2", "rejected": "3", "margin": 1.5}),
        ("f, row 1", {"prompt": "1+2=", "chosen": "3", "rejected": "4"}),
    ]
    data = tokenize_pairs(rows, tok, max_length=16)
    assert [p.margin for p in data.pairs] == [1.5, None]
    from jaxrl_post.sft.reward_model import RewardModelTask

    assert [p.margin for p in RewardModelTask.head(data, 1).pairs] == [1.5]  # data.max_val_samples
    data = tokenize_pairs(rows, tok, max_length=16)
    lay = rm_step.layout_pairs(data.pairs, n_micro=1, pairs_per_micro=2, row_len=16)
    np.testing.assert_allclose(lay["margin"], [[1.5, 0.0]])
    bad = [("f, row 7", {"prompt": "1+1=", "chosen": "2", "rejected": "3", "margin": "big"})]
    with pytest.raises(MalformedRowError, match=r"f, row 7.*margin"):
        tokenize_pairs(bad, tok, max_length=16)


@pytest.mark.slow  # a LoRA trainer's compile and an export (~40-80 s on this loaded machine)
def test_lora_trains_adapters_and_score_head_and_exports_merged(tmp_path):
    from jaxrl_post.models.hf_io import load_reward_model
    from jaxrl_post.sft.reward_model import RewardModelTrainer

    cfg = _tiny(tmp_path, "lora", model__lora_rank=4, model__lora_alpha=8.0, model__target_modules="all-linear")
    cfg.trainer.total_training_steps, cfg.trainer.val_before_train, cfg.trainer.val_at_end = 2, False, False
    t = RewardModelTrainer(cfg)
    init_params = jax.tree.map(np.asarray, t.state.params)
    init_frozen = jax.tree.map(np.asarray, t.model.frozen)
    assert "score" in init_params  # trained with the adapters (modules_to_save)
    t.fit()
    t.close()
    moved = jax.tree.map(lambda a, b: float(np.abs(np.asarray(a) - b).max()), t.state.params, init_params)
    assert moved["score"].get_value() > 0
    assert max(jax.tree.leaves(moved)) > 0
    for a, b in zip(jax.tree.leaves(t.model.frozen), jax.tree.leaves(init_frozen)):
        np.testing.assert_array_equal(np.asarray(a), b)  # the base weights never train
    exported = load_reward_model(tmp_path / "lora" / "huggingface")
    ids = np.array([[5, 6, 7, 8, 2, 2], [9, 10, 11, 12, 13, 14]], np.int32)
    mask = np.array([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]], np.int32)
    t.sync_weights()
    np.testing.assert_allclose(np.asarray(exported(ids, mask)), np.asarray(t.model.module(ids, mask)), atol=1e-5)
