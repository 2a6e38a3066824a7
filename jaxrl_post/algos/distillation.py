"""On-policy distillation (OPD) losses: the student is trained toward a frozen teacher on its own samples.

Pure ``jnp`` functions (jit-compatible; names and flags static), with verl's semantics
(``verl/trainer/distillation/losses.py``: ``distillation_ppo_loss``, ``distillation_loss``,
``compute_distillation_loss_reverse_kl_estimator``) and config names (``distillation.distillation_loss.*``).

Per response token t, with ``s_t = log pi_student(y_t)`` (current policy, temperature as the rollout) and
``q_t = log nu_teacher(y_t)`` (``teacher_log_prob``):

* ``D_t = kl_penalty(s_t, q_t, loss_mode)``: a single-sample estimator of the reverse KL(student || teacher)
  on the sampled token -- ``k1`` = ``s - q``; ``k3`` (``low_var_kl``) = ``r - log r - 1`` with
  ``r = exp(q - s)`` (clamped to [-10, 10] as verl's ``kl_penalty``); also ``abs``, ``k2``/``mse``.
* ``loss_max_clamp`` c: ``D_t <- clip(D_t, -c, c)`` (verl #5041: k1 can be large either sign where the teacher
  gives a sampled token almost no mass).
* ``use_policy_gradient`` (PG OPD, Thinking Machines' on-policy distillation): ``D`` is a reward, the per-token
  advantage is ``A_t = -sg(D_t)`` (for k1: ``sg(q_t - s_t)``), and the loss is the clipped PPO loss
  (``vanilla``) with the distillation's own ``clip_ratio_low`` / ``clip_ratio_high`` against the rollout's
  old log-probs. Otherwise (GKD-style supervised OPD) ``D`` is aggregated with ``loss_agg_mode`` and
  differentiated directly (k1 has no gradient toward the teacher this way, so it is refused by the config).
* ``use_task_rewards``: the step's loss is ``policy_loss + distillation_loss_coef * distill_loss``; without,
  the task policy loss (with its entropy and KL terms) is dropped and the loss is ``distill_loss``.

Source: verl ``docs/algo/opd.md`` and ``verl/trainer/distillation/losses.py`` (PR #5041); Agarwal et al. 2024
"On-policy distillation of language models" (GKD, https://arxiv.org/abs/2306.13649); Lu & Thinking Machines
Lab 2025 "On-Policy Distillation".
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxrl_post.algos import core_algos
from jaxrl_post.algos.kl import KL_PENALTIES

__all__ = [
    "DISTILLATION_LOSS_MODES",
    "DistillationLossConfig",
    "compute_distillation_losses",
    "distillation_loss",
]

# verl's single-sample estimator modes (`DistillationLossSettings(use_estimator=True)`) and its top-k forward-KL
# modes (GKD-style, on the teacher's top-k ids: `distillation_topk.py`).
DISTILLATION_LOSS_MODES = tuple(KL_PENALTIES)
TOPK_LOSS_MODES = ("forward_kl_topk", "forward_kl_topk_tail")


@dataclasses.dataclass(frozen=True)
class DistillationLossConfig:
    """Static settings (hashable) of the distillation term; verl ``distillation.distillation_loss.*``."""

    loss_mode: str = "k3"
    use_task_rewards: bool = True
    distillation_loss_coef: float = 1.0
    loss_max_clamp: float | None = None
    use_policy_gradient: bool = False
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: float = 3.0  # verl's vanilla default (its distillation config has no key for it)
    topk: int = 32  # K of the top-k modes (verl `distillation_loss.topk`)
    log_prob_min_clamp: float | None = None  # top-k modes: log-probs clamped from below (verl)

    @property
    def is_topk(self) -> bool:
        """True for the top-k forward-KL modes (they read the teacher's top-k ids / log-probs)."""
        return self.loss_mode in TOPK_LOSS_MODES


def compute_distillation_losses(
    log_prob: jax.Array, teacher_log_prob: jax.Array, loss_mode: str, loss_max_clamp: float | None = None
) -> jax.Array:
    """Per-token distillation losses ``D [B, R] float32`` (not masked), clamped to ``[-c, c]`` when
    ``loss_max_clamp = c`` is set.

    Args:
      log_prob: ``[B, R] float32`` student log-probs of the sampled tokens.
      teacher_log_prob: ``[B, R] float32`` teacher log-probs of the same tokens.
      loss_mode: a ``DISTILLATION_LOSS_MODES`` name (static), see ``kl.kl_penalty``.
      loss_max_clamp: None or c > 0.

    Raises:
      ValueError: an unknown ``loss_mode`` (a top-k mode says to use ``distillation_topk``).

    Source: verl ``compute_distillation_loss_reverse_kl_estimator`` + the clamp in ``distillation_loss``.
    """
    if loss_mode in TOPK_LOSS_MODES:
        raise ValueError(
            f"distillation loss_mode={loss_mode!r} is a top-k mode: its per-token losses are "
            f"`distillation_topk.compute_topk_distillation_losses`; valid here: {list(DISTILLATION_LOSS_MODES)}"
        )
    if loss_mode not in DISTILLATION_LOSS_MODES:
        raise ValueError(f"unknown distillation loss_mode={loss_mode!r}; valid: {list(DISTILLATION_LOSS_MODES)}")
    d = core_algos.kl_penalty(log_prob, teacher_log_prob, loss_mode)
    if loss_max_clamp is not None:
        d = jnp.clip(d, -loss_max_clamp, loss_max_clamp)
    return d


def distillation_loss(
    c: DistillationLossConfig,
    log_prob: jax.Array,
    old_log_prob: jax.Array,
    teacher_log_prob: jax.Array,
    response_mask: jax.Array,
    loss_agg_mode: str = "token-mean",
    rollout_is_weights: jax.Array | None = None,
    **agg_kwargs,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The distillation term ``distill_loss [] float32`` and its metrics (verl ``distillation/*`` names).

    Args:
      c: the static settings.
      log_prob: ``[B, R] float32`` current student log-probs (differentiated).
      old_log_prob: ``[B, R] float32`` rollout-time student log-probs (constants; PPO ratio of the PG mode).
      teacher_log_prob: ``[B, R] float32``.
      response_mask: ``[B, R]`` 0/1, the trained tokens (``loss_mask``).
      loss_agg_mode: static, see ``agg_loss``; ``agg_kwargs``: ``global_batch_info`` counts.
      rollout_is_weights: optional ``[B, R]`` IS weights (PG mode, as verl).

    Returns:
      ``(distill_loss, metrics)``; metrics (float32 scalars): ``loss`` (= distill_loss), ``abs_loss``
      (masked mean of ``|D|`` before the clamp) and, in the PG mode, ``pg_loss``, ``pg_clipfrac``,
      ``pg_clipfrac_lower``, ``ppo_kl`` of the distillation PPO loss.

    Source: verl ``distillation_loss``.
    """
    mask = jnp.asarray(response_mask)
    raw = compute_distillation_losses(log_prob, teacher_log_prob, c.loss_mode, None)
    m = {"abs_loss": core_algos.masked_mean(jnp.abs(jax.lax.stop_gradient(raw)), mask)}
    d = raw if c.loss_max_clamp is None else jnp.clip(raw, -c.loss_max_clamp, c.loss_max_clamp)
    if c.use_policy_gradient:
        loss, pg_m = core_algos.compute_policy_loss(
            old_log_prob,
            log_prob,
            -jax.lax.stop_gradient(d),
            mask,
            loss_mode="vanilla",
            clip_ratio_low=c.clip_ratio_low,
            clip_ratio_high=c.clip_ratio_high,
            clip_ratio_c=c.clip_ratio_c,
            loss_agg_mode=loss_agg_mode,
            rollout_is_weights=rollout_is_weights,
            **agg_kwargs,
        )
        m.update(pg_loss=loss, **pg_m)
    else:
        loss = core_algos.agg_loss(d, mask, loss_agg_mode, **agg_kwargs)
    m["loss"] = loss
    return loss, m
