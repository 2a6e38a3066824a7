"""Export and chat of a reward-model run (jaxrl_post/export.py): a reward-model checkpoint exports as an HF
`*ForSequenceClassification` directory equal to the trained params (full and LoRA, from the checkpoint alone,
not the trainer's own end-of-run export), and chatting with it is one clear CheckpointError."""

import os
import sys

import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from configs import reward_model as rm_configs

IDS = np.array([[5, 6, 7, 8, 2, 2], [9, 10, 11, 12, 13, 14]], np.int32)
MASK = np.array([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]], np.int32)


def _run(tmp_path, name, **model):
    from jaxrl_post.sft.reward_model import RewardModelTrainer

    cfg = rm_configs.get_config("tiny")
    cfg.trainer.default_local_dir = str(tmp_path / name)
    cfg.trainer.logger, cfg.trainer.progress_bar = ("jsonl",), False
    cfg.trainer.total_training_steps, cfg.trainer.val_before_train, cfg.trainer.val_at_end = 2, False, False
    for k, v in model.items():
        cfg.model[k] = v
    t = RewardModelTrainer(cfg, console_write=lambda _: None)
    t.fit()
    t.close()
    t.sync_weights()
    return t, np.asarray(t.model.module(IDS, MASK))  # the trained RM's rewards [2] float32


@pytest.mark.parametrize(
    "lora", [{}, {"lora_rank": 4, "lora_alpha": 8.0, "target_modules": "all-linear"}], ids=["full", "lora"]
)
@pytest.mark.slow  # a tiny reward-model run, its export and a transformers load (70-90 s on 2 shared, loaded cores)
def test_reward_model_checkpoint_exports_as_seq_cls_and_refuses_chat(tmp_path, lora):
    from jaxrl_post.api import export, load_model
    from jaxrl_post.engine.run.checkpoint import CheckpointError
    from jaxrl_post.models.hf_io import load_reward_model

    _, want = _run(tmp_path, "rm", **lora)
    out = tmp_path / "hf"
    lines = []
    export(str(tmp_path / "rm"), str(out), say=lines.append)  # the run dir: its latest checkpoint (step 2)
    assert lines[0].startswith(f"exported step 2 of {tmp_path / 'rm'}")
    cfg = (out / "config.json").read_text()
    assert "ForSequenceClassification" in cfg and '"num_labels": 1' in cfg
    got = np.asarray(load_reward_model(out)(IDS, MASK))
    np.testing.assert_allclose(got, want, atol=1e-5)  # the checkpoint's params, merged for LoRA
    assert abs(float(want[0] - want[1])) > 0  # two different rewards: a real comparison
    with pytest.raises(CheckpointError, match="reward model's checkpoint.*does not generate"):
        load_model(str(tmp_path / "rm"))
