"""A checkpoint written before the regroup (issue 54: `jaxrl_post/trainer/` split into `engine/`, `rl/`, `sft/`)
resumes on today's code and gives the very step-2 metrics and final parameters of an uninterrupted 2-step run of
that old code.

`tests/fixtures/ckpt_grpo_tiny_before_regroup/` was written by commit 4439dab (`python -m jaxrl_post.main
--config=configs/grpo.py:tiny --config.trainer.total_training_steps=1 --config.trainer.val_before_train=False`);
`expected_step_2.json` holds that code's step-2 metrics of the same command run 2 steps straight (its
`metrics.jsonl`, timings left out): the XLA:CPU flags the CLI sets are the ones the tests run under (conftest).
"""

from __future__ import annotations

import json
import pathlib
import shutil

import pytest

from configs import grpo
from jaxrl_post.rl.trainer import RLTrainer

FIXTURE = pathlib.Path(__file__).resolve().parents[1] / "fixtures" / "ckpt_grpo_tiny_before_regroup"


@pytest.mark.slow  # one tiny GRPO trainer, its compiles and one step (~40 s on 2 cores)
def test_checkpoint_of_the_old_layout_resumes_exactly(tmp_path):
    run = tmp_path / "run"
    shutil.copytree(FIXTURE / "checkpoints", run / "checkpoints")
    want = json.loads((FIXTURE / "expected_step_2.json").read_text())
    c = grpo.get_config("tiny")
    c.trainer.default_local_dir = str(run)
    c.trainer.val_before_train = False
    c.trainer.progress_bar = False
    c.trainer.logger = ("jsonl",)
    lines = []
    trainer = RLTrainer(c, console_write=lines.append)
    try:
        assert trainer.resumed_from is not None and trainer.resumed_from.endswith("global_step_1")
        res = trainer.fit()
        got = {k: v for k, v in res["history"][-1].items() if not k.startswith(("timing", "perf/"))}
        assert res["history"][-1]["training/global_step"] == 2
        assert got == want["grpo_tiny_step_2"]
    finally:
        trainer.close()
