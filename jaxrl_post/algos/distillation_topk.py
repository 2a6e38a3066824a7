"""Top-k forward-KL on-policy distillation (GKD-style): the student is fitted to the teacher's top-k distribution.

Pure ``jnp`` functions (jit-compatible; modes and K static) with verl's semantics and names
(``distillation.distillation_loss.loss_mode = forward_kl_topk | forward_kl_topk_tail``, ``topk``,
``log_prob_min_clamp``; verl ``compute_forward_kl_topk`` / ``compute_forward_kl_topk_tail``).

Per response position t, the teacher forward keeps its K most likely next tokens: ids ``i_t [K] int32`` and
log-probs ``q_t = log p_teacher(i_t) [K] float32`` (``teacher_topk``, temperature 1). In the actor update the
student's log-probs at the same ids are gathered, ``s_t = log p_student(i_t)`` (``gather_log_probs``; the
student's logits at the rollout temperature, as for its sampled-token log-probs). Then, after
``log_prob_min_clamp`` m (``q, s <- max(q, m), max(s, m)``; verl: avoids ``-inf - -inf`` and huge ratios):

* ``forward_kl_topk``: ``D_t = sum_k exp(q_t,k) (q_t,k - s_t,k)``, the forward KL(teacher || student)
  restricted to the teacher's top k (not a divergence of two distributions: it can be slightly negative);
* ``forward_kl_topk_tail``: the same over K + 1 buckets, the top k and one tail bucket holding the rest of the
  mass, ``log(1 - sum_k exp(x_k))`` for both models (verl's ``_add_tail_log_probs``: the log-sum-exp is capped
  at ``-1e-7`` so a saturated top k gives a finite tail). The tails are computed from the unclamped log-probs
  (the true remaining mass); the clamp then applies to all K + 1 entries. This is the exact KL of the two
  distributions coarse-grained to K + 1 outcomes, so it is >= 0 (up to the clamp).

``loss_max_clamp`` c clips ``D_t`` to ``[-c, c]`` (as the estimator modes); the result is aggregated with
``loss_agg_mode`` and differentiated directly (no policy-gradient form: the config refuses
``use_policy_gradient`` with these modes).

Source: verl ``verl/trainer/distillation/{losses,fsdp/losses}.py`` (``compute_forward_kl_topk``, the
tail-aware top-k KL of verl PR #7855), ``docs/algo/opd.md``; Agarwal et al. 2024 "On-policy distillation of
language models: learning from self-generated mistakes" (GKD, https://arxiv.org/abs/2306.13649).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_post.algos import core_algos

__all__ = [
    "add_tail",
    "compute_topk_distillation_losses",
    "distillation_loss_topk",
    "gather_log_probs",
    "teacher_topk",
]

_TAIL_LSE_MAX = -1e-7  # verl: log(1 - exp(lse)) stays finite when the top k hold (almost) all the mass


def teacher_topk(logits: jax.Array, k: int, temperature: float = 1.0) -> tuple[jax.Array, jax.Array]:
    """The K most likely tokens of each position: ``(log_probs [..., K] float32, ids [..., K] int32)``,
    log-probs of ``log_softmax(logits / temperature)`` in float32, sorted high to low (``jax.lax.top_k``).

    logits: ``[..., V]`` any float dtype; k: static, 1 <= k <= V (ValueError otherwise)."""
    v = logits.shape[-1]
    if not 1 <= k <= v:
        raise ValueError(f"top-k distillation: topk={k} must be in [1, vocab={v}]")
    lp = jax.nn.log_softmax(logits.astype(jnp.float32) / temperature, axis=-1)
    vals, ids = jax.lax.top_k(lp, k)
    return vals, ids.astype(jnp.int32)


def gather_log_probs(logits: jax.Array, ids: jax.Array, temperature: float = 1.0) -> jax.Array:
    """``log_softmax(logits / temperature)`` at ``ids``: ``[..., K] float32`` (differentiable w.r.t. logits).

    logits: ``[..., V]``; ids: ``[..., K]`` int, each in ``[0, V)``."""
    lp = jax.nn.log_softmax(logits.astype(jnp.float32) / temperature, axis=-1)
    return jnp.take_along_axis(lp, ids.astype(jnp.int32), axis=-1)


def add_tail(log_probs: jax.Array) -> jax.Array:
    """``[..., K] -> [..., K + 1]``: the top-k log-probs and the tail bucket ``log(1 - sum exp)`` (verl
    ``_add_tail_log_probs``, the log-sum-exp capped at -1e-7)."""
    lse = jnp.minimum(jax.nn.logsumexp(log_probs, axis=-1, keepdims=True), _TAIL_LSE_MAX)
    return jnp.concatenate([log_probs, jnp.log(-jnp.expm1(lse))], axis=-1)


def compute_topk_distillation_losses(
    student_topk_log_probs: jax.Array,
    teacher_topk_log_probs: jax.Array,
    loss_mode: str,
    log_prob_min_clamp: float | None = None,
) -> jax.Array:
    """Per-token losses ``D [B, R] float32`` (not masked, not clamped by ``loss_max_clamp``).

    Args:
      student_topk_log_probs: ``[B, R, K] float32`` the student's log-probs at the teacher's top-k ids.
      teacher_topk_log_probs: ``[B, R, K] float32`` the teacher's top-k log-probs.
      loss_mode: ``forward_kl_topk`` or ``forward_kl_topk_tail`` (static).
      log_prob_min_clamp: None or m (< 0): both log-prob arrays clamped from below at m.

    Raises:
      ValueError: another ``loss_mode``, or shapes that differ.

    Source: verl ``compute_forward_kl_topk`` (+ the tail bucket of ``forward_kl_topk_tail``).
    """
    s, q = jnp.asarray(student_topk_log_probs, jnp.float32), jnp.asarray(teacher_topk_log_probs, jnp.float32)
    if s.shape != q.shape:
        raise ValueError(f"top-k distillation: student {s.shape} and teacher {q.shape} top-k log-probs differ")
    if loss_mode == "forward_kl_topk_tail":
        s, q = add_tail(s), add_tail(q)
    elif loss_mode != "forward_kl_topk":
        raise ValueError(f"unknown top-k distillation loss_mode={loss_mode!r}; valid: forward_kl_topk(_tail)")
    if log_prob_min_clamp is not None:
        s, q = jnp.maximum(s, log_prob_min_clamp), jnp.maximum(q, log_prob_min_clamp)
    return jnp.sum(jnp.exp(q) * (q - s), axis=-1)


def distillation_loss_topk(
    c,
    student_topk_log_probs: jax.Array,
    teacher_topk_log_probs: jax.Array,
    response_mask: jax.Array,
    loss_agg_mode: str = "token-mean",
    **agg_kwargs,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The top-k distillation term ``distill_loss [] float32`` and its metrics (verl names).

    Args:
      c: ``distillation.DistillationLossConfig`` (``loss_mode`` a top-k mode, ``log_prob_min_clamp``,
        ``loss_max_clamp``).
      student_topk_log_probs, teacher_topk_log_probs: ``[B, R, K] float32`` (see
        ``compute_topk_distillation_losses``); the student's are differentiated.
      response_mask: ``[B, R]`` 0/1, the trained tokens (``loss_mask``).
      loss_agg_mode: static, see ``agg_loss``; ``agg_kwargs``: ``global_batch_info`` counts.

    Returns:
      ``(distill_loss, metrics)``; metrics (float32 scalars, masked means): ``loss``, ``abs_loss`` (mean
      ``|D|`` before the clamp), ``student_mass`` / ``teacher_mass`` (mean probability mass the student /
      teacher puts on the teacher's top k, before any clamp; verl).

    Source: verl ``compute_forward_kl_topk`` and ``distillation_loss``.
    """
    mask = jnp.asarray(response_mask)
    raw = compute_topk_distillation_losses(
        student_topk_log_probs, teacher_topk_log_probs, c.loss_mode, c.log_prob_min_clamp
    )
    sg = jax.lax.stop_gradient
    m = {
        "abs_loss": core_algos.masked_mean(jnp.abs(sg(raw)), mask),
        "student_mass": core_algos.masked_mean(jnp.sum(jnp.exp(sg(student_topk_log_probs)), -1), mask),
        "teacher_mass": core_algos.masked_mean(jnp.sum(jnp.exp(teacher_topk_log_probs), -1), mask),
    }
    d = raw if c.loss_max_clamp is None else jnp.clip(raw, -c.loss_max_clamp, c.loss_max_clamp)
    loss = core_algos.agg_loss(d, mask, loss_agg_mode, **agg_kwargs)
    m["loss"] = loss
    return loss, m
