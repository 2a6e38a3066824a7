"""KL estimators, the KL-in-reward penalty and the KL coefficient controllers.

Part of the core RL math; everything here is re-exported by :mod:`jaxrl_post.algos.core_algos`, which is the
import path other code should use. Pure ``jnp`` functions (jit-compatible; the estimator *name* is a
static argument) plus two small host-side controller objects.

Sources: J. Schulman, "Approximating KL divergence" (http://joschu.net/blog/kl-approx.html) for the k1/k2/k3
estimators; Ziegler et al. 2019 (https://arxiv.org/abs/1909.08593) for the adaptive controller; verl
``core_algos.kl_penalty`` / ``kl_penalty_forward``, ``ray_trainer.apply_kl_penalty``,
``FixedKLController``, ``AdaptiveKLController``, ``get_kl_controller`` for names and semantics.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

__all__ = [
    "KL_PENALTIES",
    "kl_penalty",
    "kl_full",
    "apply_kl_penalty",
    "FixedKLController",
    "AdaptiveKLController",
    "get_kl_controller",
]

# verl name -> canonical estimator. Each also accepts a trailing "+" (straight-through, see kl_penalty).
KL_PENALTIES = {
    "kl": "k1",
    "k1": "k1",
    "abs": "abs",
    "mse": "k2",
    "k2": "k2",
    "low_var_kl": "k3",
    "k3": "k3",
}


def _kl_forward(log_prob: jax.Array, ref_log_prob: jax.Array, kind: str) -> jax.Array:
    if kind == "k1":
        return log_prob - ref_log_prob
    if kind == "abs":
        return jnp.abs(log_prob - ref_log_prob)
    if kind == "k2":
        return 0.5 * jnp.square(log_prob - ref_log_prob)
    # k3 (low_var_kl): r - log r - 1 with r = pi_ref / pi, both clamps as verl.
    log_r = jnp.clip(ref_log_prob - log_prob, -20.0, 20.0)
    return jnp.clip(jnp.exp(log_r) - log_r - 1.0, -10.0, 10.0)


def kl_penalty(log_prob: jax.Array, ref_log_prob: jax.Array, kl_penalty: str = "kl") -> jax.Array:
    """Per-token KL(pi || pi_ref) estimate from sampled-token log-probs.

    Args:
      log_prob: ``[B, R] float32`` log pi(y_t) of the sampled tokens (current / old policy).
      ref_log_prob: ``[B, R] float32`` log pi_ref(y_t) of the same tokens.
      kl_penalty: estimator name (static under jit), with d = log_prob - ref_log_prob:
        ``"kl"``/``"k1"``: d;  ``"abs"``: |d|;  ``"mse"``/``"k2"``: d^2 / 2;
        ``"low_var_kl"``/``"k3"``: clip(exp(-d') + d' - 1, -10, 10) with d' = clip(d, -20, 20)
        (i.e. r - log r - 1, r = pi_ref / pi).
        A trailing ``"+"`` (e.g. ``"k3+"``) is the straight-through variant: the *value* of the base estimator
        with the *gradient* of k2 (whose expected gradient is the true KL gradient):
        ``k2 - stop_gradient(k2) + stop_gradient(base)``. ``"k2+"``/``"mse+"`` equal k2.

    Returns:
      ``[B, R] float32`` (not masked; the caller masks).

    Raises:
      ValueError: ``"full"`` (needs the whole distribution: use :func:`kl_full`) or an unknown name.

    Source: verl ``core_algos.kl_penalty`` / ``kl_penalty_forward``; Schulman's KL-approximation note.
    """
    name = kl_penalty
    if name == "full":
        raise ValueError(
            "kl_penalty='full' needs the full vocabulary distributions; call kl_full(logits, ref_logits) instead."
        )
    straight_through = name.endswith("+")
    base = name[:-1] if straight_through else name
    if base not in KL_PENALTIES:
        valid = sorted(KL_PENALTIES) + sorted(k + "+" for k in KL_PENALTIES)
        raise ValueError(f"Unknown kl_penalty {name!r}; valid names: {valid} (and 'full' via kl_full).")
    kind = KL_PENALTIES[base]
    log_prob = jnp.asarray(log_prob, jnp.float32)
    ref_log_prob = jnp.asarray(ref_log_prob, jnp.float32)
    forward = _kl_forward(log_prob, ref_log_prob, kind)
    if not straight_through or kind == "k2":
        return forward
    backward = 0.5 * jnp.square(log_prob - ref_log_prob)
    return backward - jax.lax.stop_gradient(backward) + jax.lax.stop_gradient(forward)


_kl_estimate = kl_penalty  # alias for functions whose argument is also called `kl_penalty` (verl's name)


def kl_full(logits: jax.Array, ref_logits: jax.Array, temperature: float | jax.Array = 1.0) -> jax.Array:
    """Exact per-position KL(pi || pi_ref) over the vocabulary.

    ``KL_t = sum_v p_v (log p_v - log q_v)`` with ``p = softmax(logits / T)``, ``q = softmax(ref_logits / T)``.

    Args:
      logits: ``[B, T, V]`` (any float dtype; math in float32) policy logits.
      ref_logits: ``[B, T, V]`` reference logits.
      temperature: divides both logits (scalar; may be traced).

    Returns:
      ``[B, T] float32``, >= 0 up to rounding. Holds two ``[B, T, V]`` float32 log-softmax buffers (one per
      model), which is inherent to the exact KL.

    Source: verl's ``kl_penalty == "full"`` branch (not implemented there); definition of KL.
    """
    logp = jax.nn.log_softmax(jnp.asarray(logits, jnp.float32) / temperature, axis=-1)
    logq = jax.nn.log_softmax(jnp.asarray(ref_logits, jnp.float32) / temperature, axis=-1)
    return jnp.sum(jnp.exp(logp) * (logp - logq), axis=-1)


def apply_kl_penalty(
    token_level_scores: jax.Array,
    old_log_prob: jax.Array,
    ref_log_prob: jax.Array,
    response_mask: jax.Array,
    kl_coef: float | jax.Array,
    kl_penalty: str = "kl",
) -> tuple[jax.Array, jax.Array]:
    """Subtract the KL penalty from the token-level scores (KL in reward, PPO-RLHF style).

    ``rewards_t = m_t * (scores_t - kl_coef * KL_t)`` with ``KL_t = kl_penalty(old_log_prob, ref_log_prob)``.
    Masked / padding positions (``m_t == 0``) are exactly 0, whatever values they hold, so they contribute
    nothing to any return computed from the rewards.

    Args:
      token_level_scores: ``[B, R] float32`` verifier/RM scores (usually on the last response token).
      old_log_prob: ``[B, R] float32`` rollout-policy log-probs of the response tokens.
      ref_log_prob: ``[B, R] float32`` reference-policy log-probs.
      response_mask: ``[B, R]`` 0/1 (any dtype).
      kl_coef: beta (scalar; pass it traced so an adaptive controller does not retrigger compilation).
      kl_penalty: estimator name (static), see :func:`kl_penalty`.

    Returns:
      ``(token_level_rewards [B, R] float32, current_kl [] float32)``; ``current_kl`` is verl's metric: the
      per-sequence masked-mean KL averaged over the batch (feed it to ``kl_ctrl.update``).

    Source: verl ``ray_trainer.apply_kl_penalty`` (+ ``core_algos.kl_penalty``).
    """
    valid = jnp.asarray(response_mask) > 0
    m = valid.astype(jnp.float32)
    kld = jnp.where(valid, _kl_estimate(old_log_prob, ref_log_prob, kl_penalty), 0.0)
    scores = jnp.asarray(token_level_scores, jnp.float32)
    rewards = jnp.where(valid, scores - jnp.asarray(kl_coef, jnp.float32) * kld, 0.0)
    n_tok = jnp.sum(m, axis=-1)
    per_seq = jnp.sum(kld, axis=-1) / jnp.where(n_tok > 0, n_tok, 1.0)
    return rewards, jnp.mean(per_seq)


class FixedKLController:
    """Constant KL coefficient. ``.value`` is a Python float; ``update`` is a no-op.

    Source: verl ``core_algos.FixedKLController``.
    """

    def __init__(self, kl_coef: float):
        self.value = float(kl_coef)

    def update(self, current_kl: Any, n_steps: int) -> None:
        del current_kl, n_steps

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """Adaptive KL coefficient (Ziegler et al. 2019, https://arxiv.org/abs/1909.08593).

    ``update(current_kl, n_steps)``:
    ``e = clip(current_kl / target_kl - 1, -0.2, 0.2)``; ``value *= 1 + e * n_steps / horizon``.
    Host-side object (``current_kl`` may be a jax scalar; it is converted with ``float``).

    Source: verl ``core_algos.AdaptiveKLController``.
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: float):
        if horizon is None or horizon <= 0:
            raise ValueError(f"AdaptiveKLController needs horizon > 0, got {horizon!r}")
        if target_kl is None or target_kl <= 0:
            raise ValueError(f"AdaptiveKLController needs target_kl > 0, got {target_kl!r}")
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = float(horizon)

    def update(self, current_kl: Any, n_steps: int) -> None:
        proportional_error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + proportional_error * float(n_steps) / self.horizon

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = float(state["value"])
        self.target = float(state.get("target", self.target))
        self.horizon = float(state.get("horizon", self.horizon))


def get_kl_controller(
    kl_type: str, kl_coef: float, target_kl: float | None = None, horizon: float | None = None
) -> FixedKLController | AdaptiveKLController:
    """Build the KL controller named by ``algorithm.kl_ctrl.type`` (``"fixed"`` or ``"adaptive"``).

    Raises:
      ValueError: unknown ``kl_type``, or ``"adaptive"`` without ``target_kl > 0`` and ``horizon > 0``.

    Source: verl ``core_algos.get_kl_controller`` (takes the config fields as arguments here).
    """
    if kl_type == "fixed":
        return FixedKLController(kl_coef)
    if kl_type == "adaptive":
        return AdaptiveKLController(kl_coef, target_kl, horizon)
    raise ValueError(f"Unknown kl_ctrl type {kl_type!r}; valid types: ['adaptive', 'fixed']")
