"""Reward-model configs for `jaxrl_post.sft.reward_model.RewardModelTrainer` (`trainer_type = 'reward_model'`).

    python -m jaxrl_post.main --config=configs/reward_model.py                   # tiny: seconds on a CPU
    python -m jaxrl_post.main --config=configs/reward_model.py:smollm2 --config.data.train_files=pairs.jsonl

Variants (`--config=configs/reward_model.py:VARIANT`):
  (default)  = tiny.
  tiny       random 2-layer llama with the character tokenizer on `configs/data/dpo_tiny.jsonl` (32 generated
             arithmetic pairs: prompt "a+b=", chosen the sum, rejected a wrong sum).
  smollm2    SmolLM2-135M-Instruct's backbone (GGUF alias) plus a fresh score head on your pairs
             (`data.train_files`: TRL's prompt / chosen / rejected rows, plain or conversational, an optional
             numeric `margin` column); TRL RewardConfig's defaults where they apply.
  rg_pairs   smollm2 on `runs/pairs/{train,val}.jsonl`: pairs from the model's own samples on the GRPO default
             task (scripts/make_preference_pairs.py), rows of 128 tokens; the RM of `configs/ppo.py:rm`.

`model.*`, `optim.*` and `trainer.*` are `configs/sft.py`'s (same meanings); `data.*` is `configs/dpo.py`'s
(preference pairs); `rm.*` has TRL `RewardConfig`'s names. The run's `huggingface/` export is an HF
`*ForSequenceClassification` directory: an RL run's `reward_model.model.path`.
"""

import os
import sys

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in sys.path:  # config files are loaded by path; make `configs.*` importable from anywhere
    sys.path.insert(0, _REPO)

import ml_collections as mlc

from configs import dpo, sft


def get_base_rm_config() -> mlc.ConfigDict:
    """The reward-model ConfigDict with its defaults (every variant starts here)."""
    c = dpo.get_base_dpo_config()
    c.trainer_type = "reward_model"  # main.py dispatch: 'rl' | 'sft' | 'dpo' | 'reward_model'
    del c["dpo"]
    c.model.use_remove_padding = False  # packed pairs are not implemented for reward models (padded rows)
    c.rm = mlc.ConfigDict()
    # TRL RewardConfig: add coef * mean((r_chosen + r_rejected)^2) to the loss (Eisenstein et al. 2023: 0.01)
    c.rm.center_rewards_coefficient = mlc.FieldReference(None, field_type=float)
    c.optim.lr = 1e-4  # TRL RewardConfig default learning rate
    c.trainer.experiment_name = "reward_model"
    c.trainer.default_local_dir = "runs/reward_model"
    c.trainer.val_before_train = True
    return c


def tiny(c):
    """Random tiny llama, character tokenizer, the generated arithmetic pairs (seconds on a CPU)."""
    c = sft.tiny(c)
    c.model.use_remove_padding = False
    c.trainer.experiment_name = "reward_model_tiny"
    c.trainer.default_local_dir = "runs/reward_model_tiny"
    c.data.train_files = dpo.TINY_PAIRS
    c.data.val_files = dpo.TINY_PAIRS  # the same pairs: a smoke check of validation, not a held-out number
    c.data.max_length = 16  # characters: "a+b=" + answer + <|im_end|>
    c.data.train_batch_size = 8
    c.data.micro_batch_size = 4
    c.optim.lr = 1e-3
    c.rm.center_rewards_coefficient = 0.01
    c.trainer.total_training_steps = 4
    c.trainer.save_freq = 2
    c.trainer.val_before_train = True
    return c


def smollm2(c):
    c.trainer.experiment_name = "reward_model_smollm2"
    c.trainer.default_local_dir = "runs/reward_model_smollm2"
    c.model.dtype = "float32"
    c.data.train_files = ""  # required: --config.data.train_files=pairs.jsonl
    c.data.max_length = 512
    c.data.train_batch_size = 8
    c.data.micro_batch_size = 2
    c.data.max_val_samples = 64
    c.optim.lr = 1e-5
    c.optim.lr_warmup_steps_ratio = 0.1
    c.optim.weight_decay = 0.0
    c.trainer.total_epochs = 1
    c.trainer.test_freq = 25
    c.trainer.save_freq = 50
    return c


def rg_pairs(c):
    # The RLHF pipeline's reward model: SmolLM2 on pairs from its own samples on the GRPO default task (chosen
    # right, rejected wrong; scripts/make_preference_pairs.py -> runs/pairs/); docs/rlhf.md.
    smollm2(c)
    c.trainer.experiment_name = "reward_model_smollm2_rg"
    c.trainer.default_local_dir = "runs/reward_model_rg"
    c.data.train_files = "runs/pairs/train.jsonl"
    c.data.val_files = "runs/pairs/val.jsonl"
    c.data.max_length = 128  # chat prompt 45-48 tokens + a response of <= 48
    c.trainer.test_freq = 10
    return c


def get_config(arg=None):
    c = get_base_rm_config()
    variant = arg or "tiny"
    fns = {"tiny": tiny, "smollm2": smollm2, "rg_pairs": rg_pairs}
    if variant not in fns:
        raise ValueError(f"configs/reward_model.py: unknown variant {variant!r}; valid: {sorted(fns)}")
    return fns[variant](c)
