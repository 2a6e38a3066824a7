"""`jaxrl_post.api`: configs with overrides checked as the command line checks them, the trainer named by
`trainer_type`, and train -> evaluate -> export -> chat from Python."""

from __future__ import annotations

import os

import numpy as np
import pytest

from jaxrl_post import api
from jaxrl_post.config import UnknownConfigKeyError
from jaxrl_post.errors import ConfigError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GRPO = os.path.join(REPO, "configs", "grpo.py")


def test_load_config_applies_overrides_like_the_command_line():
    cfg = api.load_config(f"{GRPO}:tiny", {"actor.optim.lr": 3e-4, "rollout.n": 2, "trainer.resume_from_path": None})
    assert cfg.actor.optim.lr == 3e-4 and cfg.rollout.n == 2 and cfg.trainer.resume_from_path is None
    assert cfg.model.arch.num_layers == 2  # the variant was applied
    with pytest.raises(
        UnknownConfigKeyError, match=r"config\.actor\.optim\.lrr.*did you mean config\.actor\.optim\.lr"
    ):
        api.load_config(GRPO, {"actor.optim.lrr": 1.0})
    with pytest.raises(UnknownConfigKeyError, match=r"verl's actor_rollout_ref\.rollout\.n"):
        api.load_config(GRPO, {"actor_rollout_ref.rollout.n": 4})
    with pytest.raises(ConfigError, match=r"config\.rollout\.n='four'"):
        api.load_config(GRPO, {"rollout.n": "four"})
    with pytest.raises(FileNotFoundError):
        api.load_config("configs/nope.py")


def test_trainer_class_follows_trainer_type():
    from jaxrl_post.rl.trainer import RLTrainer
    from jaxrl_post.sft.trainer import SFTTrainer

    assert api.trainer_class(api.load_config(GRPO)) is RLTrainer
    assert api.trainer_class(api.load_config(os.path.join(REPO, "configs", "sft.py"))) is SFTTrainer
    cfg = api.load_config(GRPO)
    with cfg.unlocked():
        cfg.trainer_type = "nope"
    with pytest.raises(ConfigError, match=r"trainer_type='nope'.*one of \['dpo', 'reward_model', 'rl', 'sft'"):
        api.trainer_class(cfg)


@pytest.mark.slow
def test_train_evaluate_export_and_chat_from_python(tmp_path):
    run = tmp_path / "run"
    cfg = api.load_config(
        f"{GRPO}:tiny",
        {
            "trainer.default_local_dir": str(run),
            "trainer.total_training_steps": 1,
            "trainer.save_freq": 1,
            "trainer.val_before_train": False,
            "trainer.val_at_end": False,
        },
    )
    result = api.train(cfg)
    assert np.isfinite(result["last"]["actor/pg_loss"])
    metrics = api.evaluate(cfg, str(run))
    assert metrics["eval/checkpoint_step"] == 1.0 and any(k.startswith("val-core/") for k in metrics)
    out = api.export(str(run), str(tmp_path / "hf"))
    assert os.path.isfile(os.path.join(out, "model.safetensors"))
    from flax import nnx

    from_ckpt, tok, _ = api.load_model(str(run))
    from_export, _, _ = api.load_model(out, tokenizer="char")
    a, b = nnx.state(from_ckpt, nnx.Param), nnx.state(from_export, nnx.Param)
    for x, y in zip(nnx.to_flat_state(a), nnx.to_flat_state(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x[1][...]), np.asarray(y[1][...]), err_msg=str(x[0]))
    chat = api.Chat(from_ckpt, tok, max_new_tokens=4, temperature=0)
    assert chat.reply("2+2=") == api.Chat(from_export, tok, max_new_tokens=4, temperature=0).reply("2+2=")
