"""Config checks of the RL math's keys: `algorithm.*` (advantage estimator, KL in reward and its controller,
rollout correction, gamma / lambda) and the actor's loss keys (`actor.policy_loss.*`, `actor.loss_agg_mode`,
`actor.kl_loss_*`, `actor.entropy_coeff`, `actor.clip_ratio*`), read against the registries of this package
(`registry.py`); and the two config queries they need, `estimator_needs` and `critic_enabled`. `check_algorithm`
is a section of `rl/config_check.py`'s table and reports through an `errors.Checker` (the one place in `algos/`
that reads a config)."""

from __future__ import annotations

import math
from typing import Any

from jaxrl_post.algos.loss_agg import LOSS_AGG_MODES
from jaxrl_post.algos.registry import ADV_ESTIMATOR_REGISTRY, POLICY_LOSS_REGISTRY, adv_estimator_needs
from jaxrl_post.algos.rollout_corr import parse_rollout_rs
from jaxrl_post.errors import Checker, is_num, nonneg

KL_TYPES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "full")
KL_CTRL_TYPES = ("fixed", "adaptive")


def estimator_needs(cfg: Any) -> tuple[str, ...]:
    """What `algorithm.adv_estimator` declared it consumes (`register_adv_est(needs=...)`); () if unknown
    (validate_config reports the unknown name)."""
    try:
        return adv_estimator_needs(cfg.algorithm.adv_estimator)
    except ValueError:
        return ()


def critic_enabled(cfg: Any) -> bool:
    """`critic.enable`, or (when None) whether `algorithm.adv_estimator` declares it needs `values`."""
    if cfg.critic.enable is None:
        return "values" in estimator_needs(cfg)
    return bool(cfg.critic.enable)


def critic_on(cfg: Any) -> bool:
    """`critic_enabled`, False when `critic.enable` cannot be read as one (the critic's section reports that)."""
    try:
        return critic_enabled(cfg)
    except Exception:  # reported once, as config.critic.enable, by rl/roles/config_checks.check_critic
        return False


def check_algorithm(c: Checker) -> None:
    """`algorithm.adv_estimator` registered (a critic when it consumes values, `rollout.n >= 2` when it compares a
    group), `actor.policy_loss.loss_mode` registered and its hyper-parameters numbers, `actor.loss_agg_mode`, the
    KL types and controller, coefficients, `algorithm.rollout_correction.*`, `gamma` / `lam` in [0, 1], and the PPO
    clip ratios."""
    cfg = c.cfg
    adv, needs = cfg.algorithm.adv_estimator, estimator_needs(cfg)
    if adv not in ADV_ESTIMATOR_REGISTRY.names():
        c.err("algorithm.adv_estimator", f"unknown advantage estimator; valid: {ADV_ESTIMATOR_REGISTRY.names()}")
    elif "values" in needs and not critic_on(cfg):
        c.err("critic.enable", f"algorithm.adv_estimator={adv!r} needs a critic (it consumes values)")
    elif "index" in needs and isinstance(cfg.rollout.n, (int, float)) and cfg.rollout.n < 2:  # None: check_rollout
        c.err("rollout.n", f"algorithm.adv_estimator={adv!r} compares responses within a group: needs rollout.n >= 2")
    loss_mode = cfg.actor.policy_loss.loss_mode
    if loss_mode not in POLICY_LOSS_REGISTRY.names():
        c.err("actor.policy_loss.loss_mode", f"unknown policy loss; valid: {POLICY_LOSS_REGISTRY.names()}")
    for key, value in cfg.actor.policy_loss.items():
        if key != "loss_mode" and not (is_num(value) and math.isfinite(value)):
            c.err(f"actor.policy_loss.{key}", "must be a finite number (a policy-loss hyper-parameter)")
    for key in ("clip_cov_ratio", "kl_cov_ratio"):
        c.check(f"actor.policy_loss.{key}", lambda v: is_num(v) and 0 < v <= 1, "must be in (0, 1]")
    for key in ("tau_pos", "tau_neg"):
        c.check(f"actor.policy_loss.{key}", lambda v: is_num(v) and v > 0, "must be > 0")
    c.check("actor.loss_agg_mode", lambda v: v in LOSS_AGG_MODES, f"valid: {list(LOSS_AGG_MODES)}")
    kl_types = [k for k in KL_TYPES if k != "full"]
    c.check("actor.kl_loss_type", lambda v: v in KL_TYPES and v != "full", f"valid: {kl_types}")
    c.check("algorithm.kl_penalty", lambda v: v in KL_TYPES and v != "full", f"valid: {kl_types}")
    c.check("algorithm.kl_ctrl.type", lambda v: v in KL_CTRL_TYPES, f"valid: {list(KL_CTRL_TYPES)}")
    if cfg.algorithm.use_kl_in_reward and cfg.algorithm.kl_ctrl.type == "adaptive":
        c.check("algorithm.kl_ctrl.target_kl", lambda v: is_num(v) and v > 0, "adaptive KL needs target_kl > 0")
        c.check("algorithm.kl_ctrl.horizon", lambda v: is_num(v) and v > 0, "adaptive KL needs horizon > 0")
    c.check("algorithm.kl_ctrl.kl_coef", nonneg, "must be >= 0")
    c.check("actor.kl_loss_coef", nonneg, "must be >= 0")
    c.check("actor.entropy_coeff", is_num, "must be a number")
    _check_rollout_correction(c)
    c.check("algorithm.gamma", lambda v: is_num(v) and 0 <= v <= 1, "must be in [0, 1]")
    c.check("algorithm.lam", lambda v: is_num(v) and 0 <= v <= 1, "must be in [0, 1]")
    # PPO clipping
    c.check("actor.clip_ratio", lambda v: is_num(v) and v > 0, "must be > 0")
    c.check("actor.clip_ratio_low", lambda v: v is None or (is_num(v) and v >= 0), "must be None or >= 0")
    c.check("actor.clip_ratio_high", lambda v: v is None or (is_num(v) and v >= 0), "must be None or >= 0")
    c.check("actor.clip_ratio_c", lambda v: is_num(v) and v > 1, "must be > 1 (dual-clip bound)")


def _check_rollout_correction(c: Checker) -> None:
    """verl's `algorithm.rollout_correction` (the math: `rollout_corr.py`)."""
    rc, rc_cfg = "algorithm.rollout_correction", c.cfg.algorithm.rollout_correction
    c.check(f"{rc}.rollout_is", lambda v: v in (None, "token", "sequence"), "valid: None, 'token' or 'sequence'")
    c.check(f"{rc}.rollout_is_threshold", lambda v: is_num(v) and v > 0, "must be > 0")
    c.check(f"{rc}.rollout_is_batch_normalize", lambda v: isinstance(v, bool), "must be a bool")
    if rc_cfg.rollout_rs is not None:
        try:
            parse_rollout_rs(rc_cfg.rollout_rs, rc_cfg.rollout_rs_threshold)
        except ValueError as e:
            c.err(f"{rc}.rollout_rs", f"{e} (rollout_rs_threshold={rc_cfg.rollout_rs_threshold!r})")
