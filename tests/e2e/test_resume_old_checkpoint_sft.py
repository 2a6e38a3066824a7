"""Checkpoints of the SFT, DPO and reward-model trainers written before they became one `SupervisedTrainer` with
task objects (issue 54 item 2: `DPOTrainer` / `RewardModelTrainer` were subclasses of `SFTTrainer`) resume on
today's code and give that old code's very step-2 metrics and final parameters.

`tests/fixtures/ckpt_sft_dpo_rm_tiny_before_engine/<run>/checkpoints/global_step_1` were written by commit 001d61e
(`configs/{sft,dpo,reward_model}.py` tiny, `trainer.total_training_steps=2`, `trainer.save_freq=1`, `fit(max_steps=1)`;
SFT on the 12 conversations of `_sft_rows`). `expected_step_2.json` holds what commit 001d61e itself does when it
resumes those checkpoints under the tests' XLA:CPU flags (conftest): each run's step-2 metrics (timings left out) and
a sha256 of its final trained params.
"""

from __future__ import annotations

import hashlib
import json
import pathlib
import shutil

import jax
import numpy as np
import pytest

from configs import dpo, reward_model, sft
from jaxrl_post.sft.dpo import DPOTrainer
from jaxrl_post.sft.reward_model import RewardModelTrainer
from jaxrl_post.sft.trainer import SFTTrainer

# The expected numbers were recorded under the production XLA:CPU flags and are compared exactly; under the tests'
# cheap compile flags (LLVM -O0, tests/cheap_compile.py) the float rounding differs (measured: e.g. actor/ppo_kl
# 0.0014294971 vs 0.0014295095, every param hash different), so these run in a process without them (conftest).
pytestmark = pytest.mark.production_xla_flags

FIXTURE = pathlib.Path(__file__).resolve().parents[1] / "fixtures" / "ckpt_sft_dpo_rm_tiny_before_engine"
RUNS = {"sft": (sft, SFTTrainer), "dpo": (dpo, DPOTrainer), "rm": (reward_model, RewardModelTrainer)}


def _sft_rows(path: pathlib.Path) -> str:
    rows = [
        {
            "messages": [
                {"role": "user", "content": f"add {i} and {i + 1}"},
                {"role": "assistant", "content": f"{2 * i + 1}"},
            ]
        }
        for i in range(12)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _digest(tree) -> str:
    h = hashlib.sha256()
    for x in jax.tree.leaves(jax.tree.map(np.asarray, tree)):
        h.update(np.ascontiguousarray(x).tobytes())
    return h.hexdigest()[:16]


def resume_step_2(name: str, tmp: pathlib.Path) -> dict:
    """Resume the fixture checkpoint of run `name` in `tmp` and train step 2: its metrics and params digest."""
    module, trainer_cls = RUNS[name]
    shutil.copytree(FIXTURE / name / "checkpoints", tmp / name / "checkpoints")
    c = module.get_config("tiny")
    c.trainer.default_local_dir = str(tmp / name)
    c.trainer.logger = ("jsonl",)
    c.trainer.progress_bar = False
    c.trainer.total_training_steps = 2
    c.trainer.save_freq = 1
    c.trainer.export_hf = False
    if name == "sft":
        c.data.train_files = c.data.val_files = _sft_rows(tmp / "sft.jsonl")
    trainer = trainer_cls(c, console_write=lambda s: None)
    try:
        assert trainer.resumed_from is not None and trainer.resumed_from.endswith("global_step_1")
        assert trainer.global_steps == 1
        res = trainer.fit()
        metrics = {k: v for k, v in res["history"][-1].items() if not k.startswith(("timing", "perf/"))}
        return {"metrics": metrics, "params": _digest(trainer.state_dict()["actor"]["params"])}
    finally:
        trainer.close()


@pytest.mark.slow  # three tiny trainers, their compiles and one step each (~60 s on 2 cores)
@pytest.mark.parametrize("name", sorted(RUNS))
def test_supervised_checkpoint_of_the_subclass_trainers_resumes_exactly(tmp_path, name):
    want = json.loads((FIXTURE / "expected_step_2.json").read_text())[name]
    got = resume_step_2(name, tmp_path)
    assert got["metrics"]["epoch"] > 0 and "loss" in got["metrics"]
    assert got == want
