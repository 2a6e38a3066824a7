"""A checkpoint written before the regroup (issue 54: `jaxrl_post/trainer/` split into `engine/`, `rl/`, `sft/`)
resumes on today's code and gives the very step-2 metrics and final parameters of an uninterrupted 2-step run of
that old code (floats to the rounding of the machine that recorded them: `tests/recorded.py`).

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
from tests.recorded import assert_recorded

# The expected numbers were recorded under the production XLA:CPU flags (compared as tests/recorded.py says);
# under the tests' cheap compile flags (LLVM -O0, tests/cheap_compile.py) the float rounding differs (measured:
# e.g. actor/ppo_kl 0.0014294971 vs 0.0014295095, every param hash different), so these run in a process without
# them (conftest).
pytestmark = pytest.mark.production_xla_flags

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
        assert_recorded(got, want["grpo_tiny_step_2"], "step 2")
    finally:
        trainer.close()


ASYNC_FIXTURE = FIXTURE.parent / "ckpt_grpo_async_tiny_json_queue"


@pytest.mark.slow  # one tiny paged asynchronous trainer, two steps (~25 s on 2 cores)
def test_async_checkpoint_with_the_json_queue_resumes_exactly(tmp_path):
    """`ckpt_grpo_async_tiny_json_queue/` was written by commit 24f35a8, before the queue's arrays had an array
    item of their own (every array a JSON list in `host['async']`): `configs/grpo.py:async` with
    `total_training_steps=4`, `save_freq=2`, `val_before_train=False`, `val_at_end=False`, `fit(max_steps=2)` in
    process (the XLA:CPU flags of the CLI set), stopped with 4 groups queued and a batch in flight.
    `expected_straight.json`: the metrics of the same config run 8 steps straight (timings left out; its first 4
    steps equal a 4-step run's), recorded again at 71cf8e4: 24f35a8's recording dropped 8-14 groups a step as
    stale from step 3 on (a group's version was -1 when a response was shorter than R, queue.group_version), so
    the old code's continuation is not today's; its first two steps, which the checkpoint holds, are the same."""
    run = tmp_path / "run"
    shutil.copytree(ASYNC_FIXTURE / "checkpoints", run / "checkpoints")
    want = json.loads((ASYNC_FIXTURE / "expected_straight.json").read_text())["async_tiny_straight_8_steps"]
    host = json.loads((run / "checkpoints" / "global_step_2" / "host" / "metadata").read_text())
    assert "async.arrays" not in host["items"] and host["async"]["queue"]["items"][0]["batch"]["responses"]["data"]
    c = grpo.get_config("async")
    c.trainer.default_local_dir = str(run)
    c.trainer.total_training_steps = 4
    c.trainer.val_before_train = c.trainer.val_at_end = False
    c.trainer.progress_bar = False
    c.trainer.logger = ("jsonl",)
    trainer = RLTrainer(c, console_write=lambda s: None)
    try:
        assert trainer.resumed_from is not None and trainer.resumed_from.endswith("global_step_2")
        hist = trainer.fit()["history"]
    finally:
        trainer.close()
    got = [{k: v for k, v in m.items() if not k.startswith(("timing", "perf/"))} for m in hist]
    assert len(got) == 2
    for step, (g, w) in enumerate(zip(got, want[2:4]), start=3):
        assert_recorded(g, w, f"step {step}")
