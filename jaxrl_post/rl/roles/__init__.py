"""The roles an `RLTrainer` composes (verl's workers): each an object with its model layout, optimizer and
jitted functions; the arrays they train live in the trainer's one `TrainState` (train_state.py).

- `policy.PolicyRole`: the actor (params layout and shardings, optimizer, jitted log-prob and update fns);
  `policy.ReferencePolicy`: the frozen initial policy (LoRA: the actor with its adapters off).
- `critic.CriticRole`: the value model of PPO.
- `teacher.TeacherRole`: the frozen on-policy distillation teacher.
- `rollout.RolloutRole`: the rollout's model (the actor's buffers or a copy in `rollout.dtype`) and its
  generator / agent loop; `dynamic_sampling.FilteredRollout` wraps any rollout with DAPO's group filter.
"""

from jaxrl_post.rl.roles.critic import CriticRole
from jaxrl_post.rl.roles.policy import PolicyRole, ReferencePolicy
from jaxrl_post.rl.roles.rollout import RolloutRole
from jaxrl_post.rl.roles.teacher import TeacherRole

__all__ = ["CriticRole", "PolicyRole", "ReferencePolicy", "RolloutRole", "TeacherRole"]
