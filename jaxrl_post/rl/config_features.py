"""Config checks of the optional features, called by `config_check.validate_config` with its `check` / `err`
helpers: DAPO (`algorithm.filter_groups.*`, `reward_model.overlong_buffer.*`), LoRA (`model.lora_*`),
multi-turn rollouts (`rollout.multi_turn.*`), on-policy distillation (`distillation.*`), reward-model
scoring (`reward_model.enable`, ...) and MoE routing replay (`actor.router_replay.*`; `router_replay_mode`); and what
a config turns on: `estimator_needs`, `critic_enabled`, `console_tags`, `dynamic_bsz` (verl's `use_dynamic_bsz` and
`*_max_token_len_per_gpu` with their fallbacks)."""

from __future__ import annotations

import os
from typing import Any

from jaxrl_post.algos.distillation import DISTILLATION_LOSS_MODES, TOPK_LOSS_MODES
from jaxrl_post.errors import ConfigError
from jaxrl_post.models.lora import parse_target_modules, read_adapter_config
from jaxrl_post.models.presets import get_preset
from jaxrl_post.rl.async_training.settings import MODES
from jaxrl_post.rollout.tool_parser import _PARSERS

ROUTER_REPLAY_MODES = ("disabled", "R2", "R3")  # verl's actor.router_replay.mode
# filter_groups metrics every reward function has (the rest are extra keys of a reward function's dict results)
FILTER_METRICS = ("acc", "score", "seq_reward", "seq_final_reward")


def check_dapo(cfg: Any, check, err, is_int, is_num) -> None:
    """`algorithm.filter_groups.*` and `reward_model.overlong_buffer.*` (DAPO)."""
    fg, ob = cfg.algorithm.filter_groups, cfg.reward_model.overlong_buffer
    check("algorithm.filter_groups.enable", lambda v: isinstance(v, bool), "must be a bool")
    check("algorithm.filter_groups.max_num_gen_batches", is_int, "must be an int (<= 0 = no limit)")
    check("reward_model.overlong_buffer.enable", lambda v: isinstance(v, bool), "must be a bool")
    check("reward_model.overlong_buffer.log", lambda v: isinstance(v, bool), "must be a bool")
    if fg.enable is True:
        if is_int(cfg.rollout.n) and cfg.rollout.n < 2:
            err("rollout.n", "algorithm.filter_groups compares the responses of a group: needs rollout.n >= 2")
        metric = fg.metric
        known = FILTER_METRICS + (("overlong_reward", "overlong") if ob.enable is True and ob.log is True else ())
        if not isinstance(metric, str) or not metric:
            err("algorithm.filter_groups.metric", f"must name a per-response value, e.g. one of {list(known)}")
        elif not cfg.custom_reward_function.path and metric not in known:
            # the built-in reward functions return plain scores: no other names exist
            err("algorithm.filter_groups.metric", f"unknown metric; valid with the built-in rewards: {list(known)}")
        elif metric == "seq_final_reward" and cfg.algorithm.use_kl_in_reward:
            err(
                "algorithm.filter_groups.metric",
                "seq_final_reward with algorithm.use_kl_in_reward is not supported (the KL penalty is computed after "
                "filtering); use seq_reward",
            )
    if ob.enable is True:
        lmax = cfg.data.max_response_length
        check(
            "reward_model.overlong_buffer.len",
            lambda v: is_int(v) and 0 < v <= lmax,
            f"must be an int in (0, data.max_response_length={lmax}] when reward_model.overlong_buffer.enable",
        )
        check("reward_model.overlong_buffer.penalty_factor", lambda v: is_num(v) and v >= 0, "must be >= 0")


def lora_enabled(cfg: Any) -> bool:
    """Whether the actor trains LoRA adapters: `model.lora_rank > 0` or a `model.lora_adapter_path` (as verl)."""
    return int(cfg.model.lora_rank or 0) > 0 or bool(cfg.model.lora_adapter_path)


def check_lora(cfg: Any, check, err, is_int, is_num) -> None:
    """model.lora_rank >= 0; with LoRA on: lora_alpha > 0, known target_modules, a readable PEFT adapter at
    lora_adapter_path whose r equals lora_rank (unless 0)."""
    if not check("model.lora_rank", lambda v: is_int(v) and v >= 0, "must be an int >= 0 (0 = LoRA off)"):
        return
    if not lora_enabled(cfg):
        return

    check("model.lora_alpha", lambda v: is_num(v) and v > 0, "must be > 0 (updates are scaled by alpha / rank)")
    path = cfg.model.lora_adapter_path
    if not path:
        try:
            parse_target_modules(cfg.model.target_modules)
        except ValueError as e:
            err("model.target_modules", str(e))
        return
    try:
        r = int(read_adapter_config(os.path.expanduser(path))["r"])
    except (OSError, ValueError, KeyError, NotImplementedError) as e:
        err("model.lora_adapter_path", f"{type(e).__name__}: {e}")
        return
    if cfg.model.lora_rank and int(cfg.model.lora_rank) != r:
        err("model.lora_rank", f"the adapter at model.lora_adapter_path has r={r}; set lora_rank={r} or 0")


MULTI_TURN_ENVS = ("tools", "guess_number")


def check_multi_turn(cfg: Any, check, err, is_int, is_num) -> None:
    """`rollout.multi_turn.*`: limits as verl's, known env / format / tools, and the features it cannot serve
    (sampling-mask replay: the agent loop records no sampling thresholds)."""
    mt = cfg.rollout.multi_turn
    if not check("rollout.multi_turn.enable", lambda v: isinstance(v, bool), "must be a bool") or not mt.enable:
        return
    opt_pos = lambda v: v is None or (is_int(v) and v > 0)
    check("rollout.multi_turn.env", lambda v: v in MULTI_TURN_ENVS, f"must be one of {list(MULTI_TURN_ENVS)}")
    check("rollout.multi_turn.max_assistant_turns", opt_pos, "must be None or a positive int")
    check("rollout.multi_turn.max_user_turns", opt_pos, "must be None or a positive int")
    check("rollout.multi_turn.max_parallel_calls", lambda v: is_int(v) and v > 0, "must be a positive int")
    check("rollout.multi_turn.max_tool_response_length", lambda v: is_int(v) and v > 0, "must be a positive int")
    check(
        "rollout.multi_turn.tool_response_truncate_side",
        lambda v: v in ("left", "middle", "right"),
        "must be left, middle or right",
    )

    check("rollout.multi_turn.format", lambda v: v in _PARSERS, f"must be one of {sorted(_PARSERS)}")
    check("rollout.multi_turn.tool_num_workers", lambda v: is_int(v) and v > 0, "must be a positive int")
    check("rollout.multi_turn.tool_timeout_s", lambda v: is_num(v) and v > 0, "must be > 0")
    check("rollout.multi_turn.tool_memory_mb", lambda v: is_int(v) and v >= 0, "must be an int >= 0 (0 = no cap)")
    check("rollout.multi_turn.tool_max_output_chars", lambda v: is_int(v) and v > 0, "must be a positive int")
    check("rollout.multi_turn.max_error_fraction", lambda v: is_num(v) and 0 <= v <= 1, "must be in [0, 1]")
    check("rollout.multi_turn.sandboxed_tools", lambda v: isinstance(v, str), "must be a string of tool names")
    check("rollout.multi_turn.tool_max_processes", lambda v: is_int(v) and v > 0, "must be a positive int")
    check("rollout.multi_turn.allow_unsandboxed_tools", lambda v: isinstance(v, bool), "must be a bool")
    if mt.env == "tools":
        check("rollout.multi_turn.tools", lambda v: isinstance(v, str) and v.strip(), "must name at least one tool")
    if cfg.rollout.sampling_mask_replay is True:
        err("rollout.sampling_mask_replay", "is not supported with rollout.multi_turn.enable (no sampling thresholds)")


def check_distillation(cfg: Any, check, err, is_int, is_num) -> None:
    """`distillation.*` (on-policy distillation, verl's keys and checks): a teacher model_path (or a random
    teacher), a single-sample estimator loss_mode or a top-k mode (positive `topk`, `log_prob_min_clamp` None or
    < 0, supervised only), no `k1` without
    `use_policy_gradient` (verl refuses it: its gradient does not reach the teacher), only the 'vanilla'
    policy loss, non-negative clip ratios and coefficient, a positive `loss_max_clamp`, one teacher."""
    if (
        not check("distillation.enabled", lambda v: isinstance(v, bool), "must be a bool")
        or not cfg.distillation.enabled
    ):
        return

    key = "distillation.teacher_models"
    extra = [k for k in cfg.distillation.teacher_models if k != "teacher_model"]
    if extra:
        err(key, f"only the single teacher `teacher_model` is supported (multi-teacher routing is not): got {extra}")
    t, tk = cfg.distillation.teacher_models.teacher_model, f"{key}.teacher_model"
    check(f"{tk}.random_init", lambda v: isinstance(v, bool), "must be a bool")
    if not t.random_init:
        check(f"{tk}.model_path", lambda v: isinstance(v, str) and v, "required: the teacher (dir, .gguf, alias)")
    elif t.model_path:
        err(f"{tk}.model_path", f"would be ignored: {tk}.random_init=True (a random teacher); set it to False")
    dtypes = ("float32", "bfloat16", "float16")
    check(f"{tk}.dtype", lambda v: v is None or v in dtypes, "valid: None (= model.dtype), float32, bfloat16, float16")
    check(f"{tk}.log_prob_micro_batch_size", lambda v: is_int(v) and v > 0, "must be a positive int")
    lk, dl = "distillation.distillation_loss", cfg.distillation.distillation_loss
    mode = dl.loss_mode
    if mode in TOPK_LOSS_MODES:
        check(f"{lk}.topk", lambda v: is_int(v) and v > 0, "must be a positive int")
        check(f"{lk}.log_prob_min_clamp", lambda v: v is None or (is_num(v) and v < 0), "must be None or < 0")
        if dl.use_policy_gradient is True:
            err(
                f"{lk}.use_policy_gradient",
                f"the top-k mode {mode!r} is a supervised (GKD-style) loss: set it False, or use k1 for PG OPD",
            )
    elif mode not in DISTILLATION_LOSS_MODES:
        err(f"{lk}.loss_mode", f"valid: {[*DISTILLATION_LOSS_MODES, *TOPK_LOSS_MODES]}")
    elif mode in ("k1", "kl") and dl.use_policy_gradient is False:
        err(
            f"{lk}.loss_mode",
            "k1 as a supervised loss has no gradient toward the teacher (as verl, refused): set "
            f"{lk}.use_policy_gradient=True or use k3",
        )
    for k in ("use_task_rewards", "use_policy_gradient"):
        check(f"{lk}.{k}", lambda v: isinstance(v, bool), "must be a bool")
    check(f"{lk}.policy_loss_mode", lambda v: v == "vanilla", "only 'vanilla' is supported (as verl)")
    check(f"{lk}.distillation_loss_coef", lambda v: is_num(v) and v >= 0, "must be >= 0")
    check(f"{lk}.loss_max_clamp", lambda v: v is None or (is_num(v) and v > 0), "must be None or > 0")
    check(f"{lk}.clip_ratio", lambda v: is_num(v) and v >= 0, "must be >= 0")
    for k in ("clip_ratio_low", "clip_ratio_high"):
        check(f"{lk}.{k}", lambda v: v is None or (is_num(v) and v >= 0), "must be None or >= 0")


def check_reward_model_scoring(cfg: Any, check, err, is_int, is_num) -> None:
    """`reward_model.enable` and its keys (reward-model scoring in the RL loop, `rewards/rm_scorer.py`)."""
    del is_num
    rm = cfg.reward_model
    check("reward_model.enable", lambda v: isinstance(v, bool), "must be a bool")
    if rm.enable is not True:
        return
    path = rm.model.path
    if not path:
        err("reward_model.model.path", "required with reward_model.enable: an HF *ForSequenceClassification dir")
    elif not os.path.isdir(os.path.expanduser(path)):
        err("reward_model.model.path", f"not a directory: {path}")
    check(
        "reward_model.model.dtype",
        lambda v: v is None or v in ("float32", "bfloat16", "float16"),
        "valid: None (= model.dtype), float32, bfloat16, float16",
    )
    check("reward_model.micro_batch_size_per_gpu", lambda v: is_int(v) and v >= 1, "must be an int >= 1")
    check("reward_model.max_length", lambda v: v is None or (is_int(v) and v >= 1), "must be None or an int >= 1")


def check_router_replay(cfg: Any, check, err) -> None:
    """`actor.router_replay.mode` (verl's): 'disabled', 'R2' (the old-log-prob forward's routes replayed in the
    update) or 'R3' (the rollout's routes replayed in the old-log-prob and update forwards); R3 needs a
    single-turn rollout (`rollout.name` 'dense' or 'paged', no `rollout.multi_turn.enable`): both engines record
    the routes. That the model is an MoE is checked when it is built (`router_replay_mode`)."""
    if not check("actor.router_replay.mode", lambda v: v in ROUTER_REPLAY_MODES, f"valid: {ROUTER_REPLAY_MODES}"):
        return
    if cfg.actor.router_replay.mode == "R3" and cfg.rollout.multi_turn.enable:
        err(
            "actor.router_replay.mode",
            "'R3' is not supported with rollout.multi_turn.enable (the agent loop does "
            "not record the experts it routes to); use 'R2'",
        )


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


def _get(cfg: Any, path: str) -> Any:
    node = cfg
    for part in path.split("."):
        node = node[part] if isinstance(node, dict) else getattr(node, part)
    return node


def estimator_needs(cfg: Any) -> tuple[str, ...]:
    """What `algorithm.adv_estimator` declared it consumes (`register_adv_est(needs=...)`); () if unknown
    (validate_config reports the unknown name)."""
    from jaxrl_post.algos.registry import adv_estimator_needs  # imports jax: not at module import

    try:
        return adv_estimator_needs(cfg.algorithm.adv_estimator)
    except ValueError:
        return ()


def critic_enabled(cfg: Any) -> bool:
    """`critic.enable`, or (when None) whether `algorithm.adv_estimator` declares it needs `values`."""
    if cfg.critic.enable is None:
        return "values" in estimator_needs(cfg)
    return bool(cfg.critic.enable)


def check_async(cfg: Any, check, err, is_int, is_num) -> None:
    """`async_training.*` (asynchronous training, docs/async.md; the placement keys: `check_placement`)."""

    if cfg.get("async_training") is None:
        return
    if not check("async_training.mode", lambda v: v in MODES, f"valid: {list(MODES)}"):
        return
    a = cfg.async_training
    check("async_training.partial_rollout_dispatches", lambda v: is_int(v) and v >= 1, "must be an int >= 1")
    if a.mode == "sync":
        return
    check("async_training.partial_rollout", lambda v: isinstance(v, bool), "must be a bool")
    check("async_training.background_producer", lambda v: isinstance(v, bool), "must be a bool")
    if a.mode == "fully_async":
        ok = check("async_training.staleness_threshold", lambda v: is_int(v) and v >= 0, "must be an int >= 0")
        ok &= check("async_training.trigger_parameter_sync_step", lambda v: is_int(v) and v >= 1, "must be an int >= 1")
        tb = cfg.data.train_batch_size
        check(
            "async_training.require_batches",
            lambda v: is_int(v) and v >= 1 and is_int(tb) and tb % v == 0,
            f"must be an int >= 1 dividing data.train_batch_size={tb}",
        )
        least = (int(a.trigger_parameter_sync_step) - 1 + int(a.partial_rollout is True)) if ok else 0
        if ok and a.staleness_threshold < least:
            err(
                "async_training.staleness_threshold",
                f"must be >= trigger_parameter_sync_step - 1 (+ 1 with partial_rollout) = {least}: the rollout's "
                "weights would be older than that when their groups train",
            )
        if a.partial_rollout is True and cfg.rollout.name != "paged":
            err("async_training.partial_rollout", "needs rollout.name='paged' (stop and resume at a dispatch)")
    if cfg.algorithm.filter_groups.enable is True:
        err("async_training.mode", "asynchronous training with algorithm.filter_groups is not built yet; use 'sync'")


def rollout_device_count(cfg: Any, n_devices: int) -> int:
    """Devices the split placement gives the rollout: `rollout.n_gpus_per_node` when it is an int in
    (0, n_devices), else 0 (colocated, or a bad value that `check_placement` reports)."""
    n = cfg.rollout.get("n_gpus_per_node", 0)
    ok = isinstance(n, int) and not isinstance(n, bool) and 0 < n < n_devices
    return n if ok else 0


def check_placement(cfg: Any, check, err, is_int, n_devices: int, n_processes: int) -> None:
    """`rollout.n_gpus_per_node`, `rollout.nnodes` (verl fully-async's names): the split placement, the first
    `n_gpus_per_node` devices a rollout mesh of their own, the rest the training mesh (docs/async.md). Whether
    `trainer.mesh` fits the training devices is checked with the mesh (`validate_config`)."""
    if not check("rollout.n_gpus_per_node", lambda v: is_int(v) and v >= 0, "must be an int >= 0 (0 = colocated)"):
        return
    nodes_ok = check("rollout.nnodes", lambda v: is_int(v) and v >= 1, "must be an int >= 1")
    n = cfg.rollout.n_gpus_per_node
    if n == 0:
        return
    if n >= n_devices:
        err("rollout.n_gpus_per_node", f"must be < the run's {n_devices} devices: the rest form the training mesh")
    if nodes_ok and cfg.rollout.nnodes != 1:
        err(
            "rollout.nnodes",
            "must be 1: the split placement divides one process's devices (rollout hosts of their "
            "own are not built yet)",
        )
    if n_processes > 1:
        err("rollout.n_gpus_per_node", f"the split placement runs in one process for now, the run has {n_processes}")
    if cfg.rollout.name == "paged" and n != 1 and cfg.rollout.get("tensor_model_parallel_size") is None:
        err(
            "rollout.name",
            f"'paged' runs on one device unless rollout.tensor_model_parallel_size shards it: with the split "
            f"placement it needs rollout.n_gpus_per_node=1, not {n}, or that key = {n}; or use 'dense'",
        )


def check_rollout_tp(cfg: Any, check, err, is_int, n_devices: int) -> None:
    """`rollout.tensor_model_parallel_size` (verl's name): None, or an int tp >= 1 dividing the rollout's devices
    (split: `rollout.n_gpus_per_node`) and a `model.random_init` preset's query / KV heads (a loaded model's:
    `builders.check_rollout_heads`); 'paged' needs a tensor-only rollout mesh (tp = its devices)."""
    key = "rollout.tensor_model_parallel_size"
    tp = cfg.rollout.get("tensor_model_parallel_size")
    if not check(key, lambda v: v is None or (is_int(v) and v >= 1), "must be None or an int >= 1") or tp is None:
        return
    n = rollout_device_count(cfg, n_devices) or n_devices
    where = f"the rollout's {n} devices" + (" (rollout.n_gpus_per_node)" if n != n_devices else "")
    if n % tp:
        err(key, f"must divide {where}")
    if cfg.model.random_init:
        try:
            mc = get_preset(cfg.model.preset).replace(**{k: v for k, v in cfg.model.arch.items() if v is not None})
        except (KeyError, TypeError) as e:  # an unknown preset or arch field: the model build reports it
            err(key, f"cannot check the model's heads: {e}")
            return
        for name in ("num_heads", "num_kv_heads"):
            if getattr(mc, name) % tp:
                err(key, f"must divide the model's {name}={getattr(mc, name)} (heads are split over 'tensor')")
    if cfg.rollout.name == "paged" and n != tp:
        replicas = "data-parallel engine replicas are not built yet"
        err(key, f"rollout.name='paged' shards one engine over 'tensor' only: needs {n} ({where}); {replicas}")
