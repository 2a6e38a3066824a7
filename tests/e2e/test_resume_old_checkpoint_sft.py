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
from tests.recorded import assert_recorded

# The expected numbers were recorded under the production XLA:CPU flags (compared as tests/recorded.py says);
# under the tests' cheap compile flags (LLVM -O0, tests/cheap_compile.py) the float rounding differs (measured:
# e.g. actor/ppo_kl 0.0014294971 vs 0.0014295095, every param hash different), so these run in a process without
# them (conftest).
pytestmark = pytest.mark.production_xla_flags

FIXTURE = pathlib.Path(__file__).resolve().parents[1] / "fixtures" / "ckpt_sft_dpo_rm_tiny_before_engine"
UPDATE_NORMS = {  # step 2's ||params after - params before|| per leaf, today's code, 2026-12-07 (test below)
    "dpo": [
        0.0367238,
        0.00388888,
        0.0150633,
        0.0213217,
        0.021804,
        0.0154317,
        0.00351598,
        0.029882,
        0.0304003,
        0.0296292,
        0.0034231,
        0.0159012,
        0.0230128,
        0.02236,
        0.0157946,
        0.00427063,
        0.0317393,
        0.0301721,
        0.0302526,
        0.0033401,
    ],
    "rm": [
        0.0121949,
        0.00291826,
        0.0155226,
        0.0186815,
        0.0214308,
        0.0157371,
        0.00382295,
        0.0296014,
        0.0284136,
        0.0281428,
        0.00353414,
        0.01528,
        0.020936,
        0.0218707,
        0.0140255,
        0.00334731,
        0.0313262,
        0.0293244,
        0.0286541,
        0.00369642,
        0.00295206,
    ],
    "sft": [
        0.0544387,
        0.00473647,
        0.0175108,
        0.0270552,
        0.0248804,
        0.0194557,
        0.00500023,
        0.0337436,
        0.0353557,
        0.0341452,
        0.00455328,
        0.0171208,
        0.0254793,
        0.0251789,
        0.018105,
        0.00446524,
        0.0348137,
        0.0354162,
        0.0351811,
        0.00411779,
    ],
}
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
    """Resume the fixture checkpoint of run `name` in `tmp` and train step 2: its metrics, params digest and the
    L2 norm of step 2's change of each params leaf (`jax.tree.leaves` order)."""
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
        before = jax.tree.map(np.asarray, trainer.state_dict()["actor"]["params"])
        res = trainer.fit()
        metrics = {k: v for k, v in res["history"][-1].items() if not k.startswith(("timing", "perf/"))}
        after = jax.tree.map(np.asarray, trainer.state_dict()["actor"]["params"])
        step = jax.tree.leaves(jax.tree.map(lambda a, b: float(np.linalg.norm(a - b)), after, before))
        return {"metrics": metrics, "params": _digest(after), "update_norms": step}
    finally:
        trainer.close()


@pytest.mark.slow  # three tiny trainers, their compiles and one step each (~60 s on 2 cores)
@pytest.mark.parametrize("name", sorted(RUNS))
def test_supervised_checkpoint_of_the_subclass_trainers_resumes_exactly(tmp_path, name):
    want = json.loads((FIXTURE / "expected_step_2.json").read_text())[name]
    got = resume_step_2(name, tmp_path)
    assert got["metrics"]["epoch"] > 0 and "loss" in got["metrics"]
    # the params digest is the recording machine's rounding (tests/recorded.py); the metrics carry over, and so does
    # the size of step 2's update of every leaf (an optimizer state restored wrong changes it: Adam's moments), as
    # today's code made it on 2026-12-07 (UPDATE_NORMS, recorded on an AMD EPYC)
    assert_recorded(got["metrics"], want["metrics"], name)
    np.testing.assert_allclose(got["update_norms"], UPDATE_NORMS[name], rtol=1e-4, err_msg=name)
