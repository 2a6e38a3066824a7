"""Config -> objects: mesh, tokenizer, actor/critic models, data loaders, reward manager, optimizers.

The only place besides the trainer (`trainer.py` and its parts: roles/, placement.py, updates.py, run_dir.py,
validation_loop.py) and `main.py` that reads the ConfigDict; everything it returns takes
typed arguments.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import os
from typing import Any

import jax
import jax.numpy as jnp

from jaxrl_post.engine import steps
from jaxrl_post.errors import ConfigError
from jaxrl_post.rl import ppo_update
from jaxrl_post.rl.config_check import validation_enabled
from jaxrl_post.rl.preflight import (
    check_reasoning_gym_task,
    check_remote_reward,
    load_custom_reward,
    not_enough_prompts_message,
)
from jaxrl_post.runtime.platform_defaults import resolve

log = logging.getLogger(__name__)


def build_mesh(cfg: Any) -> jax.sharding.Mesh:
    """Mesh ('data', 'fsdp', 'tensor') from `trainer.mesh.*` over all devices (multi-slice when a
    `trainer.mesh.dcn_*` factor is > 1: `sharding.make_mesh`). Raises ConfigError when the devices do not fit."""
    from jaxrl_post.errors import ConfigError
    from jaxrl_post.runtime.sharding import make_mesh

    m = cfg.trainer.mesh
    dcn = dict(dcn_data=int(m.get("dcn_data", 1)), dcn_fsdp=int(m.get("dcn_fsdp", 1)))
    try:
        return make_mesh(data=int(m.data), fsdp=int(m.fsdp), tensor=int(m.tensor), **dcn)
    except ValueError as e:
        raise ConfigError(f"config.trainer.mesh: {e} ({jax.device_count()} {jax.devices()[0].platform} devices)") from e


def model_config_from(cfg: Any):
    """ModelConfig of a randomly initialised model: preset `model.preset` + non-None `model.arch` fields."""
    from jaxrl_post.models import get_preset

    overrides = {k: v for k, v in cfg.model.arch.items() if v is not None}
    dtype = resolve("model.dtype", cfg.model.dtype)
    return get_preset(cfg.model.preset).replace(dtype=dtype, param_dtype=cfg.model.param_dtype, **overrides)


def load_tokenizer(path: str):
    """`models.load_tokenizer`, memoised per process (a GGUF tokenizer takes seconds to parse);
    `'char'` -> the in-memory character tokenizer of `char_tokenizer.py` (tiny test models)."""
    if path == "char":
        from jaxrl_post.models.char_tokenizer import build_char_tokenizer

        return build_char_tokenizer()
    return _load_tokenizer_cached(str(path))


@functools.lru_cache(maxsize=4)
def _load_tokenizer_cached(path: str):
    from jaxrl_post.models import load_tokenizer as _load

    return _load(path)


def build_actor_and_tokenizer(cfg: Any, mesh: jax.sharding.Mesh | None):
    """(actor Transformer, tokenizer). Random init when `model.random_init`, else `load_pretrained`.

    Raises:
      ValueError: the tokenizer's vocabulary is larger than the model's (token ids would be out of range).
    """
    from jaxrl_post.models import init_model, load_pretrained

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
    from jaxrl_post.models.attention import resolve_attention_impl

    platform = platform or jax.default_backend()
    try:
        impl = resolve_attention_impl(
            cfg.model.attention_impl,
            platform,
            dtype=resolve("model.dtype", cfg.model.dtype),
            softcap=model.config.attn_logit_softcap,
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


def attach_lora(cfg: Any, model) -> None:
    """Attach the actor's LoRA adapters when LoRA is on (`config_features.lora_enabled`): the PEFT adapter at
    `model.lora_adapter_path` (its r, alpha, targets), else fresh ones (`model.lora_rank`, `lora_alpha`,
    `target_modules`; A seeded by `trainer.seed`, B = 0). Raises what `models.lora.load_peft_adapter` raises."""
    from jaxrl_post.models import lora
    from jaxrl_post.rl.config_features import lora_enabled

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
    from jaxrl_post.models.tokenizer import eos_token_ids

    eos = tuple(eos_token_ids(tokenizer))
    pad = tokenizer.pad_token_id
    if pad is None:
        pad = eos[0] if eos else 0
    return eos, int(pad)


def _rg_kwargs(cfg: Any, val: bool) -> dict[str, Any]:
    from jaxrl_post.data.sources import disjoint_seed

    rg = cfg.data.reasoning_gym
    val_seed = rg.val_seed if rg.val_seed is not None else disjoint_seed(rg.seed, rg.size)
    task_cfg = {k: (tuple(v) if isinstance(v, list) else v) for k, v in rg.config.to_dict().items() if v is not None}
    return dict(
        size=int(rg.val_size if val else rg.size),
        seed=int(val_seed if val else rg.seed),
        config=task_cfg or None,
        prompt_format=rg.prompt_format,
    )


def load_split_rows(cfg: Any, val: bool):
    """`sources.Rows` of `data.train_files` / `data.val_files` (comma-separated specs) via `sources.load_rows`.

    Raises: MalformedRowError naming the file, row and problem (unless `data.skip_malformed`);
      FileNotFoundError; ConfigError naming `data.train_files` / `data.val_files`: an unknown reasoning-gym
      task (lists similar and some valid task names), or no rows at all (empty file, or every row skipped as
      malformed).
    """
    from jaxrl_post.data.sources import load_rows

    key = "data.val_files" if val else "data.train_files"
    spec = cfg.data.val_files if val else cfg.data.train_files
    specs = [s.strip() for s in str(spec).split(",") if s.strip()]
    for s in specs:
        check_reasoning_gym_task(key, spec, s)
    rows = load_rows(
        specs if len(specs) > 1 else specs[0],
        split="test" if val else "train",
        skip_malformed=bool(cfg.data.skip_malformed),
        system_prompt=cfg.data.system_prompt,
        **_rg_kwargs(cfg, val),
    )
    if len(rows) == 0:
        why = (
            f"all {rows.num_skipped} rows were skipped as malformed (data.skip_malformed=True)"
            if rows.num_skipped
            else "the data has no rows (an empty file?)"
        )
        raise ConfigError(f"config.{key}={spec!r}: {why}; point {key} at a file with prompt rows")
    return rows


def _prompt_key(row: dict[str, Any]) -> str:
    return repr([m.get("content") for m in row["prompt"]])


def heldout_rows(train_rows, val_rows, limit: int | None):
    """Validation rows whose prompt does not occur in the training rows (first `limit`), and #dropped.

    `train_rows` / `val_rows`: lists of rows or `sources.Rows` (then a `Rows` is returned)."""
    seen = {_prompt_key(r) for r in getattr(train_rows, "rows", train_rows)}
    rows = getattr(val_rows, "rows", val_rows)
    keep = [i for i, r in enumerate(rows) if _prompt_key(r) not in seen]
    dropped = len(rows) - len(keep)
    if limit:
        keep = keep[:limit]
    if hasattr(val_rows, "select"):
        return val_rows.select(keep), dropped
    return [rows[i] for i in keep], dropped


@dataclasses.dataclass
class DataRows:
    """Checked rows of both splits (`sources.Rows`; `val` None without validation data), data stats, and the
    custom reward function loaded while checking (None without `custom_reward_function.path`)."""

    train: Any
    val: Any
    stats: dict[str, Any]
    custom_reward_fn: Any = None


def _check_reward_sources(cfg: Any, data: DataRows) -> None:
    """Without a custom reward function, every row's data_source must have a scorer in the reward registry
    (unless the reward model is the reward, `reward_model.enable`); with one, it must load
    (`load_custom_reward`; kept in `data.custom_reward_fn` for the reward manager). A remote reward service
    must accept connections (`preflight.check_remote_reward`)."""
    check_remote_reward(cfg)  # nothing without reward_model.remote.url
    if cfg.custom_reward_function.path:
        data.custom_reward_fn = load_custom_reward(cfg)
        return
    if cfg.reward_model.remote.url or cfg.reward_model.judge.path or cfg.reward_model.enable:
        return
    from jaxrl_post.rewards import UnknownDataSourceError, check_data_sources

    for key, spec, rows in (
        ("train_files", cfg.data.train_files, data.train),
        ("val_files", cfg.data.val_files, data.val),
    ):
        if rows is None:
            continue
        try:
            check_data_sources(r["data_source"] for r in rows.rows)
        except UnknownDataSourceError as e:
            raise ConfigError(f"config.data.{key}={spec!r}: {e}") from e


def load_data_rows(cfg: Any) -> DataRows:
    """Load and check both splits' rows before any model is loaded (no tokenizer needed).

    Validation rows whose prompt occurs in the training data are dropped (a held-out set must be held out;
    counted in `data/val_dropped_seen_in_train`); reasoning-gym specs draw more to keep `val_size`.

    Raises:
      MalformedRowError: a malformed row (file, row, problem; suggests `data.skip_malformed=True`).
      ConfigError: a data_source with no reward function and no `custom_reward_function.path` (lists the
        known ones); a `custom_reward_function.path/name` that does not load (`load_custom_reward`); no rows
        or an unknown reasoning-gym task (`load_split_rows`); a remote reward service that does not accept
        connections (`preflight.check_remote_reward`); every validation prompt also occurs in the
        training data while validation is on
        (`trainer.val_before_train`, `trainer.val_at_end`, `trainer.test_freq > 0`). With validation off
        such a val set is dropped with a warning (`trainer.validate()` then raises).
    """
    train_rows = load_split_rows(cfg, val=False)
    stats: dict[str, Any] = {}
    if train_rows.num_skipped:
        stats["data/num_skipped_malformed"] = train_rows.num_skipped
    val_rows = None
    if cfg.data.val_files:
        spec_is_rg = str(cfg.data.val_files).startswith("reasoning_gym")
        want = int(cfg.data.max_val_samples or (cfg.data.reasoning_gym.val_size if spec_is_rg else 0)) or None
        loaded = load_split_rows(cfg, val=True)
        val_rows, dropped = heldout_rows(train_rows, loaded, want)
        factor = 2
        while spec_is_rg and len(val_rows) < want and factor <= 16:
            # problems seen in training were dropped: draw more from the same held-out generator
            more = cfg.copy_and_resolve_references()
            more.data.reasoning_gym.val_size = factor * int(cfg.data.reasoning_gym.val_size)
            loaded = load_split_rows(more, val=True)
            val_rows, dropped = heldout_rows(train_rows, loaded, want)
            factor *= 2
        stats["data/val_dropped_seen_in_train"] = dropped
        if loaded.num_skipped:
            stats["data/num_val_skipped_malformed"] = loaded.num_skipped
        if len(val_rows) == 0:
            why = (
                f"config.data.val_files={cfg.data.val_files!r}: all {dropped} validation prompts also occur in "
                f"config.data.train_files={cfg.data.train_files!r}; validating on training prompts would measure "
                "memorisation, not held-out accuracy"
            )
            if validation_enabled(cfg):
                raise ConfigError(
                    f"{why}. Use held-out data (for reasoning_gym: move data.reasoning_gym.val_seed away from the "
                    "training seeds), or turn validation off (trainer.val_before_train=False, "
                    "trainer.val_at_end=False, trainer.test_freq=-1)."
                )
            log.warning("%s; validation is off, so the validation set is dropped.", why)
            val_rows = None
    data = DataRows(train_rows, val_rows, stats)
    _check_reward_sources(cfg, data)
    return data


def build_dataloaders(cfg: Any, data: DataRows, tokenizer, pad_token_id: int):
    """(train loader (infinite, shuffled, drop_remainder), val loader or None, data stats dict) from the
    rows of `load_data_rows`.

    Raises:
      ConfigError: every prompt is longer than `data.max_prompt_length` (with `data.filter_overlong_prompts`;
        gives the longest / median prompt length), or fewer training prompts than `data.train_batch_size`.
      MalformedRowError: a prompt the chat template rejects, or an overlong one with truncation='error'.
    """
    from jaxrl_post.data import pipeline

    try:
        train = pipeline.make_dataloader(
            data.train,
            tokenizer,
            batch_size=int(cfg.data.train_batch_size),
            max_prompt_length=int(cfg.data.max_prompt_length),
            seed=int(cfg.data.seed),
            shuffle=bool(cfg.data.shuffle),
            num_epochs=None,
            drop_remainder=True,
            filter_overlong_prompts=bool(cfg.data.filter_overlong_prompts),
            truncation=cfg.data.truncation,
            pad_token_id=pad_token_id,
        )
    except pipeline.NotEnoughPromptsError as e:
        raise ConfigError(not_enough_prompts_message(cfg, "data.train_files", cfg.data.train_files, e)) from e
    stats = dict(train.stats, **data.stats)
    val = None
    if data.val is not None:
        n_val = len(data.val)
        bs = int(cfg.data.val_batch_size or n_val)
        try:
            val = pipeline.make_dataloader(
                data.val,
                tokenizer,
                batch_size=min(bs, n_val),
                max_prompt_length=int(cfg.data.max_prompt_length),
                shuffle=False,
                num_epochs=1,
                drop_remainder=False,
                filter_overlong_prompts=bool(cfg.data.filter_overlong_prompts),
                truncation=cfg.data.truncation,
                pad_token_id=pad_token_id,
            )
        except pipeline.NotEnoughPromptsError as e:
            raise ConfigError(not_enough_prompts_message(cfg, "data.val_files", cfg.data.val_files, e)) from e
        stats["data/num_val_prompts"] = val.num_prompts
    return train, val, stats


def build_reward_manager(cfg: Any, tokenizer, custom_reward_fn=None, rm_scorer=None):
    """RewardManager scoring with the remote reward service (`reward_model.remote.url`, its own
    `max_error_fraction`), else the generative judge (`reward_model.judge.path`), else
    `custom_reward_function` (if set), else the reward model's score (`rewards.manager.rm_score`) when
    `rm_scorer` is given, else `default_compute_score`; with DAPO's overlong reward shaping when
    `reward_model.overlong_buffer.enable` (training and validation, as verl).

    Args:
      custom_reward_fn: the function `load_data_rows` already loaded (`DataRows.custom_reward_fn`), so the
        user's file is imported once; None -> loaded here when `custom_reward_function.path` is set.
      rm_scorer: the reward-model role (`build_rm_scorer`), or None.

    Raises: ConfigError: the custom reward function cannot be loaded (see `load_custom_reward`).
    """
    from jaxrl_post.rewards import RewardManager
    from jaxrl_post.rewards.manager import rm_score

    rm = cfg.reward_model
    ob = rm.overlong_buffer
    max_error_fraction = float(rm.max_error_fraction)
    if rm.remote.url:  # the remote reward service (docs/reward_service.md)
        from jaxrl_post.rewards.remote import RemoteRewardClient

        rr = rm.remote
        fn = RemoteRewardClient(
            rr.url,
            batch_size=int(rr.batch_size),
            max_concurrency=int(rr.max_concurrency),
            timeout_s=float(rr.timeout_s),
            max_retries=int(rr.max_retries),
            backoff_s=float(rr.backoff_s),
            backoff_max_s=float(rr.backoff_max_s),
        )
        max_error_fraction = float(rr.max_error_fraction)
    elif rm.judge.path:
        fn = build_judge(cfg)
    else:
        fn = custom_reward_fn if custom_reward_fn is not None else load_custom_reward(cfg)
        if fn is None and rm_scorer is not None:
            fn = rm_score
        elif rm_scorer is not None:
            log.warning(
                "reward_model.enable with custom_reward_function.path=%s: the reward is that function's return; "
                "it gets the RM score as extra_info['rm_score'] (unset the path for the RM score alone)",
                cfg.custom_reward_function.path,
            )
    return RewardManager(
        fn,
        tokenizer,
        num_workers=int(rm.num_workers),
        timeout_s=float(rm.timeout_s),
        max_error_fraction=max_error_fraction,
        overlong_buffer_len=int(ob.len) if ob.enable else None,
        overlong_penalty_factor=float(ob.penalty_factor),
        max_response_length=int(cfg.data.max_response_length),
        overlong_log=bool(ob.log),
        rm_scorer=rm_scorer,
    )


def build_judge(cfg: Any, mesh: jax.sharding.Mesh | None = None):
    """The `GenerativeJudge` of `reward_model.judge.*`: the model at `judge.path` (frozen, `judge.dtype`; on
    `mesh`, default one device), its tokenizer (`judge.tokenizer_path`, else the model's) and our Generator.

    Raises: ConfigError naming `reward_model.judge.path` / `tokenizer_path` when either cannot be loaded."""
    from jaxrl_post.models import load_pretrained
    from jaxrl_post.rewards.judge import DEFAULT_JUDGE_TEMPLATE, GenerativeJudge

    jc = cfg.reward_model.judge
    try:
        model, tokenizer = load_pretrained(jc.path, dtype=jc.dtype, mesh=mesh)
    except (OSError, ValueError, RuntimeError, KeyError) as e:
        raise ConfigError(f"config.reward_model.judge.path={jc.path!r}: {type(e).__name__}: {e}") from e
    if jc.tokenizer_path or tokenizer is None:
        try:
            tokenizer = load_tokenizer(jc.tokenizer_path or jc.path)
        except (OSError, ValueError) as e:
            key = "tokenizer_path" if jc.tokenizer_path else "path"
            raise ConfigError(f"config.reward_model.judge.{key}: no tokenizer: {e}") from e
    return GenerativeJudge(
        model,
        tokenizer,
        jc.prompt_template or DEFAULT_JUDGE_TEMPLATE,
        max_new_tokens=int(jc.max_new_tokens),
        max_prompt_length=int(jc.max_prompt_length),
        min_score=float(jc.min_score),
        max_score=float(jc.max_score),
        default_score=float(jc.default_score),
        normalize=bool(jc.normalize),
        use_chat_template=bool(jc.use_chat_template),
        batch_size=int(jc.batch_size),
        mesh=mesh,
    )


def build_rm_scorer(cfg: Any, mesh, tokenizer):
    """The frozen reward-model role of `reward_model.enable` (None when off): `load_reward_model` of
    `reward_model.model.path` (or its `huggingface/` export, a reward_model run directory) in
    `reward_model.model.dtype` (None: `model.dtype`), its tokenizer if the directory has one.

    Raises: ConfigError: a multi-process run, or a directory that is not a reward model (names the key)."""
    rc = cfg.reward_model
    if not rc.enable:
        return None
    from jaxrl_post.models.hf_io import has_tokenizer_files, load_reward_model
    from jaxrl_post.rewards.rm_scorer import RewardModelScorer

    if jax.process_count() > 1:
        raise ConfigError("reward_model.enable: reward-model scoring runs in one process only (multi-process runs)")
    path = os.path.expanduser(rc.model.path)
    if os.path.isfile(os.path.join(path, "huggingface", "config.json")):
        path = os.path.join(path, "huggingface")
    from jaxrl_post.runtime.platform_defaults import resolve_value

    dtype = resolve_value("model.dtype", rc.model.dtype or cfg.model.dtype)
    try:
        model = load_reward_model(path, dtype, mesh=mesh if mesh is not None and mesh.size > 1 else None)
        rm_tok = load_tokenizer(path) if has_tokenizer_files(path) else None
        return RewardModelScorer(
            model,
            tokenizer,
            rm_tokenizer=rm_tok,
            micro_batch_size=int(rc.micro_batch_size_per_gpu),
            mesh=mesh,
            max_length=None if rc.max_length is None else int(rc.max_length),
        )
    except (ValueError, FileNotFoundError) as e:
        raise ConfigError(f"config.reward_model.model.path={rc.model.path!r}: {e}") from e


def build_agent_loop(cfg: Any, generator, tokenizer):
    """The multi-turn `AgentLoop` of `rollout.multi_turn` (None when off): env 'tools' (a `ToolEnv` per trajectory
    over one `ToolExecutor` of `rollout.multi_turn.tools`) or 'guess_number' (`GuessNumberEnv`), verl's limits,
    and a `ToolErrorBudget` of `max_error_fraction`. The executor's workers are stopped by `AgentLoop.close`.

    Raises: ConfigError: a tool cannot be loaded (unknown name, bad file, no schema from its docstring)."""
    mt = cfg.rollout.multi_turn
    if not mt.enable:
        return None
    from jaxrl_post.rollout.agent_loop import AgentLoop, MultiTurnLimits
    from jaxrl_post.rollout.environments import GuessNumberEnv, ToolEnv
    from jaxrl_post.rollout.sandbox import SandboxUnavailableError
    from jaxrl_post.rollout.tool_parser import get_tool_parser
    from jaxrl_post.rollout.tools import ToolErrorBudget, ToolExecutor, check_sandbox, resolve_tools

    limits = MultiTurnLimits(
        max_assistant_turns=mt.max_assistant_turns,
        max_user_turns=mt.max_user_turns,
        max_parallel_calls=int(mt.max_parallel_calls),
        max_tool_response_length=int(mt.max_tool_response_length),
        tool_response_truncate_side=mt.tool_response_truncate_side,
        format=mt.format,
    )
    parser = get_tool_parser(mt.format)
    budget = ToolErrorBudget(float(mt.max_error_fraction))
    if mt.env == "guess_number":
        return AgentLoop(generator, tokenizer, lambda row: GuessNumberEnv(), limits, parser=parser, error_budget=budget)
    try:
        tools = resolve_tools(mt.tools, sandboxed=mt.sandboxed_tools)
    except Exception as e:
        raise ConfigError(f"config.rollout.multi_turn.tools={mt.tools!r}: {type(e).__name__}: {e}") from e
    try:
        check_sandbox(tools, bool(mt.allow_unsandboxed_tools))
    except SandboxUnavailableError as e:
        raise ConfigError(f"config.rollout.multi_turn.tools={mt.tools!r}: {e}") from e
    executor = ToolExecutor(
        tools,
        num_workers=int(mt.tool_num_workers),
        timeout_s=float(mt.tool_timeout_s),
        memory_mb=int(mt.tool_memory_mb),
        max_output_chars=int(mt.tool_max_output_chars),
        max_processes=int(mt.tool_max_processes),
        allow_unsandboxed=bool(mt.allow_unsandboxed_tools),
    )
    side, length, par = limits.tool_response_truncate_side, limits.max_tool_response_length, limits.max_parallel_calls
    loop = AgentLoop(
        generator,
        tokenizer,
        lambda row: ToolEnv(executor, parser, par, length, side),
        limits,
        tools=[t.schema for t in tools],
        parser=parser,
        error_budget=budget,
    )
    loop.closers.append(executor.close)
    return loop


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
    from jaxrl_post.algos.registry import policy_loss_spec

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
    from jaxrl_post.algos.distillation import DistillationLossConfig

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
