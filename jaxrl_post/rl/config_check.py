"""Config validation, run before anything is built or compiled.

Unknown keys and wrongly typed overrides are rejected by ml_collections while parsing flags (see
`main.check_override_keys` for a friendlier message). Here: value ranges, registry names, and the batch
arithmetic verl asserts in its workers after normalising the sizes. In verl's units (`data.train_batch_size`
and `*.ppo_mini_batch_size` count prompts, micro-batch sizes count responses, all global):

  data.train_batch_size                   % actor.ppo_mini_batch_size == 0   (whole mini-batches per step)
  actor.ppo_mini_batch_size * rollout.n   % actor.ppo_micro_batch_size == 0  (responses per mini-batch)
  actor.ppo_micro_batch_size              % (mesh data * fsdp) == 0          (same for critic.* and the
  log-prob / forward micro-batch sizes)

Every error names its key (`config.<path>`); all problems are reported at once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from jaxrl_post.algos.loss_agg import LOSS_AGG_MODES
from jaxrl_post.algos.registry import ADV_ESTIMATOR_REGISTRY, POLICY_LOSS_REGISTRY
from jaxrl_post.algos.rollout_corr import parse_rollout_rs
from jaxrl_post.errors import ConfigError
from jaxrl_post.models.attention import ATTENTION_IMPLS
from jaxrl_post.rl.config_features import (
    _DYNAMIC_BSZ_KEYS,
    _get,
    check_async,
    check_distillation,
    check_lora,
    check_multi_turn,
    check_placement,
    check_rollout_tp,
    check_router_replay,
    critic_enabled,
    dynamic_bsz,
    estimator_needs,
    rollout_device_count,
)
from jaxrl_post.rl.config_run import RESUME_MODES, check_data_rewards_and_run  # noqa: F401 (re-exported)
from jaxrl_post.runtime.distributed import config_errors

KL_TYPES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "full")
WARMUP_STYLES = ("constant", "cosine")
KL_CTRL_TYPES = ("fixed", "adaptive")


def dcn_factors(cfg: Any) -> tuple[int, int]:
    """`(trainer.mesh.dcn_data, trainer.mesh.dcn_fsdp)`; 1 when a config has no such key."""
    m = cfg.trainer.mesh
    get = m.get if hasattr(m, "get") else lambda k, d: getattr(m, k, d)
    return int(get("dcn_data", 1)), int(get("dcn_fsdp", 1))


def _mesh_sizes(cfg: Any) -> list[int]:
    """`trainer.mesh` (data, fsdp, expert, tensor) sizes as ints (expert 1 when a config has no such key)."""
    m = cfg.trainer.mesh
    expert = m.get("expert", 1) if hasattr(m, "get") else getattr(m, "expert", 1)
    return [int(m.data), int(m.fsdp), int(expert), int(m.tensor)]


def data_parallel_size(cfg: Any, n_devices: int) -> int:
    """Size of the mesh's batch axes ('data', 'fsdp', 'expert'), resolving one -1 against `n_devices` (per
    slice, times the `trainer.mesh.dcn_*` factors)."""
    dcn_data, dcn_fsdp = dcn_factors(cfg)
    n_devices = max(n_devices // (dcn_data * dcn_fsdp), 1)
    sizes = _mesh_sizes(cfg)
    if -1 in sizes:
        known = 1
        for s in sizes:
            if s != -1:
                known *= s
        sizes[sizes.index(-1)] = max(n_devices // max(known, 1), 1)
    return sizes[0] * dcn_data * sizes[1] * dcn_fsdp * sizes[2]


def validation_enabled(cfg: Any) -> bool:
    """Whether `fit()` ever validates: `trainer.val_before_train`, `trainer.val_at_end` or `trainer.test_freq > 0`."""
    t = cfg.trainer
    return bool(t.val_before_train) or bool(t.val_at_end) or int(t.test_freq) > 0


def kl_in_use(cfg: Any) -> bool:
    """Whether reference log-probs are needed (KL loss or KL in reward)."""
    return bool(cfg.actor.use_kl_loss) or bool(cfg.algorithm.use_kl_in_reward)


def validate_config(cfg: Any, n_devices: int | None = None) -> None:
    """Checks `cfg` (a ConfigDict from configs/*.py); raises ConfigError naming every bad key.

    Args:
      cfg: the job ConfigDict.
      n_devices: devices the mesh is built over (default `jax.device_count()`).
    """
    import jax  # at call time, as before: the device count is known only once jax is configured

    if n_devices is None:
        n_devices = jax.device_count()
    n_total = n_devices
    n_rollout = rollout_device_count(cfg, n_total)  # split placement: the mesh below is the training devices'
    n_devices -= n_rollout

    errors: list[str] = []

    def err(key: str, msg: str) -> None:
        try:
            val = _get(cfg, key)
            errors.append(f"config.{key}={val!r}: {msg}")
        except (AttributeError, KeyError):
            errors.append(f"config.{key}: {msg}")

    def check(key: str, pred: Callable[[Any], bool], msg: str) -> bool:
        try:
            val = _get(cfg, key)
        except (AttributeError, KeyError):
            errors.append(f"config.{key}: missing key")
            return False
        try:
            ok = pred(val)
        except Exception:  # wrong type for the predicate
            ok = False
        if not ok:
            err(key, msg)
        return ok

    is_int = lambda v: isinstance(v, int) and not isinstance(v, bool)
    is_num = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)
    pos_int = lambda v: is_int(v) and v > 0
    nonneg = lambda v: is_num(v) and v >= 0

    # ---- sizes
    for key in (
        "data.train_batch_size",
        "data.max_prompt_length",
        "data.max_response_length",
        "rollout.n",
        "actor.ppo_mini_batch_size",
        "actor.ppo_micro_batch_size",
        "actor.ppo_epochs",
        "rollout.log_prob_micro_batch_size",
        "ref.log_prob_micro_batch_size",
        "rollout.val_kwargs.n",
        "trainer.total_epochs",
    ):
        check(key, pos_int, "must be a positive int")
    check("trainer.total_training_steps", lambda v: v is None or pos_int(v), "must be None or a positive int")
    check("data.val_batch_size", lambda v: v is None or pos_int(v), "must be None or a positive int")
    check("data.max_val_samples", lambda v: v is None or pos_int(v), "must be None or a positive int")
    check("trainer.critic_warmup", lambda v: is_int(v) and v >= 0, "must be an int >= 0")
    check("trainer.print_every", pos_int, "must be a positive int")
    check("trainer.test_freq", lambda v: is_int(v) and (v == -1 or v > 0), "must be -1 (off) or > 0")
    check("trainer.save_freq", lambda v: is_int(v) and (v == -1 or v > 0), "must be -1 (off) or > 0")
    check("trainer.max_actor_ckpt_to_keep", lambda v: v is None or pos_int(v), "must be None or a positive int")
    check("trainer.max_consecutive_nonfinite", lambda v: is_int(v) and v >= 0, "must be an int >= 0 (0 = never stop)")
    check("trainer.async_save", lambda v: isinstance(v, bool), "must be a bool")
    for axis in ("data", "fsdp", "tensor") + (("expert",) if "expert" in cfg.trainer.mesh else ()):
        check(f"trainer.mesh.{axis}", lambda v: is_int(v) and (v == -1 or v > 0), "must be -1 or a positive int")

    for axis in ("dcn_data", "dcn_fsdp"):
        if axis in cfg.trainer.mesh:
            check(f"trainer.mesh.{axis}", pos_int, "must be a positive int (slices along the axis; 1 = one slice)")

    dp = None
    try:
        mesh_sizes = _mesh_sizes(cfg)
        n_slices = dcn_factors(cfg)[0] * dcn_factors(cfg)[1]
        per_slice = n_devices // n_slices
        dcn = "" if n_slices == 1 else f" x dcn_data*dcn_fsdp = {n_slices} slices"
        dcn += f" (training devices: {n_total} - rollout.n_gpus_per_node={n_rollout})" if n_rollout else ""
        if sum(s == -1 for s in mesh_sizes) > 1:
            err("trainer.mesh", "at most one of data/fsdp/expert/tensor may be -1")
        elif n_devices % n_slices:
            err("trainer.mesh", f"{n_devices} devices are not divisible by dcn_data*dcn_fsdp = {n_slices} slices")
        else:
            prod = 1
            for s in mesh_sizes:
                prod *= s if s != -1 else 1
            if -1 in mesh_sizes and per_slice % prod:
                err("trainer.mesh", f"{n_devices} devices{dcn} are not divisible by the fixed axes (product {prod})")
            elif -1 not in mesh_sizes and prod * n_slices != n_devices:
                err("trainer.mesh", f"data*fsdp*expert*tensor = {prod}{dcn} but {n_devices} devices are available")
            else:
                dp = data_parallel_size(cfg, n_devices)
    except (TypeError, ValueError, ZeroDivisionError):
        pass

    use_critic = False
    try:
        use_critic = critic_enabled(cfg)
    except Exception:
        err("critic.enable", "must be None, True or False")

    # ---- batch arithmetic (verl's worker checks; mini-batches in prompts, micro-batches in responses)
    try:
        n_prompts, group = int(cfg.data.train_batch_size), int(cfg.rollout.n)
        n_resp = n_prompts * group
        roles = [("actor", True), ("critic", use_critic)]
        for role, on in roles:
            if not on:
                continue
            if role == "critic":
                for key in (
                    "critic.ppo_mini_batch_size",
                    "critic.ppo_micro_batch_size",
                    "critic.ppo_epochs",
                    "critic.forward_micro_batch_size",
                ):
                    check(key, pos_int, "must be a positive int")
            mini = int(_get(cfg, f"{role}.ppo_mini_batch_size"))  # prompts
            micro = int(_get(cfg, f"{role}.ppo_micro_batch_size"))  # responses
            if mini > 0 and n_prompts % mini:
                err(
                    f"{role}.ppo_mini_batch_size",
                    f"data.train_batch_size = {n_prompts} prompts per step is not divisible by "
                    f"{role}.ppo_mini_batch_size = {mini} prompts (as in verl, both count prompts; a mini-batch "
                    f"holds ppo_mini_batch_size * rollout.n responses)",
                )
            if micro > 0 and mini > 0 and (mini * group) % micro:
                err(
                    f"{role}.ppo_micro_batch_size",
                    f"{role}.ppo_mini_batch_size * rollout.n = {mini} * {group} = {mini * group} responses per "
                    f"mini-batch is not divisible by {role}.ppo_micro_batch_size = {micro} responses",
                )
            if dp and micro % dp:
                err(
                    f"{role}.ppo_micro_batch_size",
                    f"{micro} responses (global) are not divisible by the mesh data-parallel size "
                    f"(trainer.mesh data*fsdp = {dp})",
                )
        fwd_keys = ["rollout.log_prob_micro_batch_size", "ref.log_prob_micro_batch_size"]
        if use_critic:
            fwd_keys.append("critic.forward_micro_batch_size")
        if cfg.distillation.enabled is True:
            fwd_keys.append("distillation.teacher_models.teacher_model.log_prob_micro_batch_size")
        for key in fwd_keys:
            v = int(_get(cfg, key))
            if dp and v % dp:
                err(key, f"not divisible by the mesh data-parallel size (trainer.mesh data*fsdp = {dp})")
        if dp and n_resp % dp:
            err(
                "data.train_batch_size",
                f"train_batch_size * rollout.n = {n_resp} is not divisible by the mesh data-parallel size {dp}",
            )
    except (TypeError, ValueError):
        pass  # type errors reported above

    # ---- packing / dynamic batch size (verl: use_remove_padding, use_dynamic_bsz, *_max_token_len_per_gpu)
    check("model.use_remove_padding", lambda v: isinstance(v, bool), "must be a bool")
    check("model.seqs_per_packed_row", pos_int, "must be a positive int")
    check("model.pack_shared_prompts", lambda v: isinstance(v, bool), "must be a bool")

    check("model.attention_impl", lambda v: v in ATTENTION_IMPLS, f"valid: {', '.join(map(repr, ATTENTION_IMPLS))}")
    row_len = None
    try:
        row_len = int(cfg.data.max_prompt_length) + int(cfg.data.max_response_length)
    except (TypeError, ValueError):
        pass
    for role in ("actor", "rollout", "ref") + (("critic", "values") if use_critic else ()):
        dyn_key, _, tok_key, _ = _DYNAMIC_BSZ_KEYS[role]
        try:
            dyn, tok = dynamic_bsz(cfg, role)
        except (AttributeError, KeyError):
            continue
        if not dyn:
            continue
        if not cfg.model.use_remove_padding:
            err(dyn_key, "dynamic batch size packs sequences: needs model.use_remove_padding=True")
        elif row_len is not None and not (is_int(tok) and tok >= row_len):
            err(
                tok_key,
                f"{tok!r} tokens per device must be an int >= data.max_prompt_length + data.max_response_length "
                f"= {row_len} (one whole sequence)",
            )

    # ---- registries (what each estimator / loss declared in jaxrl_post.algos.registry)
    adv, needs = cfg.algorithm.adv_estimator, estimator_needs(cfg)
    if adv not in ADV_ESTIMATOR_REGISTRY.names():
        err("algorithm.adv_estimator", f"unknown advantage estimator; valid: {ADV_ESTIMATOR_REGISTRY.names()}")
    elif "values" in needs and not use_critic:
        err("critic.enable", f"algorithm.adv_estimator={adv!r} needs a critic (it consumes values)")
    elif "index" in needs and cfg.rollout.n < 2:
        err("rollout.n", f"algorithm.adv_estimator={adv!r} compares responses within a group: needs rollout.n >= 2")
    loss_mode = cfg.actor.policy_loss.loss_mode
    if loss_mode not in POLICY_LOSS_REGISTRY.names():
        err("actor.policy_loss.loss_mode", f"unknown policy loss; valid: {POLICY_LOSS_REGISTRY.names()}")
    for key, value in cfg.actor.policy_loss.items():
        if key != "loss_mode" and not is_num(value):
            err(f"actor.policy_loss.{key}", "must be a number (a policy-loss hyper-parameter)")
    for key in ("clip_cov_ratio", "kl_cov_ratio"):
        check(f"actor.policy_loss.{key}", lambda v: is_num(v) and 0 < v <= 1, "must be in (0, 1]")
    for key in ("tau_pos", "tau_neg"):
        check(f"actor.policy_loss.{key}", lambda v: is_num(v) and v > 0, "must be > 0")
    check("actor.loss_agg_mode", lambda v: v in LOSS_AGG_MODES, f"valid: {list(LOSS_AGG_MODES)}")
    if use_critic:
        check("critic.loss_agg_mode", lambda v: v in LOSS_AGG_MODES, f"valid: {list(LOSS_AGG_MODES)}")
        check("critic.cliprange_value", lambda v: is_num(v) and v > 0, "must be > 0")
        check("critic.grad_clip", lambda v: is_num(v) and v > 0, "must be > 0")
    check(
        "actor.kl_loss_type", lambda v: v in KL_TYPES and v != "full", f"valid: {[k for k in KL_TYPES if k != 'full']}"
    )
    check(
        "algorithm.kl_penalty",
        lambda v: v in KL_TYPES and v != "full",
        f"valid: {[k for k in KL_TYPES if k != 'full']}",
    )
    check("algorithm.kl_ctrl.type", lambda v: v in KL_CTRL_TYPES, f"valid: {list(KL_CTRL_TYPES)}")
    if cfg.algorithm.use_kl_in_reward and cfg.algorithm.kl_ctrl.type == "adaptive":
        check("algorithm.kl_ctrl.target_kl", lambda v: is_num(v) and v > 0, "adaptive KL needs target_kl > 0")
        check("algorithm.kl_ctrl.horizon", lambda v: is_num(v) and v > 0, "adaptive KL needs horizon > 0")
    check("algorithm.kl_ctrl.kl_coef", nonneg, "must be >= 0")
    check("actor.kl_loss_coef", nonneg, "must be >= 0")
    check("actor.entropy_coeff", is_num, "must be a number")
    # ---- rollout correction (verl's algorithm.rollout_correction; math in jaxrl_post.algos.rollout_corr)
    rc, rc_cfg = "algorithm.rollout_correction", cfg.algorithm.rollout_correction
    rc_ok = check(f"{rc}.rollout_is", lambda v: v in (None, "token", "sequence"), "valid: None, 'token' or 'sequence'")
    rc_ok &= check(f"{rc}.rollout_is_threshold", lambda v: is_num(v) and v > 0, "must be > 0")
    rc_ok &= check(f"{rc}.rollout_is_batch_normalize", lambda v: isinstance(v, bool), "must be a bool")
    if rc_cfg.rollout_rs is not None:
        try:
            parse_rollout_rs(rc_cfg.rollout_rs, rc_cfg.rollout_rs_threshold)
        except ValueError as e:
            rc_ok = False
            err(f"{rc}.rollout_rs", f"{e} (rollout_rs_threshold={rc_cfg.rollout_rs_threshold!r})")
    check("algorithm.gamma", lambda v: is_num(v) and 0 <= v <= 1, "must be in [0, 1]")
    check("algorithm.lam", lambda v: is_num(v) and 0 <= v <= 1, "must be in [0, 1]")

    # ---- PPO clipping, optimisers
    check("actor.clip_ratio", lambda v: is_num(v) and v > 0, "must be > 0")
    check("actor.clip_ratio_low", lambda v: v is None or (is_num(v) and v >= 0), "must be None or >= 0")
    check("actor.clip_ratio_high", lambda v: v is None or (is_num(v) and v >= 0), "must be None or >= 0")
    check("actor.clip_ratio_c", lambda v: is_num(v) and v > 1, "must be > 1 (dual-clip bound)")
    check("actor.grad_clip", lambda v: is_num(v) and v > 0, "must be > 0")
    for role in ("actor",) + (("critic",) if use_critic else ()):
        p = f"{role}.optim"
        check(f"{p}.lr", nonneg, "must be >= 0")
        check(f"{p}.lr_warmup_steps", lambda v: is_int(v) and v >= -1, "must be an int >= -1")
        check(f"{p}.lr_warmup_steps_ratio", lambda v: is_num(v) and 0 <= v <= 1, "must be in [0, 1]")
        check(f"{p}.warmup_style", lambda v: v in WARMUP_STYLES, f"valid: {list(WARMUP_STYLES)}")
        check(f"{p}.min_lr_ratio", lambda v: is_num(v) and 0 <= v <= 1, "must be in [0, 1]")
        check(f"{p}.weight_decay", nonneg, "must be >= 0")
        check(
            f"{p}.betas",
            lambda v: len(v) == 2 and all(is_num(b) and 0 <= b < 1 for b in v),
            "must be two numbers in [0, 1)",
        )
        check(f"{p}.eps", lambda v: is_num(v) and v > 0, "must be > 0")

    # ---- rollout
    check("rollout.name", lambda v: v in ("dense", "paged"), "valid: 'dense', 'paged'")
    if cfg.rollout.name == "paged":
        for key in ("max_num_seqs", "max_num_batched_tokens", "block_size", "num_scheduler_steps"):
            check(f"rollout.{key}", lambda v: is_int(v) and v >= 1, "must be an integer >= 1")
        check("rollout.num_gpu_blocks_override", lambda v: v is None or (is_int(v) and v >= 2), "must be None or >= 2")
        check("rollout.max_model_len", lambda v: v is None or (is_int(v) and v >= 2), "must be None or >= 2")
        check("rollout.gpu_memory_utilization", lambda v: v is None or (is_num(v) and 0 < v <= 1), "must be in (0, 1]")
        if is_int(cfg.rollout.max_num_seqs) and is_int(cfg.rollout.n) and cfg.rollout.max_num_seqs < cfg.rollout.n:
            err("rollout.max_num_seqs", f"must be >= rollout.n={cfg.rollout.n} (a prompt's samples decode together)")
        if cfg.rollout.multi_turn.enable:
            err("rollout.name", "'paged' is single-turn for now; use 'dense' with rollout.multi_turn.enable")
        if (n_devices or 1) > 1 and not n_rollout and cfg.rollout.get("tensor_model_parallel_size") is None:
            err(
                "rollout.name",
                f"'paged' runs on one device unless rollout.tensor_model_parallel_size shards it, the run has "
                f"{n_devices}; set that key to {n_devices} or use 'dense'",
            )
    if cfg.rollout.do_sample:
        check("rollout.temperature", lambda v: is_num(v) and v > 0, "must be > 0 when rollout.do_sample")
    check("rollout.top_p", lambda v: is_num(v) and 0 < v <= 1, "must be in (0, 1]")
    check("rollout.top_k", lambda v: is_int(v) and (v == -1 or v > 0), "must be -1 (off) or > 0")
    check("rollout.min_p", lambda v: is_num(v) and 0 <= v < 1, "must be in [0, 1)")

    check_data_rewards_and_run(cfg, check, err, is_int, is_num)
    check_lora(cfg, check, err, is_int, is_num)
    check_multi_turn(cfg, check, err, is_int, is_num)
    check_async(cfg, check, err, is_int, is_num)
    check_placement(cfg, check, err, is_int, n_total, jax.process_count())
    check_rollout_tp(cfg, check, err, is_int, n_total)
    check_distillation(cfg, check, err, is_int, is_num)
    check_router_replay(cfg, check, err)

    errors += config_errors(cfg)  # trainer.distributed.*, the per-process prompt share
    if errors:
        raise ConfigError("invalid config:\n  " + "\n  ".join(errors))
