"""What a job config turns on, read by the RL trainer and its config checks: `critic_enabled` and
`estimator_needs` (from the estimator registry; they live in `algos/config_checks.py`), `console_tags`,
`dynamic_bsz` (verl's `use_dynamic_bsz` and `*_max_token_len_per_gpu` with their fallbacks),
`rollout_device_count` (the split placement) and `router_replay_mode` (checked once the model is built). The config
checks themselves are sections beside their features, listed in `rl/config_check.py`'s table."""

from __future__ import annotations

from typing import Any

from jaxrl_post.algos.config_checks import critic_enabled, estimator_needs
from jaxrl_post.errors import ConfigError
from jaxrl_post.errors import config_value as _get

__all__ = [
    "console_tags",
    "critic_enabled",
    "dynamic_bsz",
    "estimator_needs",
    "rollout_device_count",
    "router_replay_mode",
]


def router_replay_mode(cfg: Any, model_config, on_policy: bool) -> str:
    """`actor.router_replay.mode` once the actor model is built. Raises ConfigError (one line) when replay is on
    and the model has no MoE layers, or for 'R2' on an exactly on-policy run (no old-log-prob forward whose
    routes the update could replay; the update's own forward is the old policy's)."""
    mode = cfg.actor.router_replay.mode
    if mode != "disabled" and not model_config.moe_layers:
        raise ConfigError(
            f"config.actor.router_replay.mode={mode!r}: the model has no MoE layers (num_experts="
            f"{model_config.num_experts}); routing replay is for mixture-of-experts models, set 'disabled'"
        )
    if mode == "R2" and on_policy:
        raise ConfigError(
            "config.actor.router_replay.mode='R2': this run is exactly on-policy (no old-log-prob forward to record "
            "routes from); use 'R3' or 'disabled'"
        )
    return mode


def console_tags(cfg: Any) -> set[str]:
    """The metric groups an RL run logs, for the console legend (`tracking.CONSOLE_LEGEND`): 'rl' plus 'critic',
    'kl_loss', 'kl_in_reward', 'opd' (on-policy distillation) and 'agent' (multi-turn) when they are on."""
    on = {
        "critic": critic_enabled(cfg),
        "kl_loss": bool(cfg.actor.use_kl_loss),
        "kl_in_reward": bool(cfg.algorithm.use_kl_in_reward),
        "opd": bool(cfg.distillation.enabled),
        "agent": bool(cfg.rollout.multi_turn.enable),
    }
    return {"rl", *(tag for tag, yes in on.items() if yes)}


# (use_dynamic_bsz key, its fallback, max_token_len key, its fallback) of each packed pass
_DYNAMIC_BSZ_KEYS = {
    "actor": ("actor.use_dynamic_bsz", None, "actor.ppo_max_token_len_per_gpu", None),
    "rollout": (
        "rollout.log_prob_use_dynamic_bsz",
        "actor.use_dynamic_bsz",
        "rollout.log_prob_max_token_len_per_gpu",
        "actor.ppo_max_token_len_per_gpu",
    ),
    "ref": (
        "ref.log_prob_use_dynamic_bsz",
        "actor.use_dynamic_bsz",
        "ref.log_prob_max_token_len_per_gpu",
        "actor.ppo_max_token_len_per_gpu",
    ),
    "critic": ("critic.use_dynamic_bsz", "actor.use_dynamic_bsz", "critic.ppo_max_token_len_per_gpu", None),
    "values": (
        "critic.use_dynamic_bsz",
        "actor.use_dynamic_bsz",
        "critic.forward_max_token_len_per_gpu",
        "critic.ppo_max_token_len_per_gpu",
    ),
}


def dynamic_bsz(cfg: Any, role: str) -> tuple[bool, int | None]:
    """(use_dynamic_bsz, max_token_len_per_gpu) of a pass ('actor', 'rollout' = old log-probs, 'ref',
    'critic' = critic update, 'values'), None keys resolved as verl's interpolations do."""
    dyn_key, dyn_fb, tok_key, tok_fb = _DYNAMIC_BSZ_KEYS[role]
    dyn = _get(cfg, dyn_key)
    dyn = _get(cfg, dyn_fb) if dyn is None else dyn
    tok = _get(cfg, tok_key)
    if tok is None and tok_fb is not None:
        tok = _get(cfg, tok_fb)
    return bool(dyn), tok


def rollout_device_count(cfg: Any, n_devices: int) -> int:
    """Devices the split placement gives the rollout: `rollout.n_gpus_per_node` when it is an int in
    (0, n_devices), else 0 (colocated, or a bad value that `async_training.config_checks.check_placement`
    reports)."""
    n = cfg.rollout.get("n_gpus_per_node", 0)
    ok = isinstance(n, int) and not isinstance(n, bool) and 0 < n < n_devices
    return n if ok else 0
