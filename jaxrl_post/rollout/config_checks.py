"""Config checks of the rollout section (`rollout.*`, `rollout.multi_turn.*`): sample counts, the engine
(`'dense'`, or `'paged'` with its vLLM-named sizes), sampling parameters, the rollout dtype, and the multi-turn
agent loop's limits, environment, tool-call format and tool sandbox. Sections of `rl/config_check.py`'s table;
they report through an `errors.Checker`. The split placement's `rollout.n_gpus_per_node` / `nnodes` are checked
with asynchronous training (`rl/async_training/config_checks.py`)."""

from __future__ import annotations

from jaxrl_post.errors import Checker, is_int, is_num, pos_int
from jaxrl_post.models.presets import get_preset
from jaxrl_post.rollout.tool_parser import _PARSERS

ROLLOUT_NAMES = ("dense", "paged")
MULTI_TURN_ENVS = ("tools", "guess_number")
_DTYPES = ("float32", "bfloat16", "float16")


def check_rollout(c: Checker) -> None:
    """`rollout.n`, `log_prob_micro_batch_size`, `val_kwargs.n` positive; `rollout.name` and, for 'paged', its
    sizes (one device unless `rollout.tensor_model_parallel_size` lays it out as data-parallel replicas of a
    tensor-parallel engine, `max_num_seqs >= n`: per replica; multi-turn runs on it, `rollout/paged/session.py`);
    `temperature` (when sampling), `top_p`, `top_k`, `min_p`, and `val_kwargs`' (when validation samples);
    `rollout.dtype`. Reads `c.devices` (the training devices) for the paged engine's one device."""
    cfg = c.cfg
    for key in ("rollout.n", "rollout.log_prob_micro_batch_size", "rollout.val_kwargs.n"):
        c.check(key, pos_int, "must be a positive int")
    c.check("rollout.name", lambda v: v in ROLLOUT_NAMES, "valid: 'dense', 'paged'")
    if cfg.rollout.name == "paged":
        for key in ("max_num_seqs", "max_num_batched_tokens", "block_size", "num_scheduler_steps"):
            c.check(f"rollout.{key}", lambda v: is_int(v) and v >= 1, "must be an integer >= 1")
        none_or_2 = lambda v: v is None or (is_int(v) and v >= 2)
        if c.check("rollout.num_gpu_blocks_override", none_or_2, "must be None or >= 2"):
            _check_pool_holds_a_sequence(c)
        c.check("rollout.max_model_len", none_or_2, "must be None or >= 2")
        c.check("rollout.enable_prefix_caching", lambda v: isinstance(v, bool), "must be a bool")
        sizes_ok = lambda v: v is None or (isinstance(v, (tuple, list)) and v and all(is_int(x) and x >= 1 for x in v))
        c.check("rollout.cudagraph_capture_sizes", sizes_ok, "must be None or a non-empty tuple of integers >= 1")
        c.check(
            "rollout.gpu_memory_utilization", lambda v: v is None or (is_num(v) and 0 < v <= 1), "must be in (0, 1]"
        )
        if is_int(cfg.rollout.max_num_seqs) and is_int(cfg.rollout.n) and cfg.rollout.max_num_seqs < cfg.rollout.n:
            c.err("rollout.max_num_seqs", f"must be >= rollout.n={cfg.rollout.n} (a prompt's samples decode together)")
        d = c.devices
        tp = cfg.rollout.get("tensor_model_parallel_size")
        if d is not None and (d.train or 1) > 1 and not d.rollout and tp is None:  # split: check_placement
            c.err(
                "rollout.name",
                f"'paged' runs on one device unless rollout.tensor_model_parallel_size lays it out, the run has "
                f"{d.train}; set that key to a tp dividing them ({d.train} / tp data-parallel engine replicas of tp "
                "devices each) or use 'dense'",
            )
    if cfg.rollout.do_sample:
        c.check("rollout.temperature", lambda v: is_num(v) and v > 0, "must be > 0 when rollout.do_sample")
    _check_truncation(c, "rollout")
    c.check("rollout.min_p", lambda v: is_num(v) and 0 <= v < 1, "must be in [0, 1)")
    if cfg.rollout.val_kwargs.do_sample:  # greedy validation reads none of them
        msg = "must be > 0 when rollout.val_kwargs.do_sample"
        c.check("rollout.val_kwargs.temperature", lambda v: is_num(v) and v > 0, msg)
        _check_truncation(c, "rollout.val_kwargs")
    c.check(
        "rollout.dtype", lambda v: v is None or v in _DTYPES, "valid: None (= model.dtype), float32, bfloat16, float16"
    )


def _check_truncation(c: Checker, prefix: str) -> None:
    """`<prefix>.top_p` in (0, 1] and `<prefix>.top_k` -1 (off) or > 0 (`rollout` or `rollout.val_kwargs`)."""
    c.check(f"{prefix}.top_p", lambda v: is_num(v) and 0 < v <= 1, "must be in (0, 1]")
    c.check(f"{prefix}.top_k", lambda v: is_int(v) and (v == -1 or v > 0), "must be -1 (off) or > 0")


def _check_pool_holds_a_sequence(c: Checker) -> None:
    """`rollout.num_gpu_blocks_override` pages, less the null page, hold one longest sequence
    (`data.max_prompt_length` + `data.max_response_length` tokens in pages of `rollout.block_size`): the engine's
    `Scheduler.add` refuses a smaller pool at the first batch of such prompts, mid-run."""
    cfg = c.cfg
    pages, bs = cfg.rollout.num_gpu_blocks_override, cfg.rollout.block_size
    p, r = cfg.data.max_prompt_length, cfg.data.max_response_length
    if pages is None or not all(is_int(v) and v >= 1 for v in (bs, p, r)):
        return
    need = -(-(p + r) // bs)
    if pages - 1 < need:
        c.err(
            "rollout.num_gpu_blocks_override",
            f"must be >= {need + 1}: one sequence of data.max_prompt_length + data.max_response_length = {p + r} "
            f"tokens needs {need} pages of rollout.block_size={bs}, plus the null page",
        )


def check_multi_turn(c: Checker) -> None:
    """`rollout.multi_turn.*`: limits as verl's, known env / format / tools, and the features it cannot serve
    (sampling-mask replay: the agent loop records no sampling thresholds)."""
    cfg = c.cfg
    mt = cfg.rollout.multi_turn
    if not c.check("rollout.multi_turn.enable", lambda v: isinstance(v, bool), "must be a bool") or not mt.enable:
        return
    opt_pos = lambda v: v is None or (is_int(v) and v > 0)
    c.check("rollout.multi_turn.env", lambda v: v in MULTI_TURN_ENVS, f"must be one of {list(MULTI_TURN_ENVS)}")
    c.check("rollout.multi_turn.max_assistant_turns", opt_pos, "must be None or a positive int")
    c.check("rollout.multi_turn.max_user_turns", opt_pos, "must be None or a positive int")
    c.check("rollout.multi_turn.max_parallel_calls", lambda v: is_int(v) and v > 0, "must be a positive int")
    c.check("rollout.multi_turn.max_tool_response_length", lambda v: is_int(v) and v > 0, "must be a positive int")
    c.check(
        "rollout.multi_turn.tool_response_truncate_side",
        lambda v: v in ("left", "middle", "right"),
        "must be left, middle or right",
    )

    c.check("rollout.multi_turn.format", lambda v: v in _PARSERS, f"must be one of {sorted(_PARSERS)}")
    c.check("rollout.multi_turn.tool_num_workers", lambda v: is_int(v) and v > 0, "must be a positive int")
    c.check("rollout.multi_turn.tool_timeout_s", lambda v: is_num(v) and v > 0, "must be > 0")
    c.check("rollout.multi_turn.tool_memory_mb", lambda v: is_int(v) and v >= 0, "must be an int >= 0 (0 = no cap)")
    c.check("rollout.multi_turn.tool_max_output_chars", lambda v: is_int(v) and v > 0, "must be a positive int")
    c.check("rollout.multi_turn.max_error_fraction", lambda v: is_num(v) and 0 <= v <= 1, "must be in [0, 1]")
    c.check("rollout.multi_turn.sandboxed_tools", lambda v: isinstance(v, str), "must be a string of tool names")
    c.check("rollout.multi_turn.tool_max_processes", lambda v: is_int(v) and v > 0, "must be a positive int")
    c.check("rollout.multi_turn.allow_unsandboxed_tools", lambda v: isinstance(v, bool), "must be a bool")
    if mt.env == "tools":
        c.check("rollout.multi_turn.tools", lambda v: isinstance(v, str) and v.strip(), "must name at least one tool")
    if cfg.rollout.sampling_mask_replay is True:
        c.err(
            "rollout.sampling_mask_replay", "is not supported with rollout.multi_turn.enable (no sampling thresholds)"
        )


def check_rollout_tp(c: Checker) -> None:
    """`rollout.tensor_model_parallel_size` (verl's name): None, or an int tp >= 1 dividing the rollout's devices
    (split: `rollout.n_gpus_per_node`; `c.devices`) and a `model.random_init` preset's query / KV heads (a loaded
    model's: `builders.check_rollout_heads`). 'paged' takes any such tp: devices / tp data-parallel engine replicas
    (`rollout/paged/replicas.py`)."""
    cfg = c.cfg
    key = "rollout.tensor_model_parallel_size"
    tp = cfg.rollout.get("tensor_model_parallel_size")
    if not c.check(key, lambda v: v is None or (is_int(v) and v >= 1), "must be None or an int >= 1") or tp is None:
        return
    n_devices = c.devices.total
    n = c.devices.rollout or n_devices
    where = f"the rollout's {n} devices" + (" (rollout.n_gpus_per_node)" if n != n_devices else "")
    if n % tp:
        c.err(key, f"must divide {where}")
    if cfg.model.random_init:
        try:
            mc = get_preset(cfg.model.preset).replace(**{k: v for k, v in cfg.model.arch.items() if v is not None})
        except (KeyError, TypeError) as e:  # an unknown preset or arch field: the model build reports it
            c.err(key, f"cannot check the model's heads: {e}")
            return
        except (ValueError, NotImplementedError) as e:  # ModelConfig's own checks (builders.model_config_from's line)
            c.add(f"model.arch on config.model.preset={cfg.model.preset!r}: {e}")
            return
        for name in ("num_heads", "num_kv_heads"):
            if getattr(mc, name) % tp:
                c.err(key, f"must divide the model's {name}={getattr(mc, name)} (heads are split over 'tensor')")
