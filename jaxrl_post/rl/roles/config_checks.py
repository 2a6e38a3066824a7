"""Config checks of the RL trainer's roles (verl's workers): the actor's update sizes and optimizer
(`actor.*`, `policy.py`), the reference's forward (`ref.*`), the critic (`critic.*`, `trainer.critic_warmup`,
`critic.py`), the on-policy distillation teacher and loss (`distillation.*`, `teacher.py`) and MoE routing
replay (`actor.router_replay.*`). Sections of `rl/config_check.py`'s table; they report through an
`errors.Checker`. The actor's loss keys are checked with the RL math (`algos/config_checks.py`)."""

from __future__ import annotations

from jaxrl_post.algos.config_checks import critic_enabled, critic_on
from jaxrl_post.algos.distillation import DISTILLATION_LOSS_MODES, TOPK_LOSS_MODES
from jaxrl_post.algos.loss_agg import LOSS_AGG_MODES
from jaxrl_post.engine.config_checks import check_optim
from jaxrl_post.errors import Checker, is_int, is_num, pos_int

ROUTER_REPLAY_MODES = ("disabled", "R2", "R3")  # verl's actor.router_replay.mode


def check_actor(c: Checker) -> None:
    """`actor.ppo_mini_batch_size` (prompts), `ppo_micro_batch_size` (responses), `ppo_epochs` positive ints;
    `actor.grad_clip` > 0; `actor.optim.*` (`engine/config_checks.check_optim`)."""
    for key in ("actor.ppo_mini_batch_size", "actor.ppo_micro_batch_size", "actor.ppo_epochs"):
        c.check(key, pos_int, "must be a positive int")
    c.check("actor.grad_clip", lambda v: is_num(v) and v > 0, "must be > 0")
    check_optim(c, "actor")


def check_reference(c: Checker) -> None:
    """`ref.log_prob_micro_batch_size` a positive int (responses per reference forward)."""
    c.check("ref.log_prob_micro_batch_size", pos_int, "must be a positive int")


def check_critic(c: Checker) -> None:
    """`critic.enable` (None, True or False), `trainer.critic_warmup` >= 0; with a critic (`critic_enabled`):
    its update and forward sizes, `loss_agg_mode`, `cliprange_value`, `grad_clip` and `critic.optim.*`."""
    try:
        critic_enabled(c.cfg)
    except Exception:  # any unusable critic.enable value: reported here, once
        c.err("critic.enable", "must be None, True or False")
    c.check("trainer.critic_warmup", lambda v: is_int(v) and v >= 0, "must be an int >= 0")
    if not critic_on(c.cfg):
        return
    for key in (
        "critic.ppo_mini_batch_size",
        "critic.ppo_micro_batch_size",
        "critic.ppo_epochs",
        "critic.forward_micro_batch_size",
    ):
        c.check(key, pos_int, "must be a positive int")
    c.check("critic.loss_agg_mode", lambda v: v in LOSS_AGG_MODES, f"valid: {list(LOSS_AGG_MODES)}")
    c.check("critic.cliprange_value", lambda v: is_num(v) and v > 0, "must be > 0")
    c.check("critic.grad_clip", lambda v: is_num(v) and v > 0, "must be > 0")
    check_optim(c, "critic")


def check_distillation(c: Checker) -> None:
    """`distillation.*` (on-policy distillation, verl's keys and checks): a teacher model_path (or a random
    teacher), a single-sample estimator loss_mode or a top-k mode (positive `topk`, `log_prob_min_clamp` None or
    < 0, supervised only), no `k1` without `use_policy_gradient` (verl refuses it: its gradient does not reach the
    teacher), only the 'vanilla' policy loss, non-negative clip ratios and coefficient, a positive
    `loss_max_clamp`, one teacher."""
    cfg = c.cfg
    if (
        not c.check("distillation.enabled", lambda v: isinstance(v, bool), "must be a bool")
        or not cfg.distillation.enabled
    ):
        return

    key = "distillation.teacher_models"
    extra = [k for k in cfg.distillation.teacher_models if k != "teacher_model"]
    if extra:
        c.err(key, f"only the single teacher `teacher_model` is supported (multi-teacher routing is not): got {extra}")
    t, tk = cfg.distillation.teacher_models.teacher_model, f"{key}.teacher_model"
    c.check(f"{tk}.random_init", lambda v: isinstance(v, bool), "must be a bool")
    if not t.random_init:
        c.check(f"{tk}.model_path", lambda v: isinstance(v, str) and v, "required: the teacher (dir, .gguf, alias)")
    elif t.model_path:
        c.err(f"{tk}.model_path", f"would be ignored: {tk}.random_init=True (a random teacher); set it to False")
    dtypes = ("float32", "bfloat16", "float16")
    dtype_msg = "valid: None (= model.dtype), float32, bfloat16, float16"
    c.check(f"{tk}.dtype", lambda v: v is None or v in dtypes, dtype_msg)
    c.check(f"{tk}.log_prob_micro_batch_size", lambda v: is_int(v) and v > 0, "must be a positive int")
    lk, dl = "distillation.distillation_loss", cfg.distillation.distillation_loss
    mode = dl.loss_mode
    if mode in TOPK_LOSS_MODES:
        c.check(f"{lk}.topk", lambda v: is_int(v) and v > 0, "must be a positive int")
        c.check(f"{lk}.log_prob_min_clamp", lambda v: v is None or (is_num(v) and v < 0), "must be None or < 0")
        if dl.use_policy_gradient is True:
            c.err(
                f"{lk}.use_policy_gradient",
                f"the top-k mode {mode!r} is a supervised (GKD-style) loss: set it False, or use k1 for PG OPD",
            )
    elif mode not in DISTILLATION_LOSS_MODES:
        c.err(f"{lk}.loss_mode", f"valid: {[*DISTILLATION_LOSS_MODES, *TOPK_LOSS_MODES]}")
    elif mode in ("k1", "kl") and dl.use_policy_gradient is False:
        c.err(
            f"{lk}.loss_mode",
            "k1 as a supervised loss has no gradient toward the teacher (as verl, refused): set "
            f"{lk}.use_policy_gradient=True or use k3",
        )
    for k in ("use_task_rewards", "use_policy_gradient"):
        c.check(f"{lk}.{k}", lambda v: isinstance(v, bool), "must be a bool")
    c.check(f"{lk}.policy_loss_mode", lambda v: v == "vanilla", "only 'vanilla' is supported (as verl)")
    c.check(f"{lk}.distillation_loss_coef", lambda v: is_num(v) and v >= 0, "must be >= 0")
    c.check(f"{lk}.loss_max_clamp", lambda v: v is None or (is_num(v) and v > 0), "must be None or > 0")
    c.check(f"{lk}.clip_ratio", lambda v: is_num(v) and v >= 0, "must be >= 0")
    for k in ("clip_ratio_low", "clip_ratio_high"):
        c.check(f"{lk}.{k}", lambda v: v is None or (is_num(v) and v >= 0), "must be None or >= 0")


def check_router_replay(c: Checker) -> None:
    """`actor.router_replay.mode` (verl's): 'disabled', 'R2' (the old-log-prob forward's routes replayed in the
    update) or 'R3' (the rollout's routes replayed in the old-log-prob and update forwards); R3 needs a
    single-turn rollout (`rollout.name` 'dense' or 'paged', no `rollout.multi_turn.enable`): both engines record
    the routes. That the model is an MoE is checked when it is built (`config_features.router_replay_mode`)."""
    if not c.check("actor.router_replay.mode", lambda v: v in ROUTER_REPLAY_MODES, f"valid: {ROUTER_REPLAY_MODES}"):
        return
    if c.cfg.actor.router_replay.mode == "R3" and c.cfg.rollout.multi_turn.enable:
        c.err(
            "actor.router_replay.mode",
            "'R3' is not supported with rollout.multi_turn.enable (the agent loop does "
            "not record the experts it routes to); use 'R2'",
        )
