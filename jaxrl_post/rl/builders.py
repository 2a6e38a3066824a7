"""Config -> objects: the mesh, tokenizer, actor model (attention implementation, LoRA), optimizer and loss
configs, and the frozen reference's params. The prompt data is `data_rows.py`'s, the reward manager, judge,
reward-model scorer and agent loop `reward_builders.py`'s. With the trainer's own files these are the only
readers of the ConfigDict below `main.py`; everything they return takes typed arguments.
"""

from __future__ import annotations

import functools
import logging
import math
import os
from typing import Any

import jax
import jax.numpy as jnp

from jaxrl_post.algos.distillation import DistillationLossConfig
from jaxrl_post.algos.registry import policy_loss_spec
from jaxrl_post.engine import steps
from jaxrl_post.errors import ConfigError
from jaxrl_post.models import get_preset, init_model, load_pretrained, lora
from jaxrl_post.models import load_tokenizer as _load
from jaxrl_post.models.attention import resolve_attention_impl
from jaxrl_post.models.char_tokenizer import build_char_tokenizer
from jaxrl_post.models.config_checks import lora_enabled
from jaxrl_post.models.grouped_matmul import resolve_moe_impl
from jaxrl_post.models.moe import set_moe_impl
from jaxrl_post.models.tokenizer import eos_token_ids
from jaxrl_post.rl import ppo_update
from jaxrl_post.rl.async_training.placement import split_meshes
from jaxrl_post.runtime.platform_defaults import resolve
from jaxrl_post.runtime.sharding import make_mesh, relayout_mesh

log = logging.getLogger(__name__)


def build_mesh(cfg: Any, devices=None) -> jax.sharding.Mesh:
    """Mesh ('data', 'fsdp', 'expert', 'tensor') from `trainer.mesh.*` over `devices` (default: all devices;
    multi-slice when a `trainer.mesh.dcn_*` factor is > 1: `sharding.make_mesh`). Raises ConfigError when the
    devices do not fit."""

    m = cfg.trainer.mesh
    dcn = dict(dcn_data=int(m.get("dcn_data", 1)), dcn_fsdp=int(m.get("dcn_fsdp", 1)))
    n = jax.device_count() if devices is None else len(devices)
    try:
        return make_mesh(
            data=int(m.data),
            fsdp=int(m.fsdp),
            tensor=int(m.tensor),
            devices=devices,
            expert=int(m.get("expert", 1)),
            **dcn,
        )
    except ValueError as e:
        raise ConfigError(f"config.trainer.mesh: {e} ({n} {jax.devices()[0].platform} devices)") from e


def build_meshes(cfg: Any) -> tuple[jax.sharding.Mesh, jax.sharding.Mesh | None]:
    """`(train_mesh, rollout_mesh)`. Colocated (`rollout.n_gpus_per_node == 0`): `build_mesh(cfg)` and None (the
    rollout's own layout over the same devices is `colocated_rollout_mesh`'s). Split placement: the first
    `rollout.n_gpus_per_node` devices form the rollout mesh (all on 'fsdp': `async_training.placement.split_meshes`;
    with `rollout.tensor_model_parallel_size` = tp, 'tensor' = tp and the rest on 'data', as colocated), the rest the
    training mesh laid out by `trainer.mesh.*`. Raises ConfigError as `build_mesh` (validate_config reports the same
    first)."""
    n = int(cfg.rollout.n_gpus_per_node)
    if n == 0:
        return build_mesh(cfg), None
    rollout_mesh, _ = split_meshes(jax.devices(), n)
    if cfg.rollout.get("tensor_model_parallel_size") is not None:
        rollout_mesh = colocated_rollout_mesh(cfg, rollout_mesh)
    return build_mesh(cfg, jax.devices()[n:]), rollout_mesh


def colocated_rollout_mesh(cfg: Any, train_mesh: jax.sharding.Mesh) -> jax.sharding.Mesh | None:
    """The colocated rollout's own layout (`rollout.tensor_model_parallel_size` = tp): the training mesh's devices in
    their order as ('data', 'fsdp', 'expert', 'tensor') = (n / tp, 1, 1, tp) (`sharding.relayout_mesh`: weights split
    tp ways, n / tp data-parallel replicas, no FSDP gathers while decoding); None when the key is None (the rollout
    samples on the training mesh). Raises ConfigError when tp does not divide them."""
    tp = cfg.rollout.get("tensor_model_parallel_size")
    if tp is None:
        return None
    try:
        return relayout_mesh(train_mesh, int(tp))
    except ValueError as e:
        raise ConfigError(f"config.rollout.tensor_model_parallel_size={tp}: {e}") from None


def check_rollout_heads(cfg: Any, model_config) -> None:
    """Raises ConfigError when `rollout.tensor_model_parallel_size` does not divide the built model's query or KV
    heads (a loaded model's are known only now; `rollout.config_checks.check_rollout_tp` checks a
    preset's first)."""
    tp = cfg.rollout.get("tensor_model_parallel_size")
    for name in ("num_heads", "num_kv_heads"):
        if tp is not None and getattr(model_config, name) % int(tp):
            raise ConfigError(
                f"config.rollout.tensor_model_parallel_size={tp}: must divide the model's "
                f"{name}={getattr(model_config, name)} (heads are split over 'tensor')"
            )


def model_config_from(cfg: Any):
    """ModelConfig of a randomly initialised model: preset `model.preset` + non-None `model.arch` fields.

    Raises:
      ConfigError: the fields make no valid model (`ModelConfig`'s checks: e.g. `moe_capacity_factor` on a dense
        preset, `num_experts_per_tok` > `num_experts`), naming the preset.
    """

    overrides = {k: v for k, v in cfg.model.arch.items() if v is not None}
    dtype = resolve("model.dtype", cfg.model.dtype)
    try:
        return get_preset(cfg.model.preset).replace(dtype=dtype, param_dtype=cfg.model.param_dtype, **overrides)
    except (ValueError, NotImplementedError) as e:  # ModelConfig.__post_init__: a user's arch, not our bug
        raise ConfigError(f"config.model.arch on config.model.preset={cfg.model.preset!r}: {e}") from None


def load_tokenizer(path: str):
    """`models.load_tokenizer`, memoised per process (a GGUF tokenizer takes seconds to parse);
    `'char'` -> the in-memory character tokenizer of `char_tokenizer.py` (tiny test models)."""
    if path == "char":
        return build_char_tokenizer()
    return _load_tokenizer_cached(str(path))


@functools.lru_cache(maxsize=4)
def _load_tokenizer_cached(path: str):

    return _load(path)


def build_actor_and_tokenizer(cfg: Any, mesh: jax.sharding.Mesh | None):
    """(actor Transformer, tokenizer). Random init when `model.random_init`, else `load_pretrained`.

    Raises:
      ValueError: the tokenizer's vocabulary is larger than the model's (token ids would be out of range).
    """

    tok_path = cfg.model.tokenizer_path
    dtype = resolve("model.dtype", cfg.model.dtype)
    remat, scan = resolve("model.remat", cfg.model.remat), resolve("model.scan_layers", cfg.model.scan_layers)
    if cfg.model.random_init:
        tokenizer = load_tokenizer(tok_path or cfg.model.path)
        mcfg = model_config_from(cfg)
        model = init_model(
            mcfg,
            seed=int(cfg.trainer.seed),
            dtype=dtype,
            param_dtype=cfg.model.param_dtype,
            mesh=mesh,
            remat=remat,
        )
    else:
        model, tokenizer = load_pretrained(cfg.model.path, dtype=dtype, param_dtype=cfg.model.param_dtype, mesh=mesh)
        model.remat = remat
        if tok_path or tokenizer is None:
            tokenizer = load_tokenizer(tok_path or cfg.model.path)
    model.scan_layers = bool(scan)
    apply_attention_impl(cfg, model)
    apply_moe_impl(cfg, model)
    if len(tokenizer) > model.config.vocab_size:
        raise ValueError(
            f"config.model: tokenizer has {len(tokenizer)} tokens but the model vocabulary is {model.config.vocab_size}"
        )
    attach_lora(cfg, model)
    return model, tokenizer


def apply_attention_impl(cfg: Any, model, platform: str | None = None) -> str:
    """Resolve `model.attention_impl` for `platform` (default `jax.default_backend()`) and set it on `model`
    (`Transformer.set_attention_impl`; the critic, cloned from the actor, inherits it); logs the choice once,
    and under 'splash' that the shared-prompt packing layout is off (`roles._pack_spec`). Returns the backend.

    Raises ConfigError naming `model.attention_impl` (see `models.attention.resolve_attention_impl`)."""

    platform = platform or jax.default_backend()
    try:
        impl = resolve_attention_impl(
            cfg.model.attention_impl,
            platform,
            dtype=resolve("model.dtype", cfg.model.dtype),
            softcap=model.config.attn_logit_softcap,
            sinks=model.config.attention_sinks,
        )
    except ValueError as e:
        raise ConfigError(str(e)) from None
    model.set_attention_impl(impl)
    log.info(
        "attention: model.attention_impl=%r -> %r on %s (forwards without a KV cache; the rollout's cached decode "
        "stays dense)",
        cfg.model.attention_impl,
        impl,
        platform,
    )
    if impl == "splash" and cfg.model.use_remove_padding and cfg.model.pack_shared_prompts and int(cfg.rollout.n) > 1:
        log.info(
            "attention: model.pack_shared_prompts is off under splash attention: its segment ids say 'same "
            "sequence' only, not 'a response sees its chunk's prompt'; every sequence packs its own prompt"
        )
    return impl


def apply_moe_impl(cfg: Any, model, platform: str | None = None) -> str:
    """Resolve `model.moe_impl` for `platform` (default `jax.default_backend()`) and set it on `model`'s MoE layers
    (`moe.set_moe_impl`; the critic, cloned from the actor, inherits it); logged for an MoE model. Returns the
    implementation. Raises ConfigError naming `model.moe_impl` (`grouped_matmul.resolve_moe_impl`)."""

    platform = platform or jax.default_backend()
    try:
        impl = resolve_moe_impl(cfg.model.get("moe_impl", "auto"), platform)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    set_moe_impl(model, impl)
    if model.config.num_experts:
        log.info("moe: model.moe_impl=%r -> %r on %s", cfg.model.get("moe_impl", "auto"), impl, platform)
    return impl


def attach_lora(cfg: Any, model) -> None:
    """Attach the actor's LoRA adapters when LoRA is on (`models.config_checks.lora_enabled`): the PEFT adapter at
    `model.lora_adapter_path` (its r, alpha, targets), else fresh ones (`model.lora_rank`, `lora_alpha`,
    `target_modules`; A seeded by `trainer.seed`, B = 0). Raises what `models.lora.load_peft_adapter` raises."""

    if not lora_enabled(cfg):
        return
    m = cfg.model
    if m.lora_adapter_path:
        lora.load_peft_adapter(model, os.path.expanduser(m.lora_adapter_path), rank=int(m.lora_rank))
    else:
        cfg_lora = lora.LoRAConfig(int(m.lora_rank), float(m.lora_alpha), m.target_modules)
        lora.apply_lora(model, cfg_lora, seed=int(cfg.trainer.seed))


def eos_and_pad(tokenizer) -> tuple[tuple[int, ...], int]:
    """(EOS ids ending a response, pad id) of the tokenizer."""

    eos = tuple(eos_token_ids(tokenizer))
    pad = tokenizer.pad_token_id
    if pad is None:
        pad = eos[0] if eos else 0
    return eos, int(pad)


def optim_config(opt: Any, *, grad_clip: float, total_training_steps: int, updates_per_step: int) -> steps.OptimConfig:
    """verl `*.optim` -> OptimConfig. Warmup is counted in training steps (as verl's scheduler)."""
    warm = int(opt.lr_warmup_steps)
    if warm < 0:
        warm = math.floor(float(opt.lr_warmup_steps_ratio) * total_training_steps)
    return steps.OptimConfig(
        lr=float(opt.lr),
        total_steps=int(total_training_steps),
        warmup_steps=warm,
        warmup_style=opt.warmup_style,
        min_lr_ratio=float(opt.min_lr_ratio),
        weight_decay=float(opt.weight_decay),
        b1=float(opt.betas[0]),
        b2=float(opt.betas[1]),
        eps=float(opt.eps),
        grad_clip=float(grad_clip),
        updates_per_step=int(updates_per_step),
    )


def actor_loss_config(cfg: Any, on_policy: bool) -> ppo_update.ActorLossConfig:
    """`actor.*` -> ActorLossConfig. Logs one line when the policy loss fixes its own aggregation
    (`register_policy_loss(loss_agg_mode=...)`, e.g. GSPO) and `actor.loss_agg_mode` differs: the configured
    mode then only aggregates the entropy and KL losses."""

    a = cfg.actor
    low = a.clip_ratio if a.clip_ratio_low is None else a.clip_ratio_low
    high = a.clip_ratio if a.clip_ratio_high is None else a.clip_ratio_high
    fixed = policy_loss_spec(a.policy_loss.loss_mode).loss_agg_mode
    if fixed is not None and fixed != a.loss_agg_mode:
        log.warning(
            "actor.policy_loss.loss_mode=%s aggregates its loss %r (as verl), not actor.loss_agg_mode=%r "
            "(which still aggregates the entropy and KL losses)",
            a.policy_loss.loss_mode,
            fixed,
            a.loss_agg_mode,
        )
    params = tuple(sorted((k, float(v)) for k, v in a.policy_loss.items() if k != "loss_mode"))
    return ppo_update.ActorLossConfig(
        loss_mode=a.policy_loss.loss_mode,
        loss_agg_mode=a.loss_agg_mode,
        clip_ratio_low=float(low),
        clip_ratio_high=float(high),
        clip_ratio_c=float(a.clip_ratio_c),
        entropy_coeff=float(a.entropy_coeff),
        use_kl_loss=bool(a.use_kl_loss),
        kl_loss_coef=float(a.kl_loss_coef),
        kl_loss_type=a.kl_loss_type,
        temperature=float(cfg.rollout.temperature) if cfg.rollout.do_sample else 1.0,
        on_policy=on_policy,
        policy_loss_params=params,
        distillation=distillation_loss_config(cfg),
    )


def distillation_loss_config(cfg: Any):
    """`distillation.distillation_loss.*` -> `distillation.DistillationLossConfig`, or None when
    `distillation.enabled` is off."""

    if not cfg.distillation.enabled:
        return None
    d = cfg.distillation.distillation_loss
    low = d.clip_ratio if d.clip_ratio_low is None else d.clip_ratio_low
    high = d.clip_ratio if d.clip_ratio_high is None else d.clip_ratio_high
    return DistillationLossConfig(
        loss_mode=d.loss_mode,
        use_task_rewards=bool(d.use_task_rewards),
        distillation_loss_coef=float(d.distillation_loss_coef),
        loss_max_clamp=None if d.loss_max_clamp is None else float(d.loss_max_clamp),
        use_policy_gradient=bool(d.use_policy_gradient),
        clip_ratio_low=float(low),
        clip_ratio_high=float(high),
        topk=int(d.topk),
        log_prob_min_clamp=None if d.log_prob_min_clamp is None else float(d.log_prob_min_clamp),
    )


def copy_tree(tree):
    """Fresh device buffers for every leaf (so donating one tree never invalidates the other)."""
    return jax.tree.map(lambda x: jnp.array(x, copy=True), tree)


def reference_params(params, compute_dtype):
    """The frozen reference's params: fresh buffers with every float leaf of rank >= 2 (kernels, embedding,
    biases) cast to the compute dtype, the rank-1 norm scales kept in their dtype. The reference never trains,
    so it needs no float32 masters: under bf16 compute this halves its memory. Its forward equals the
    forward on the original params bitwise, because the decoder casts each of those leaves to the compute
    dtype before use and reads norm scales as stored (Gemma's `1 + w` in float32).

    params: a pytree of arrays (`steps.split_model`'s params); compute_dtype: the model's `dtype`."""
    dt = jnp.dtype(compute_dtype)

    def one(x):
        if x.ndim >= 2 and jnp.issubdtype(x.dtype, jnp.floating) and x.dtype != dt:
            return x.astype(dt)
        return jnp.array(x, copy=True)

    return jax.tree.map(one, params)
