"""Config validation of the RL trainer, run before anything is built or compiled.

Unknown keys and wrongly typed overrides are rejected by ml_collections while parsing flags (see
`main.check_override_keys` for a friendlier message). Here: value ranges, registry names, and the batch
arithmetic verl asserts in its workers after normalising the sizes. Each config section is checked by a function
beside the feature that reads it (Tunix's `GRPOConfig.__post_init__`, one per section), listed in `SECTIONS` in
the order they run; `validate_config` runs them all on one `errors.Checker` and raises one `ConfigError` naming
every bad key (`config.<path>`). The cross-section checks are the two sections here: the batch arithmetic
(`check_batch_sizes`) and the dynamic batch size (`check_dynamic_bsz`). In verl's units (`data.train_batch_size`
and `*.ppo_mini_batch_size` count prompts, micro-batch sizes count responses, all global):

  data.train_batch_size                   % actor.ppo_mini_batch_size == 0   (whole mini-batches per step)
  actor.ppo_mini_batch_size * rollout.n   % actor.ppo_micro_batch_size == 0  (responses per mini-batch)
  actor.ppo_micro_batch_size              % (mesh data * fsdp) == 0          (same for critic.* and the
  log-prob / forward micro-batch sizes)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from jaxrl_post.algos.config_checks import check_algorithm, critic_on
from jaxrl_post.data.config_checks import check_data
from jaxrl_post.engine.config_checks import check_packing
from jaxrl_post.engine.run.config_checks import check_trainer_run
from jaxrl_post.errors import Checker, DeviceCounts, config_value, is_int
from jaxrl_post.models.config_checks import check_lora, check_model
from jaxrl_post.rewards.config_checks import check_rewards
from jaxrl_post.rl import local_rows
from jaxrl_post.rl.async_training.config_checks import check_async, check_placement
from jaxrl_post.rl.config_features import _DYNAMIC_BSZ_KEYS, dynamic_bsz, rollout_device_count
from jaxrl_post.rl.dynamic_sampling import check_filter_groups
from jaxrl_post.rl.roles.config_checks import (
    check_actor,
    check_critic,
    check_distillation,
    check_reference,
    check_router_replay,
)
from jaxrl_post.rollout.config_checks import check_multi_turn, check_rollout, check_rollout_tp
from jaxrl_post.runtime.config_checks import check_distributed, check_mesh


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


def _mesh_dp(c: Checker) -> int | None:
    """Reports a `trainer.mesh` that does not fit the training devices (`c.devices.train`: all of them, or the
    rest of a split placement's); returns the mesh's data-parallel size when it fits, else None."""
    cfg, d = c.cfg, c.devices
    n_devices, n_total, n_rollout = d.train, d.total, d.rollout
    try:
        mesh_sizes = _mesh_sizes(cfg)
        n_slices = dcn_factors(cfg)[0] * dcn_factors(cfg)[1]
        per_slice = n_devices // n_slices
        dcn = "" if n_slices == 1 else f" x dcn_data*dcn_fsdp = {n_slices} slices"
        dcn += f" (training devices: {n_total} - rollout.n_gpus_per_node={n_rollout})" if n_rollout else ""
        if sum(s == -1 for s in mesh_sizes) > 1:
            c.err("trainer.mesh", "at most one of data/fsdp/expert/tensor may be -1")
        elif n_devices % n_slices:
            c.err("trainer.mesh", f"{n_devices} devices are not divisible by dcn_data*dcn_fsdp = {n_slices} slices")
        else:
            prod = 1
            for s in mesh_sizes:
                prod *= s if s != -1 else 1
            if -1 in mesh_sizes and per_slice % prod:
                c.err("trainer.mesh", f"{n_devices} devices{dcn} are not divisible by the fixed axes (product {prod})")
            elif -1 not in mesh_sizes and prod * n_slices != n_devices:
                c.err("trainer.mesh", f"data*fsdp*expert*tensor = {prod}{dcn} but {n_devices} devices are available")
            else:
                return data_parallel_size(cfg, n_devices)
    except (TypeError, ValueError, ZeroDivisionError):
        pass  # a mesh size of the wrong type: reported by runtime/config_checks.check_mesh
    return None


def check_batch_sizes(c: Checker) -> None:
    """The batch arithmetic across sections (verl's worker checks; mini-batches in prompts, micro-batches in
    responses): `trainer.mesh` fits the training devices, whole mini-batches per step, whole micro-batches per
    mini-batch, and micro-batches and forward micro-batch sizes divisible by the mesh's data-parallel size."""
    cfg = c.cfg
    dp = _mesh_dp(c)
    use_critic = critic_on(cfg)
    try:
        n_prompts, group = int(cfg.data.train_batch_size), int(cfg.rollout.n)
        n_resp = n_prompts * group
        for role, on in (("actor", True), ("critic", use_critic)):
            if not on:
                continue
            mini = int(config_value(cfg, f"{role}.ppo_mini_batch_size"))  # prompts
            micro = int(config_value(cfg, f"{role}.ppo_micro_batch_size"))  # responses
            if mini > 0 and n_prompts % mini:
                c.err(
                    f"{role}.ppo_mini_batch_size",
                    f"data.train_batch_size = {n_prompts} prompts per step is not divisible by "
                    f"{role}.ppo_mini_batch_size = {mini} prompts (as in verl, both count prompts; a mini-batch "
                    f"holds ppo_mini_batch_size * rollout.n responses)",
                )
            if micro > 0 and mini > 0 and (mini * group) % micro:
                c.err(
                    f"{role}.ppo_micro_batch_size",
                    f"{role}.ppo_mini_batch_size * rollout.n = {mini} * {group} = {mini * group} responses per "
                    f"mini-batch is not divisible by {role}.ppo_micro_batch_size = {micro} responses",
                )
            if dp and micro % dp:
                c.err(
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
            v = int(config_value(cfg, key))
            if dp and v % dp:
                c.err(key, f"not divisible by the mesh data-parallel size (trainer.mesh data*fsdp = {dp})")
        if dp and n_resp % dp:
            c.err(
                "data.train_batch_size",
                f"train_batch_size * rollout.n = {n_resp} is not divisible by the mesh data-parallel size {dp}",
            )
    except (TypeError, ValueError):
        pass  # a size of the wrong type: reported by its section


def check_dynamic_bsz(c: Checker) -> None:
    """verl's `*.use_dynamic_bsz` (token-budget micro-batches) of each packed pass: needs
    `model.use_remove_padding`, and a `*_max_token_len_per_gpu` of at least one whole sequence
    (`data.max_prompt_length + data.max_response_length`)."""
    cfg = c.cfg
    row_len = None
    try:
        row_len = int(cfg.data.max_prompt_length) + int(cfg.data.max_response_length)
    except (TypeError, ValueError):
        pass  # reported by data/config_checks.check_data
    for role in ("actor", "rollout", "ref") + (("critic", "values") if critic_on(cfg) else ()):
        dyn_key, _, tok_key, _ = _DYNAMIC_BSZ_KEYS[role]
        try:
            dyn, tok = dynamic_bsz(cfg, role)
        except (AttributeError, KeyError):
            continue
        if not dyn:
            continue
        if not cfg.model.use_remove_padding:
            c.err(dyn_key, "dynamic batch size packs sequences: needs model.use_remove_padding=True")
        elif row_len is not None and not (is_int(tok) and tok >= row_len):
            c.err(
                tok_key,
                f"{tok!r} tokens per device must be an int >= data.max_prompt_length + data.max_response_length "
                f"= {row_len} (one whole sequence)",
            )


# The config sections in the order they run (and their lines appear in the ConfigError): (name, check function).
SECTIONS: tuple[tuple[str, Callable[[Checker], None]], ...] = (
    ("data", check_data),  # data/config_checks.py
    ("rollout", check_rollout),  # rollout/config_checks.py
    ("actor", check_actor),  # rl/roles/config_checks.py
    ("ref", check_reference),  # rl/roles/config_checks.py
    ("trainer", check_trainer_run),  # engine/run/config_checks.py
    ("trainer.mesh", check_mesh),  # runtime/config_checks.py
    ("critic", check_critic),  # rl/roles/config_checks.py
    ("batch_sizes", check_batch_sizes),  # here: across sections
    ("packing", check_packing),  # engine/config_checks.py
    ("model", check_model),  # models/config_checks.py
    ("dynamic_bsz", check_dynamic_bsz),  # here: across sections
    ("algorithm", check_algorithm),  # algos/config_checks.py
    ("reward_model", check_rewards),  # rewards/config_checks.py
    ("algorithm.filter_groups", check_filter_groups),  # rl/dynamic_sampling.py
    ("lora", check_lora),  # models/config_checks.py
    ("rollout.multi_turn", check_multi_turn),  # rollout/config_checks.py
    ("async_training", check_async),  # rl/async_training/config_checks.py
    ("placement", check_placement),  # rl/async_training/config_checks.py
    ("rollout.tensor_model_parallel_size", check_rollout_tp),  # rollout/config_checks.py
    ("distillation", check_distillation),  # rl/roles/config_checks.py
    ("actor.router_replay", check_router_replay),  # rl/roles/config_checks.py
    ("trainer.distributed", check_distributed),  # runtime/config_checks.py
    ("trainer.distributed.process_local_rows", local_rows.check),  # rl/local_rows.py
)


def validate_config(cfg: Any, n_devices: int | None = None) -> None:
    """Checks `cfg` (a ConfigDict from configs/*.py) section by section (`SECTIONS`); raises ConfigError naming
    every bad key.

    Args:
      cfg: the job ConfigDict.
      n_devices: devices the mesh is built over (default `jax.device_count()`).

    Raises:
      ConfigError: `invalid config:` and one `config.<key>=<value>: <problem>` line per problem.
    """
    import jax  # at call time, as before: the device count is known only once jax is configured

    if n_devices is None:
        n_devices = jax.device_count()
    devices = DeviceCounts(n_devices, rollout_device_count(cfg, n_devices), jax.process_count())
    c = Checker(cfg, devices)
    for _, section in SECTIONS:
        section(c)
    c.raise_if_any()
