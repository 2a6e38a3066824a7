"""The console: the legend (docs/console.md == the code == `--help`), 'n/a' for undefined values, explained
variance of constant returns undefined, the dropped-validation count in words, the critic_warmup warning."""

import json
import math
import os
import subprocess
import sys

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from jaxrl_post.engine.loop import print_legend
from jaxrl_post.engine.run.run_files import has_metrics, prepare_metrics_file
from jaxrl_post.engine.run.tracking import _CONSOLE_KEYS, CONSOLE_LEGEND, ConsoleLogger, console_legend
from jaxrl_post.rl.config_features import console_tags
from jaxrl_post.rl.metrics import compute_data_metrics
from jaxrl_post.rl.preflight import critic_warmup_warning
from jaxrl_post.rl.trainer import summarize


def test_legend_covers_every_console_label_and_docs_and_help_agree():
    labels = {label for _, label in _CONSOLE_KEYS if label} | {"val-core/..."}
    assert {label for label, _, _ in CONSOLE_LEGEND} == labels
    for key, label in _CONSOLE_KEYS:  # each meaning names the metric the label shows
        for lab, _, meaning in CONSOLE_LEGEND:
            if label and lab == label:
                assert meaning.startswith(key), (key, label)
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
        "4 validation prompts were also training prompts: left out; validating on 12 prompts not in the training data"
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


def _legend_labels(text):
    return [line.split()[0] for line in text.splitlines()[1:]]


def _load_config(name, variant="tiny"):
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"cfg_{name}", os.path.join(REPO, "configs", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.get_config(variant)


def test_a_run_prints_only_its_trainers_legend():
    grpo = _legend_labels(console_legend(console_tags(_load_config("grpo"))))  # GRPO with the KL loss
    assert grpo == ["score", "val-core/...", "reward", "resp_len", "truncated", "pg", "ent", "ppo_kl", "kl_loss"] + [
        "gnorm",
        "step_s",
        "gen_s",
        "upd_s",
    ]
    ppo = _legend_labels(console_legend(console_tags(_load_config("ppo"))))
    assert {"vf_ev", "vf_loss", "kl_rew"} <= set(ppo) and "kl_loss" not in ppo and "turns" not in ppo
    tools = _legend_labels(console_legend(console_tags(_load_config("grpo_tools"))))
    assert {"turns", "tool_calls", "tool_err"} <= set(tools) and "vf_ev" not in tools
    assert {"distill", "kl_teacher"} <= set(_legend_labels(console_legend(console_tags(_load_config("opd")))))
    dpo = console_legend({"dpo"})
    assert _legend_labels(dpo) == ["loss", "val_loss", "rew_acc", "rew_margin", "val_rew_acc", "grad_norm", "step_s"]
    assert "loss (DPO)" in dpo and "(SFT)" not in dpo and "critic/" not in dpo
    assert _legend_labels(console_legend({"sft"})) == ["loss", "acc", "val_loss", "val_ppl", "grad_norm", "step_s"]
    assert _legend_labels(console_legend({"reward_model"}))[:2] == ["loss", "val_loss"]
    assert len(_legend_labels(console_legend())) == len(CONSOLE_LEGEND)  # --help and the docs: every line


class _Run:
    def __init__(self, new):
        self.new_directory = new


class _Trainer:
    def __init__(self, new, loggers=("console", "jsonl")):
        self.run, self.lines = _Run(new), []
        self.tracker = type("T", (), {"backends": dict.fromkeys(loggers)})()
        self._say = self.lines.append

    def console_tags(self):
        return {"sft"}


def test_the_legend_is_printed_once_per_run_directory(tmp_path):
    t = _Trainer(new=True)
    assert print_legend(t) and t.lines == [console_legend({"sft"})]
    for t in (_Trainer(new=False), _Trainer(new=True, loggers=("jsonl",))):  # a directory with metrics; no console
        assert not print_legend(t) and t.lines == []
    run = tmp_path / "run"
    assert not has_metrics(str(run))  # no directory yet
    run.mkdir()
    (run / "metrics.jsonl").write_text("")
    assert not has_metrics(str(run))  # an empty file: nothing logged
    (run / "metrics.jsonl").write_text('{"step": 0}\n')
    assert has_metrics(str(run))
    assert "moved to" in prepare_metrics_file(str(run), None)  # a restart from scratch moves the old file aside
    assert not (run / "metrics.jsonl").exists() and has_metrics(str(run))  # the directory has seen a run


def test_agent_step_line_shows_turns_tool_calls_and_tool_errors():
    m = {"critic/score/mean": 0.5, "response_length/mean": 30.0, "num_turns/mean": 2.5, "tool_calls/mean": 0.75}
    m |= {"tool/errors": 2.0, "tool/format_errors": 1.0, "actor/pg_loss": 0.1}
    assert ConsoleLogger.format(m, 4) == (
        "step 4 | score=0.5 | resp_len=30 | turns=2.5 | tool_calls=0.75 | tool_err=2 | pg=0.1"
    )


def test_the_summary_leaves_out_a_side_without_validation():
    after = {"val/loss": 1.5, "timing_s/testing": 2.0}
    assert json.loads(summarize({"val_before": None, "val_after": after})) == {"val_after": {"val/loss": 1.5}}
    assert json.loads(summarize({"val_before": {}, "val_after": after})) == {"val_after": {"val/loss": 1.5}}
    both = {"val_before": {"val-core/x/acc/mean@1": 0.25}, "val_after": after}
    assert json.loads(summarize(both)) == {
        "val_before": {"val-core/x/acc/mean@1": 0.25},
        "val_after": {"val/loss": 1.5},
    }
