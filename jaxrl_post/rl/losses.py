"""Per-micro-batch actor / critic losses shared by the padded (`steps.py`) and packed (`packed_steps.py`)
updates: both call these on `[b, R]` arrays with the mini-batch's `global_batch_info` counts, so the two
paths aggregate identically in every `loss_agg_mode`.

Source: verl `dp_actor.DataParallelPPOActor.update_policy`, `dp_critic.DataParallelPPOCritic.update_critic`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_post.algos import core_algos, distillation, distillation_topk
from jaxrl_post.models import moe as moe_lib


def actor_loss(c, log_prob, entropy, mb, counts):
    """(loss [] float32, metrics) of one micro-batch: policy loss [+ kl_loss_coef * KL] - entropy_coeff * H.

    c: `ppo_update.ActorLossConfig`; log_prob, entropy: `[b, R] float32` (current policy); mb: `loss_mask`
    (loss mask), `advantages`, `old_log_probs` (unless c.on_policy), `ref_log_prob` (use_kl_loss),
    `teacher_log_prob` (c.distillation; a top-k mode reads `student_topk_log_probs` and `teacher_topk_log_probs`
    `[b, R, K]` instead), optional `rollout_log_probs` and `rollout_is_weights`, all
    `[b, R]`; counts: `core_algos.global_batch_info` of the whole mini-batch.
    Mean-type metrics are pre-multiplied by this micro-batch's token share, so summing them over the
    micro-batches gives mini-batch means. With `c.distillation`, the distillation term is added as verl's
    `distillation_ppo_loss` (`_add_distillation`).
    """
    pg_kw = dict(
        loss_mode=c.loss_mode,
        clip_ratio_low=c.clip_ratio_low,
        clip_ratio_high=c.clip_ratio_high,
        clip_ratio_c=c.clip_ratio_c,
        loss_agg_mode=c.loss_agg_mode,
        policy_loss_params=dict(c.policy_loss_params),
    )
    mask = mb["loss_mask"]
    old = jax.lax.stop_gradient(log_prob) if c.on_policy else mb["old_log_probs"]
    pg_kw["rollout_is_weights"] = mb.get("rollout_is_weights")  # algorithm.rollout_correction.rollout_is
    pg_loss, pg_m = core_algos.compute_policy_loss(old, log_prob, mb["advantages"], mask, **pg_kw, **counts)
    ent_loss = core_algos.agg_loss(entropy, mask, c.loss_agg_mode, **counts)
    loss = pg_loss
    if c.entropy_coeff:
        loss = loss - c.entropy_coeff * ent_loss
    # token share of this micro-batch: turns micro-batch means into mini-batch means when summed
    w = jnp.sum((mask != 0).astype(jnp.float32)) / jnp.maximum(counts["global_batch_tokens"], 1.0)
    m = {
        "pg_loss": pg_loss,
        "entropy": jax.lax.stop_gradient(ent_loss),
        "pg_clipfrac": pg_m["pg_clipfrac"] * w,
        "pg_clipfrac_lower": pg_m["pg_clipfrac_lower"] * w,
        "ppo_kl": pg_m["ppo_kl"] * w,
    }
    if c.use_kl_loss:
        kld = core_algos.kl_penalty(log_prob, mb["ref_log_prob"], c.kl_loss_type)
        kl_loss = core_algos.agg_loss(kld, mask, c.loss_agg_mode, **counts)
        loss = loss + c.kl_loss_coef * kl_loss
        m["kl_loss"] = kl_loss
    if "rollout_log_probs" in mb:
        diff = jnp.abs(jnp.exp(jax.lax.stop_gradient(log_prob)) - jnp.exp(mb["rollout_log_probs"]))
        m["rollout_probs_diff_mean"] = core_algos.masked_mean(diff, mask) * w
    if c.distillation is not None:
        loss = _add_distillation(c, loss, log_prob, old, mb, counts, w, m)
    return loss, m


def add_moe_terms(cfg, loss, m, moe, mb, counts):
    """An MoE actor's micro-batch: `moe.router_metrics` as `moe/*` metrics (pre-multiplied by the token share,
    as the others) and, when `cfg.output_router_logits` (HF's switch), `cfg.router_aux_loss_coef` times the
    load-balancing loss (`moe.load_balancing_loss` of this micro-batch's tokens, prompts included, as HF) times
    the token share, so the summed loss holds the token-weighted mean aux loss. Returns (loss, metrics)."""
    w = jnp.sum((mb["loss_mask"] != 0).astype(jnp.float32)) / jnp.maximum(counts["global_batch_tokens"], 1.0)
    m = dict(m, **{k: jax.lax.stop_gradient(v) * w for k, v in moe_lib.router_metrics(moe, prefix="moe").items()})
    if cfg.output_router_logits:
        loss = loss + cfg.router_aux_loss_coef * moe_lib.load_balancing_loss(moe) * w
    return loss, m


def _add_distillation(c, loss, log_prob, old, mb, counts, w, m):
    """verl's `distillation_ppo_loss`: `loss + distillation_loss_coef * distill` with task rewards, else the
    distillation loss alone (the task policy loss, its entropy and KL terms dropped). Adds the
    `distillation/*` metrics (means pre-multiplied by the token share `w`, as the others)."""
    d = c.distillation
    if d.is_topk:  # GKD-style forward KL on the teacher's top-k ids (distillation_topk.py)
        distill, dm = distillation_topk.distillation_loss_topk(
            d, mb["student_topk_log_probs"], mb["teacher_topk_log_probs"], mb["loss_mask"], c.loss_agg_mode, **counts
        )
    else:
        distill, dm = distillation.distillation_loss(
            d,
            log_prob,
            old,
            mb["teacher_log_prob"],
            mb["loss_mask"],
            c.loss_agg_mode,
            rollout_is_weights=mb.get("rollout_is_weights"),
            **counts,
        )
    for k, v in dm.items():  # loss / pg_loss are aggregated with global counts: they sum over micro-batches
        m[f"distillation/{k}"] = v if k in ("loss", "pg_loss") else v * w
    return loss + d.distillation_loss_coef * distill if d.use_task_rewards else distill


def critic_loss(c, vpreds, mb, counts):
    """(vf_loss [] float32, metrics) of one micro-batch: clipped value loss (c: `ppo_update.CriticLossConfig`).

    vpreds: `[b, R] float32`; mb: `loss_mask`, `values` (rollout-time), `returns` `[b, R]`.
    """
    mask = mb["loss_mask"]
    vf_loss, clipfrac = core_algos.compute_value_loss(
        vpreds, mb["returns"], mb["values"], mask, c.cliprange_value, c.loss_agg_mode, **counts
    )
    w = jnp.sum((mask != 0).astype(jnp.float32)) / jnp.maximum(counts["global_batch_tokens"], 1.0)
    return vf_loss, {
        "vf_loss": vf_loss,
        "vf_clipfrac": clipfrac * w,
        "vpred_mean": core_algos.masked_mean(jax.lax.stop_gradient(vpreds), mask) * w,
    }
