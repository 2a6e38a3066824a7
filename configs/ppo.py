"""PPO with GAE and a critic (verl's `algorithm.adv_estimator=gae`).

Variants (`--config=configs/ppo.py:VARIANT`):
  (default)  SmolLM2-135M-Instruct actor and critic (value head on the same backbone) on the GRPO task.
  tiny       random 2-layer llama actor/critic, toy reward, a few steps (tests).
  rm         the default with the reward model of `configs/reward_model.py:rg_pairs` (runs/reward_model_rg) as
             the only reward; the task's rule score is logged beside it as `acc` (configs/rm_reward.py), never
             trained on: the RLHF pipeline of docs/rlhf.md.
"""

import os
import sys

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in sys.path:  # config files are loaded by path; make `configs.*` importable from anywhere
    sys.path.insert(0, _REPO)

from configs import (
    base,
    grpo,
)


def _default(c):
    c = grpo._default(c)  # same task, model, lengths and validation as the GRPO default
    c.trainer.experiment_name = "ppo_smollm2_rg"
    c.trainer.default_local_dir = "runs/ppo"
    c.data.train_batch_size = 8
    c.rollout.n = 4  # 32 responses per step
    c.actor.ppo_mini_batch_size = 4  # prompts (16 responses): 2 actor updates per step (old log-probs recomputed)
    c.actor.ppo_micro_batch_size = 8
    c.critic.ppo_mini_batch_size = 4  # prompts (16 responses): 2 critic updates per step
    c.critic.ppo_micro_batch_size = 8
    c.critic.forward_micro_batch_size = 8
    c.critic.optim.lr = 1e-5
    c.critic.optim.lr_warmup_steps = 0
    c.critic.optim.weight_decay = 0.0
    c.trainer.critic_warmup = 2  # let the value head catch up before the first policy update
    c.algorithm.use_kl_in_reward = True
    c.algorithm.kl_ctrl.type = "fixed"
    c.algorithm.kl_ctrl.kl_coef = 0.001
    return c


def _rm(c):
    c = _default(c)
    c.trainer.experiment_name = "ppo_smollm2_rg_rm"
    c.trainer.default_local_dir = "runs/ppo_rm"
    c.reward_model.enable = True
    c.reward_model.model.path = "runs/reward_model_rg"
    c.custom_reward_function.path = os.path.join(_REPO, "configs", "rm_reward.py")
    c.custom_reward_function.name = "rm_score_with_acc"
    c.trainer.test_freq = 5
    return c


def _tiny(c):
    c = grpo.tiny(c)
    c.trainer.experiment_name = "ppo_tiny"
    c.trainer.default_local_dir = "runs/ppo_tiny"
    c.actor.use_kl_loss = False
    c.algorithm.use_kl_in_reward = True
    c.algorithm.kl_ctrl.type = "adaptive"
    c.algorithm.kl_ctrl.kl_coef = 0.01
    c.algorithm.kl_ctrl.horizon = 40000  # responses (10000 prompts x rollout.n = 4)
    c.critic.optim.lr = 1e-3
    c.trainer.critic_warmup = 1
    return c


def get_config(arg=None):
    c = base.get_base_config()
    c.algorithm.adv_estimator = "gae"
    c.algorithm.gamma = 1.0
    c.algorithm.lam = 0.95
    c.critic.enable = True
    variant = arg or "default"
    fns = {"default": _default, "tiny": _tiny, "rm": _rm}
    if variant not in fns:
        raise ValueError(f"configs/ppo.py: unknown variant {variant!r}; valid: {sorted(fns)}")
    return fns[variant](c)
