"""The console: the legend (docs/console.md == the code == `--help`), 'n/a' for undefined values, explained
variance of constant returns undefined, the dropped-validation count in words, the critic_warmup warning."""

import math
import os
import subprocess
import sys

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from jaxrl_post.engine.run.tracking import _CONSOLE_KEYS, CONSOLE_LEGEND, ConsoleLogger, console_legend
from jaxrl_post.rl.metrics import compute_data_metrics
from jaxrl_post.rl.preflight import critic_warmup_warning


def test_legend_covers_every_console_label_and_docs_and_help_agree():
    labels = {label for _, label in _CONSOLE_KEYS if label} | {"val-core/..."}
    assert {label for label, _ in CONSOLE_LEGEND} == labels
    for key, label in _CONSOLE_KEYS:  # each meaning names the metric the label shows
        if label:
            assert dict(CONSOLE_LEGEND)[label].startswith(key), (key, label)
    with open(os.path.join(REPO, "docs", "console.md"), encoding="utf-8") as f:
        assert f"```\n{console_legend()}\n```" in f.read()
    proc = subprocess.run(
        [sys.executable, "-m", "jaxrl_post.main", "--help"], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert console_legend() in proc.stdout  # (absl exits 1 after --help)


def _batch(returns, values):
    B, R = returns.shape
    z = np.zeros((B, R), np.float32)
    return {
        "token_level_scores": z,
        "token_level_rewards": z,
        "advantages": z,
        "returns": returns,
        "values": values,
        "loss_mask": np.ones((B, R), np.int32),
        "attention_mask": np.ones((B, 2 + R), np.int32),
        "responses": np.zeros((B, R), np.int32),
    }


def test_explained_variance_of_constant_returns_is_undefined():
    rng = np.random.default_rng(0)
    const = np.full((2, 3), 0.5, np.float32)
    m = compute_data_metrics(_batch(const, const), use_critic=True)
    assert math.isnan(m["critic/vf_explained_var"])  # verl's eps would give 1 - 0 / 1e-5 = 1
    m = compute_data_metrics(_batch(const, rng.normal(size=(2, 3)).astype(np.float32)), use_critic=True)
    assert math.isnan(m["critic/vf_explained_var"])
    ret = rng.normal(size=(2, 3)).astype(np.float32)
    val = rng.normal(size=(2, 3)).astype(np.float32)
    r64, v64 = ret.astype(np.float64).ravel(), val.astype(np.float64).ravel()
    want = 1.0 - np.var(r64 - v64) / (np.var(r64) + 1e-5)  # verl: 1 - var(returns - values) / (var(returns) + eps)
    assert np.isclose(compute_data_metrics(_batch(ret, val), use_critic=True)["critic/vf_explained_var"], want)
    line = ConsoleLogger.format({"critic/score/mean": 0.25, "critic/vf_explained_var": float("nan")}, 3)
    assert line == "step 3 | score=0.25 | vf_ev=n/a"


def test_dropped_validation_prompts_are_said_in_words():
    stats = {"data/num_train_prompts": 64.0, "data/num_val_prompts": 12.0, "data/val_dropped_seen_in_train": 4.0}
    assert ConsoleLogger.format(stats, 0) == (
        "step 0 | data/num_train_prompts=64 | data/num_val_prompts=12 | "
        "4 validation prompts left out: they also occur in the training data "
        "(data/num_val_prompts counts the validation prompts used)"
    )
    stats["data/val_dropped_seen_in_train"] = 0.0
    assert ConsoleLogger.format(stats, 0) == "step 0 | data/num_train_prompts=64 | data/num_val_prompts=12"


def test_critic_warmup_covering_the_run_warns():
    assert critic_warmup_warning(0, 30) is None and critic_warmup_warning(29, 30) is None
    assert critic_warmup_warning(30, 30) == (
        "warning: trainer.critic_warmup=30 >= total_training_steps=30: the actor never updates (only the critic "
        "trains); lower --config.trainer.critic_warmup"
    )


def test_dpo_and_reward_model_lines_show_their_trl_metrics():
    """A DPO step line shows TRL's preference metrics, a reward-model one its pair accuracy and margin (the
    metric names their step functions log: dpo_step / rm_step), not only the loss."""
    dpo = {"loss": 0.6, "rewards/accuracies": 0.75, "rewards/margins": 0.125, "grad_norm": 2.5, "timing_s/step": 1.0}
    assert ConsoleLogger.format(dpo, 3) == (
        "step 3 | loss=0.6 | rew_acc=0.75 | rew_margin=0.125 | grad_norm=2.5 | step_s=1"
    )
    rm = {"loss": 0.5, "accuracy": 0.875, "margin": 1.5, "val/accuracy": 0.5}
    assert ConsoleLogger.format(rm, 2) == "step 2 | loss=0.5 | pair_acc=0.875 | margin=1.5 | val_pair_acc=0.5"
