"""`StepGeometry`: the static sizes of one RL training step, read once from the config."""

from __future__ import annotations

import dataclasses

from jaxrl_post.rl.async_training.settings import async_mode


@dataclasses.dataclass(frozen=True)
class StepGeometry:
    """Sizes of one training step (verl counts prompts in `*_mini_batch_size`; these count responses).

    Fields:
      batch_size: responses per step, `data.train_batch_size * rollout.n`.
      response_length: `data.max_response_length` (R of every `[B, R]` response field).
      actor_mini: responses per actor mini-batch, `actor.ppo_mini_batch_size * rollout.n`.
      actor_updates_per_step: optimizer steps of the actor per training step (`ppo_epochs` x mini-batches).
      total_training_steps: the run's length (`trainer.total_training_steps`, else epochs x loader length).
      use_rollout_corr: rollout correction on (`algorithm.rollout_correction.rollout_is` / `rollout_rs`).
      on_policy: exactly on-policy (one epoch, one mini-batch, no KL in reward, no rollout correction): the
        old log-probs equal the current ones and their forward is skipped.
      peak_flops: the device's peak FLOP/s (MFU metric).
    """

    batch_size: int
    response_length: int
    actor_mini: int
    actor_updates_per_step: int
    total_training_steps: int
    use_rollout_corr: bool
    on_policy: bool
    peak_flops: float | None

    @classmethod
    def from_config(cls, cfg, n_train_batches: int, peak_flops: float | None) -> StepGeometry:
        """The geometry of `cfg`; `n_train_batches`: prompt batches per epoch of the training loader."""
        batch_size = int(cfg.data.train_batch_size) * int(cfg.rollout.n)
        a = cfg.actor
        actor_mini = int(a.ppo_mini_batch_size) * int(cfg.rollout.n)
        rc = cfg.algorithm.rollout_correction
        use_rollout_corr = rc.rollout_is is not None or rc.rollout_rs is not None  # needs old log-probs
        return cls(
            batch_size=batch_size,
            response_length=int(cfg.data.max_response_length),
            actor_mini=actor_mini,
            actor_updates_per_step=int(a.ppo_epochs) * (batch_size // actor_mini),
            total_training_steps=int(cfg.trainer.total_training_steps or cfg.trainer.total_epochs * n_train_batches),
            use_rollout_corr=use_rollout_corr,
            on_policy=(
                int(a.ppo_epochs) == 1
                and actor_mini == batch_size
                and not cfg.algorithm.use_kl_in_reward
                and not use_rollout_corr
                and async_mode(cfg) == "sync"  # asynchronous: the behaviour policy is an older one
            ),
            peak_flops=peak_flops,
        )
