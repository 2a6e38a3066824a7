"""Main job: `python -m jaxrl_post.main --config=configs/grpo.py[:variant] [--config.a.b=value ...]`.

Reads the ml_collections config (the only entry point that does), validates it before anything is
compiled, builds the trainer its top-level `trainer_type` names (`rl`: `RLTrainer`, the default; `sft`:
`SFTTrainer`; `dpo`: `DPOTrainer`; `reward_model`: `RewardModelTrainer`) and runs `fit()`. SIGINT / SIGTERM
stop the run cleanly (`engine/interrupt.py`): the last completed step is checkpointed, one line says where,
and the exit code is 130 / 143; rerunning the same command resumes. Metrics go to the console and to
`<trainer.default_local_dir>/metrics.jsonl`; the resolved config to `config.json` there.
"""

from __future__ import annotations

import os
import sys

from jaxrl_post.config import (
    _CONFIG_FLAG,
    _HELP_FLAGS,
    USAGE,
    ConfigFileError,
    OverrideValueError,
    UnknownConfigKeyError,
    apply_none_overrides,
    check_override_keys,
    has_config_flag,
    split_override_values,
)
from jaxrl_post.data.sources import MalformedRowError
from jaxrl_post.engine.interrupt import GracefulStop, exit_now
from jaxrl_post.engine.run.tracking import console_legend
from jaxrl_post.errors import ConfigError, FilterGroupsError
from jaxrl_post.rewards.manager import RewardFunctionError
from jaxrl_post.rollout.tools import ToolError
from jaxrl_post.runtime.compile_cache import enable_compilation_cache, log_choice  # (imports jax when called)
from jaxrl_post.runtime.log_noise import quiet_startup_noise
from jaxrl_post.runtime.platform_defaults import apply_host_defaults


def _stop_line(trainer) -> str:
    """The one line printed when a signal ended the run (after `trainer.close()` finished the save)."""
    # here, not at the top: this imports jax, which must start after `run` set the XLA flags (XLA reads them once)
    from jaxrl_post.engine.run import checkpoint as ckpt

    n = trainer.global_steps
    path = trainer.checkpointer.step_path(n)
    if n in ckpt.list_complete_steps(trainer.checkpointer.directory):
        return f"interrupted at step {n}; checkpoint saved to {path}; rerun the same command to resume"
    return f"interrupted at step {n}; no checkpoint of step {n} was saved ({path} is missing)"


def lost_line(trainer) -> str:
    """What a second signal loses: the checkpoint being written (`Checkpointer.pending_step`) and/or the
    steps after the last complete checkpoint, and what a rerun resumes from."""
    # here, not at the top: this imports jax, which must start after `run` set the XLA flags (XLA reads them once)
    from jaxrl_post.engine.run import checkpoint as ckpt

    c = trainer.checkpointer
    n, pending = trainer.global_steps, c.pending_step()
    done = ckpt.list_complete_steps(c.directory)
    last = done[-1] if done else None
    resume = f"a rerun resumes from step {last} ({c.step_path(last)})" if last else "a rerun starts from scratch"
    if pending is not None:
        return f"the checkpoint of step {pending} being written ({c.step_path(pending)}) is lost; {resume}"
    if last == n:
        return f"nothing is lost: step {n} is saved ({c.step_path(n)})"
    lost = f"step {n}" if last == n - 1 else f"steps {(last or 0) + 1}-{n}"
    return f"{lost} (not checkpointed) lost; {resume}"


def _nothing_saved_line(trainer) -> str:
    if trainer is None:
        return "interrupted during start-up; nothing was saved"
    n = trainer.global_steps
    if trainer.resumed_from:
        return (
            f"interrupted before step {n + 1} finished; nothing new was saved "
            f"(rerun the same command to resume from step {n}: {trainer.resumed_from})"
        )
    return "interrupted before the first step finished; nothing was saved"


def reward_error_text(e: BaseException) -> str:
    """`error: <message>` first (what failed, the row, the first failure), then -- for a reward function that
    raised in this process -- its own traceback (`__cause__`), not the trainer's frames above it."""
    import traceback

    text = f"error: {e}"
    cause = e.__cause__
    if cause is not None and cause.__traceback__ is not None:
        ours = os.path.dirname(os.path.abspath(__file__)) + os.sep  # the reward manager's calling frames
        frames = [f for f in traceback.extract_tb(cause.__traceback__) if not f.filename.startswith(ours)]
        if frames:  # none: our own check refused the value it returned (NaN, not a number); the line says it
            tb = "".join(traceback.format_list(frames) + traceback.format_exception_only(type(cause), cause))
            text += f"\nthe reward function's traceback:\n{tb.rstrip()}"
    return text


def main(argv) -> None:
    """Build the trainer and train, under `_STOP` (SIGINT/SIGTERM -> checkpoint, one line, exit 130/143)."""
    del argv
    # here, not at the top: this imports jax, which must start after `run` set the XLA flags (XLA reads them once)
    from jaxrl_post.api import build_trainer
    from jaxrl_post.engine.nonfinite import NonFiniteError
    from jaxrl_post.engine.run.checkpoint import CheckpointError
    from jaxrl_post.engine.run.error_log import OrbaxTracebacks, failure_text, is_disk_full, write_error_log
    from jaxrl_post.rl.trainer import summarize
    from jaxrl_post.runtime.distributed import DistributedConfigError, initialize_from_config

    stop = _STOP if _STOP is not None else GracefulStop()  # `run()` installs it; a bare one installs nothing
    try:  # jax.distributed first (trainer.distributed.*; auto-detected on pods/SLURM), before any other JAX call
        initialize_from_config(_CONFIG.value)
    except DistributedConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    try:
        apply_none_overrides(_CONFIG.value, _NONE_KEYS)  # --config.KEY=None means None, not the string 'None'
        # before anything compiles: a restart loads the programs compiled before (runtime/compile_cache.py)
        cache = enable_compilation_cache(_CONFIG.value.trainer.get("compilation_cache_dir"))
        trainer = build_trainer(_CONFIG.value)  # the top-level key trainer_type picks it (api.TRAINERS)
    except (ConfigError, MalformedRowError, CheckpointError) as e:  # bad config, data or checkpoint to resume
        print(f"error: {e}", file=sys.stderr)  # the message says what and where
        sys.exit(2)
    log_choice(cache)  # after the checks (a start-up error stays the only line), once per run
    stop.abort_line = _nothing_saved_line(trainer)  # printed by a signal before the first completed step
    stop.lost_line = lambda: lost_line(trainer)  # printed by a second signal
    failed, finished = None, False
    orbax = OrbaxTracebacks.install()  # a failed save's tracebacks: into error.log, not onto the console
    try:
        result = trainer.fit(stop=stop)
        finished = True
    except (RewardFunctionError, ConfigError, CheckpointError, ToolError, FilterGroupsError, NonFiniteError) as e:
        failed = e  # the user's reward code or tool, a batch shape, a full disk, dynamic sampling, a diverging run
    except OSError as e:
        if not is_disk_full(e):
            raise
        failed = e
    finally:
        try:
            trainer.close()  # waits for the (async) checkpoint save, stops the reward workers
        except CheckpointError as e:  # the last save failed
            if failed is None and not finished:
                raise  # another error is on its way: both are shown (chained)
            failed = failed or e
    run_dir, text = _CONFIG.value.trainer.get("default_local_dir"), None
    if failed is not None:
        text = (
            reward_error_text(failed)
            if isinstance(failed, RewardFunctionError)
            else failure_text(failed, trainer, run_dir, orbax.records)  # writes (and empties) orbax.records
        )
    if orbax.records:  # kept off the console, not written with a failure: say where they are
        print(f"warning: orbax logged errors ({write_error_log(run_dir, None, orbax.records)})", file=sys.stderr)
    if text is not None:
        print(text, file=sys.stderr, flush=True)
        sys.exit(2)
    if stop.requested:
        print(_stop_line(trainer), flush=True)
        exit_now(stop.exit_code)
    if result.get("val_before") or result.get("val_after"):
        print(summarize(result), flush=True)


def run(argv=None) -> None:
    """Entry point: checks `--config.*` keys, then runs `main` under absl with SIGINT/SIGTERM handled."""
    global _CONFIG, _STOP, _NONE_KEYS

    argv = list(sys.argv if argv is None else argv)

    # CPU only: XLA:CPU flags before JAX creates its backend (XLA reads XLA_FLAGS once) and glibc malloc settings
    # that return freed buffers to the OS (before the big allocations); platform_defaults.py
    apply_host_defaults()
    if not has_config_flag(argv):
        print(f"{USAGE}\nerror: --{_CONFIG_FLAG} is required", file=sys.stderr)
        sys.exit(2)
    with GracefulStop(_nothing_saved_line(None)) as stop:
        _STOP = stop
        from absl import app
        from ml_collections import config_flags

        quiet_startup_noise()
        try:  # our one-line errors for unknown keys and values of the wrong type, before absl's FATAL
            argv, _NONE_KEYS = split_override_values(argv, check_override_keys(argv))
        except (UnknownConfigKeyError, FileNotFoundError, ConfigFileError, OverrideValueError) as e:
            print(f"error: {e}", file=sys.stderr)
            sys.exit(2)
        if any(a in _HELP_FLAGS for a in argv[1:]):  # absl prints __main__'s docstring: add the console legend
            entry = sys.modules["__main__"]
            entry.__doc__ = f"{entry.__doc__ or __doc__}\n{console_legend()}\n"
        _CONFIG = config_flags.DEFINE_config_file(  # overrides read from argv (the None ones taken out), not sys.argv
            _CONFIG_FLAG, None, "Job config: path/to/config.py[:variant].", lock_config=True, sys_argv=argv
        )
        app.run(main, argv=argv)


_CONFIG = None
_STOP = None
_NONE_KEYS: list[str] = []

if __name__ == "__main__":
    run()
