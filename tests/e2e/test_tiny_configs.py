"""Every config in configs/ has a `:tiny` variant that runs from a fresh clone: no data outside the repository,
no model download (a random model on the character tokenizer), nothing the user has to write first.

Two tiers, to stay well under the CI budget on 2 cores:

* every config's `:tiny` builds, names only data inside the repository (or procedural `reasoning_gym:` specs),
  and its trainer constructs (`api.build_trainer`: data read and tokenized, models built, nothing compiled);
* one training step through the real entry point (`python -m jaxrl_post.main`) for the `:tiny` configs no
  other test runs from the command line: `configs/grpo_tools.py:tiny` (the calculator tool) and
  `configs/sft.py:tiny` (its shipped rows). The others run end to end elsewhere: `grpo.py:tiny` through the CLI in
  tests/e2e/test_no_torch.py and tests/e2e/test_multihost.py, `dpo.py` / `reward_model.py` (default = tiny)
  through the CLI in tests/e2e/test_multihost_sft.py, `ppo.py:tiny` / `dapo.py:tiny` / `opd.py:tiny` in process in
  tests/rl/test_trainer.py, tests/rl/test_dapo.py and tests/rl/test_opd.py.
"""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from jaxrl_post.api import build_trainer

pytestmark = pytest.mark.slow


def _config_modules() -> list[str]:
    """configs/*.py that define `get_config` (base.py, tiny_reward.py and rm_reward.py are helpers)."""
    out = []
    for path in sorted(glob.glob(os.path.join(REPO, "configs", "*.py"))):
        with open(path, encoding="utf-8") as f:
            if "\ndef get_config(" in f.read():
                out.append(os.path.basename(path)[:-3])
    return out


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"cfg_{name}", os.path.join(REPO, "configs", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _data_specs(cfg) -> list[str]:
    return [s for key in ("train_files", "val_files") for s in str(cfg.data.get(key) or "").split(",") if s]


def test_the_config_list_is_complete():
    assert _config_modules() == ["dapo", "dpo", "grpo", "grpo_tools", "opd", "ppo", "reward_model", "sft"]


@pytest.mark.parametrize("name", _config_modules())
def test_tiny_builds_on_data_in_the_repo_and_its_trainer_constructs(name, tmp_path):
    cfg = _load(name).get_config("tiny")
    assert cfg.model.random_init and cfg.model.tokenizer_path == "char"  # no model download
    for spec in _data_specs(cfg):  # shipped in configs/data/ or generated, never ../shared/data
        if not spec.startswith("reasoning_gym:"):
            assert os.path.commonpath([os.path.abspath(spec), REPO]) == REPO, spec
            assert os.path.isfile(spec), spec
    cfg.trainer.default_local_dir = str(tmp_path / name)
    cfg.trainer.logger = ("jsonl",)
    trainer = build_trainer(cfg)
    trainer.close()


@pytest.mark.parametrize("variant", ["configs/grpo_tools.py:tiny", "configs/sft.py:tiny"])
def test_tiny_runs_one_step_through_the_command_line(variant, tmp_path):
    """One step; the console shows this trainer's legend (a new run directory) and, for the agent run, turns /
    tool calls / tool errors on the step line; the SFT run's summary has no empty `val_before`."""
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "jaxrl_post.main", f"--config={variant}"]
    cmd += ["--config.trainer.total_training_steps=1", f"--config.trainer.default_local_dir={run_dir}"]
    cmd += ["--config.trainer.val_before_train=False", "--config.trainer.save_freq=-1"]
    if "sft" in variant:
        cmd += ["--config.trainer.export_hf=False"]  # validation after the step: 16 shipped held-out rows
    else:
        cmd += ["--config.trainer.val_at_end=False"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(run_dir / "metrics.jsonl", encoding="utf-8") as f:
        steps = {row["step"]: row for row in map(json.loads, f)}
    assert max(steps) == 1
    out = proc.stdout
    assert out.count("console step line") == 1
    step_line = next(line for line in out.splitlines() if line.startswith("step 1 |"))
    if "grpo_tools" in variant:  # a multi-turn run with the calculator: the agent loop's metrics
        assert {"num_turns/mean", "tool_calls/mean", "tool/errors"} <= set(steps[1])
        assert steps[1]["critic/score/mean"] >= 0.0
        assert "tool_calls/mean (multi-turn)" in out and "loss (SFT)" not in out and "critic/vf_loss" not in out
        assert f"turns={steps[1]['num_turns/mean']:.4g} | tool_calls=" in step_line and "| tool_err=" in step_line
    else:
        assert steps[0]["data/num_examples"] == 64 and steps[0]["data/num_truncated"] == 0
        assert steps[1]["loss"] > 0.0 and steps[1]["val/loss"] > 0.0
        assert "loss (SFT)" in out and "critic/score/mean" not in out and "loss (DPO)" not in out
        summary = json.loads(out[out.index("\n{") :])  # the last lines: the validation summary
        assert list(summary) == ["val_after"]
