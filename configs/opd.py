"""On-policy distillation (verl's `distillation.*` on the RL trainer) configs.

The student (the actor) samples `rollout.n` responses per prompt; the frozen teacher scores the sampled tokens
(`teacher_log_prob`); the actor is trained with verl's PG OPD: per-token reward `-clamp(k1)` =
`log pi_teacher - log pi_student`, clipped PPO update, task rewards off (they are still computed and logged).

Variants (`--config=configs/opd.py:VARIANT`):
  (default)  tiny: a random 2-layer student and a random 2-layer teacher (another seed) on the character
             tokenizer; 3 steps in seconds on a CPU (tests, smoke runs).
  tiny_topk  tiny with verl's GKD-style top-k forward KL (`loss_mode=forward_kl_topk`, K = 8, supervised,
             `log_prob_min_clamp=-10`).
  smollm2    student SmolLM2-135M-Instruct, teacher the GRPO-trained SmolLM2 of `configs/grpo.py` exported with
             `python scripts/export_hf.py --checkpoint=runs/grpo --out=exported/grpo_smollm2` (or any model of
             the same tokenizer: `--config.distillation.teacher_models.teacher_model.model_path=...`); the GRPO
             default run's task, batch and steps, so the two runs compare step for step (docs/distillation.md).
"""

import os
import sys

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in sys.path:  # config files are loaded by path; make `configs.*` importable from anywhere
    sys.path.insert(0, _REPO)

from configs import base, grpo


def _opd(c):
    """verl's PG OPD recipe (examples/on_policy_distillation_trainer): k1, policy gradient, clamps, no task loss."""
    c.algorithm.adv_estimator = "grpo"  # task advantages (computed and logged; not trained on without task rewards)
    c.critic.enable = False
    c.actor.use_kl_loss = False  # no reference KL: the teacher is the anchor
    c.algorithm.use_kl_in_reward = False
    c.distillation.enabled = True
    d = c.distillation.distillation_loss
    d.loss_mode = "k1"
    d.use_policy_gradient = True
    d.use_task_rewards = False
    d.loss_max_clamp = 10.0
    d.clip_ratio_low = 0.2
    d.clip_ratio_high = 0.28
    return c


def _tiny(c):
    grpo.tiny(c)  # random tiny llama student, char tokenizer, toy reward, 2 mini-batches per step
    c.actor.use_kl_loss = False
    c.actor.entropy_coeff = 0.0
    c.trainer.experiment_name = "opd_tiny"
    c.trainer.default_local_dir = "runs/opd_tiny"
    c.trainer.total_training_steps = 3
    c.trainer.val_before_train = False
    c.trainer.val_at_end = False
    c.trainer.save_freq = -1
    t = c.distillation.teacher_models.teacher_model
    t.random_init = True
    t.tokenizer_path = "char"
    t.seed = 7
    for k, v in c.model.arch.items():
        t.arch[k] = v  # the student's shape, other weights
    t.log_prob_micro_batch_size = 8
    return _opd(c)


def _tiny_topk(c):
    """`tiny` with verl's GKD-style top-k forward KL (supervised) instead of PG OPD."""
    _tiny(c)
    d = c.distillation.distillation_loss
    d.loss_mode = "forward_kl_topk"
    d.use_policy_gradient = False
    d.topk = 8
    d.log_prob_min_clamp = -10.0
    return c


def _smollm2(c):
    grpo._default(c)  # the GRPO default run's task, prompts, batch, lr and steps
    c.trainer.experiment_name = "opd_smollm2_rg"
    c.trainer.default_local_dir = "runs/opd"
    c.distillation.teacher_models.teacher_model.model_path = os.path.join(_REPO, "exported", "grpo_smollm2")
    c.distillation.teacher_models.teacher_model.log_prob_micro_batch_size = 4
    return _opd(c)


def get_config(arg=None):
    c = base.get_base_config()
    c.algorithm.adv_estimator = "grpo"
    c.critic.enable = False
    variant = arg or "tiny"
    fns = {"tiny": _tiny, "tiny_topk": _tiny_topk, "smollm2": _smollm2}
    if variant not in fns:
        raise ValueError(f"configs/opd.py: unknown variant {variant!r}; valid: {sorted(fns)}")
    return fns[variant](c)
