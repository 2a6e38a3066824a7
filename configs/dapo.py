"""DAPO (Yu et al. 2025, arXiv 2503.14476) configs: GRPO advantages plus the four DAPO changes, as verl's
DAPO recipe (recipe/dapo) sets them.

  clip-higher               actor.clip_ratio_low = 0.2, actor.clip_ratio_high = 0.28 (and clip_ratio_c = 10)
  token-level loss          actor.loss_agg_mode = 'token-mean'
  dynamic sampling          algorithm.filter_groups (metric 'acc', at most 10 generation batches per step)
  overlong reward shaping   reward_model.overlong_buffer (the last quarter of data.max_response_length,
                            penalty_factor 1.0, logged)
  no KL                     algorithm.use_kl_in_reward = False, actor.use_kl_loss = False

Variants (`--config=configs/dapo.py:VARIANT`) start from the same variant of configs/grpo.py:
  (default)  SmolLM2-135M-Instruct on reasoning-gym basic_arithmetic (the GRPO default run's sizes).
  gsm8k      GSM8K from `<repo>/../shared/data/gsm8k`.
  tiny       random 2-layer llama, a binary toy reward (`configs/tiny_reward.py:contains_digit`), 2 steps (tests).
"""

import os
import sys

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in sys.path:  # config files are loaded by path; make `configs.*` importable from anywhere
    sys.path.insert(0, _REPO)

from configs import grpo


def _dapo(c, *, overlong_buffer_len: int):
    c.actor.clip_ratio_low = 0.2
    c.actor.clip_ratio_high = 0.28
    c.actor.clip_ratio_c = 10.0  # verl's DAPO scripts
    c.actor.loss_agg_mode = "token-mean"
    c.actor.use_kl_loss = False
    c.actor.kl_loss_coef = 0.0
    c.actor.entropy_coeff = 0.0
    c.algorithm.use_kl_in_reward = False
    c.algorithm.kl_ctrl.kl_coef = 0.0
    c.algorithm.filter_groups.enable = True
    c.algorithm.filter_groups.metric = "acc"
    c.algorithm.filter_groups.max_num_gen_batches = 10
    c.reward_model.overlong_buffer.enable = True
    c.reward_model.overlong_buffer.len = overlong_buffer_len
    c.reward_model.overlong_buffer.penalty_factor = 1.0
    c.reward_model.overlong_buffer.log = True
    return c


def get_config(arg=None):
    variant = arg or "default"
    if variant not in ("default", "gsm8k", "tiny"):
        raise ValueError(f"configs/dapo.py: unknown variant {variant!r}; valid: ['default', 'gsm8k', 'tiny']")
    c = grpo.get_config(arg)
    if variant == "default":
        c.trainer.experiment_name = "dapo_smollm2_rg"
        c.trainer.default_local_dir = "runs/dapo"
        return _dapo(c, overlong_buffer_len=12)  # max_response_length 48: penalised past 36 tokens
    if variant == "gsm8k":
        c.trainer.experiment_name = "dapo_smollm2_gsm8k"
        c.trainer.default_local_dir = "runs/dapo_gsm8k"
        return _dapo(c, overlong_buffer_len=64)  # max_response_length 256: penalised past 192 tokens
    c.trainer.experiment_name = "dapo_tiny"
    c.trainer.default_local_dir = "runs/dapo_tiny"
    c.custom_reward_function.name = "contains_digit"
    return _dapo(c, overlong_buffer_len=4)  # max_response_length 12: penalised past 8 tokens
