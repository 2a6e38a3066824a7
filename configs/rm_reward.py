"""The reward of `configs/ppo.py:rm` (RLHF with a reward model as the only reward).

`rm_score_with_acc` returns the reward model's score as the reward and the task's rule score (verl's
`default_compute_score`, e.g. reasoning-gym's exact answer check) as `acc`, which is logged and never trained
on: `reward/extra/acc/mean` per step and `val-core/<data_source>/acc/mean@1` at validation show the policy's
true accuracy next to the RM score it optimizes (`critic/score/mean`), so reward hacking is visible.
"""

from jaxrl_post.rewards import default_compute_score
from jaxrl_post.rewards.manager import rm_score


def rm_score_with_acc(data_source, solution_str, ground_truth, extra_info=None):
    """{"score": the RM score (`extra_info['rm_score']`), "acc": the rule score, 0.0 or 1.0 for exact-answer
    tasks}. Raises KeyError when the row has no RM score (reward_model.enable is off)."""
    rule = default_compute_score(data_source, solution_str, ground_truth, extra_info)
    acc = rule.get("acc", rule["score"]) if isinstance(rule, dict) else rule
    return {"score": rm_score(data_source, solution_str, ground_truth, extra_info), "acc": float(acc)}
