"""The supervised trainers' config checks (`validate_sft_config`, `validate_dpo_config`, `validate_rm_config`) on
`errors.Checker`: the whole message, every line, in order (written out by hand)."""

import pytest

from configs import dpo, reward_model, sft
from jaxrl_post.errors import ConfigError
from jaxrl_post.sft.dpo import validate_dpo_config
from jaxrl_post.sft.reward_model import validate_rm_config
from jaxrl_post.sft.sft_task import validate_sft_config


def _raises(fn, cfg) -> str:
    with pytest.raises(ConfigError) as e:
        fn(cfg)
    return str(e.value)


def test_sft_config_message():
    c = sft.get_config("tiny")
    c.data.micro_batch_size = 3
    c.data.format = "csv"
    c.model.use_remove_padding = False
    c.data.packing_strategy = "bfd"
    c.data.train_files = ""
    c.trainer.total_training_steps, c.trainer.total_epochs = None, 0
    assert _raises(validate_sft_config, c) == (
        "invalid SFT config:\n"
        "  config.data.train_batch_size=4 must be a multiple of data.micro_batch_size=3\n"
        "  config.data.format='csv': must be one of ['auto', 'messages', 'prompt_completion', 'prompt_response']\n"
        "  config.data.packing_strategy='bfd' packs examples into rows: it needs model.use_remove_padding=True\n"
        "  config.data.train_files: no training data given\n"
        "  config.trainer.total_epochs=0: must be an int > 0"
    )
    validate_sft_config(sft.get_config("tiny"))


def test_dpo_and_reward_model_config_messages():
    c = dpo.get_config("tiny")
    c.data.max_length, c.data.max_prompt_length = 0, 4
    c.trainer.resume_mode = "never"
    c.dpo.loss_type, c.dpo.label_smoothing = "ipo", 0.1
    assert _raises(validate_dpo_config, c) == (
        "invalid DPO config:\n"
        "  config.data.max_length=0: must be an int > 0\n"
        "  config.data.max_prompt_length=4: must be None or an int in [1, data.max_length)\n"
        "  config.trainer.resume_mode='never': must be one of ['auto', 'disable', 'resume_path']\n"
        "  config.dpo.label_smoothing: not used by loss_type='ipo'; set it to 0 (or use 'sigmoid' / 'robust')"
    )
    c = reward_model.get_config("tiny")
    c.rm.center_rewards_coefficient = -1.0
    c.data.packing_strategy = "bfd"
    assert _raises(validate_rm_config, c) == (
        "invalid reward-model config:\n"
        "  config.data.packing_strategy='bfd' packs pairs into rows: it needs model.use_remove_padding=True\n"
        "  config.rm.center_rewards_coefficient=-1.0: must be None or a number >= 0\n"
        "  config.data.packing_strategy='bfd': not built for reward-model training; use 'per_step'"
    )
