"""Config -> the RL trainer's scoring objects: the reward manager (rule, custom, remote and reward-model
scores), the LLM judge, the reward-model scorer, and the multi-turn agent loop with its tools."""

from __future__ import annotations

import logging
import os
from typing import Any

import jax

from jaxrl_post.errors import ConfigError
from jaxrl_post.models import load_pretrained
from jaxrl_post.models.hf_io import has_tokenizer_files, load_reward_model
from jaxrl_post.rewards import RewardManager
from jaxrl_post.rewards.judge import DEFAULT_JUDGE_TEMPLATE, GenerativeJudge
from jaxrl_post.rewards.manager import rm_score
from jaxrl_post.rewards.remote import RemoteRewardClient
from jaxrl_post.rewards.rm_scorer import RewardModelScorer
from jaxrl_post.rl.builders import load_tokenizer
from jaxrl_post.rl.preflight import (
    load_custom_reward,
)
from jaxrl_post.rollout.agent_loop import AgentLoop, MultiTurnLimits
from jaxrl_post.rollout.environments import GuessNumberEnv, ToolEnv
from jaxrl_post.rollout.sandbox import SandboxUnavailableError
from jaxrl_post.rollout.tool_parser import get_tool_parser
from jaxrl_post.rollout.tools import ToolErrorBudget, ToolExecutor, check_sandbox, resolve_tools
from jaxrl_post.runtime.platform_defaults import resolve_value

log = logging.getLogger(__name__)


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

    rm = cfg.reward_model
    ob = rm.overlong_buffer
    max_error_fraction = float(rm.max_error_fraction)
    if rm.remote.url:  # the remote reward service (docs/reward_service.md)
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

    if jax.process_count() > 1:
        raise ConfigError("reward_model.enable: reward-model scoring runs in one process only (multi-process runs)")
    path = os.path.expanduser(rc.model.path)
    if os.path.isfile(os.path.join(path, "huggingface", "config.json")):
        path = os.path.join(path, "huggingface")

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
    except Exception as e:  # our own ValueErrors say what is wrong; a tool file's error keeps its type
        what = str(e) if type(e) is ValueError else f"{type(e).__name__}: {e}"
        raise ConfigError(f"config.rollout.multi_turn.tools={mt.tools!r}: {what}") from e
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
