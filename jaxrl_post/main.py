"""Main job: `python -m jaxrl_post.main --config=configs/grpo.py[:variant] [--config.a.b=value ...]`.

Reads the ml_collections config (the only entry point that does), validates it before anything is
compiled, builds the trainer its top-level `trainer_type` names (`rl`: `RLTrainer`, the default; `sft`:
`SFTTrainer`; `dpo`: `DPOTrainer`; `reward_model`: `RewardModelTrainer`) and runs `fit()`. SIGINT / SIGTERM
stop the run cleanly (`trainer/interrupt.py`): the last completed step is checkpointed, one line says where,
and the exit code is 130 / 143; rerunning the same command resumes. Metrics go to the console and to
`<trainer.default_local_dir>/metrics.jsonl`; the resolved config to `config.json` there.
"""

from __future__ import annotations

import difflib
import importlib.util
import os
import sys

_CONFIG_FLAG = "config"
USAGE = "usage: python -m jaxrl_post.main --config=configs/grpo.py[:variant] [--config.key=value ...]"
_HELP_FLAGS = ("-h", "--help", "--helpshort", "--helpfull", "--helpxml")


class UnknownConfigKeyError(ValueError):
    """A `--config.<key>` override names no field of the config."""


class ConfigFileError(ValueError):
    """The `--config` file's `get_config(arg)` refused its argument (e.g. an unknown variant)."""


class OverrideValueError(ValueError):
    """A `--config.<key>=VALUE` whose value the key's type cannot take (absl would stop with a FATAL line)."""


def _load_config_file(spec: str):
    path, _, arg = spec.partition(":")
    if not os.path.exists(path):
        raise FileNotFoundError(f"--{_CONFIG_FLAG}: config file not found: {path}")
    mod_spec = importlib.util.spec_from_file_location("_jaxrl_post_job_config", path)
    module = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(module)
    try:
        return module.get_config(arg) if arg else module.get_config()
    except (ValueError, KeyError) as e:  # configs/*.py: "unknown variant 'x'; valid: [...]"
        raise ConfigFileError(f"--{_CONFIG_FLAG}={spec}: {e.args[0] if e.args else e}") from e


def _all_keys(cfg, prefix: str = "") -> list[str]:
    out = []
    for k, v in cfg.items():
        key = f"{prefix}{k}"
        out.append(key)
        if hasattr(v, "items") and not isinstance(v, dict):
            out += _all_keys(v, key + ".")
    return out


def _config_spec(argv: list[str]) -> str | None:
    """The `path[:variant]` of `--config=...` or `--config ...` in argv, if any."""
    prefix = f"--{_CONFIG_FLAG}"
    for i, a in enumerate(argv[1:], start=1):
        if a.startswith(prefix + "="):
            return a[len(prefix) + 1 :]
        if a == prefix and i + 1 < len(argv):
            return argv[i + 1]
    return None


def _by_verl_name(valid: set[str]) -> dict[str, str]:
    """verl's full key name -> our key, for the keys that carry verl's name and meaning ({} when `configs.base`
    is not importable, e.g. a job config outside this repo)."""
    try:
        from configs.base import verl_key
    except ImportError:
        return {}
    return {v: k for k in valid if (v := verl_key(k))}


def _suggest(key: str, valid: set[str]) -> str:
    """'; did you mean config.X?' for a misspelled key or a verl name (`actor_rollout_ref.rollout.n`), or ''."""
    by_verl = _by_verl_name(valid)
    if key in by_verl:
        return f"; did you mean config.{by_verl[key]} (verl's {key})?"
    close = difflib.get_close_matches(key.removeprefix("actor_rollout_ref."), sorted(valid), n=3)
    return f"; did you mean {', '.join('config.' + c for c in close)}?" if close else ""


def check_override_keys(argv: list[str]):
    """Fail with a clear message (and suggestions) when a `--config.<key>=...` names no config field, or when
    argv has a bare `key=value` (Hydra/verl style), which absl would silently ignore.

    ml_collections rejects unknown keys too, but with a bare `AttributeError: "'key'"` traceback.

    Returns: the config the file builds (None without `--config`).

    Raises:
      UnknownConfigKeyError: an unknown key, or a positional argument.
      FileNotFoundError: the `--config` file does not exist.
      ConfigFileError: its `get_config(variant)` raised ValueError/KeyError (an unknown variant).
    """
    spec = _config_spec(argv)
    prefix = f"--{_CONFIG_FLAG}"
    keys, positional = [], []
    prev = ""
    for a in argv[1:]:
        if a.startswith(prefix + "."):
            keys.append(a[len(prefix) + 1 :].split("=", 1)[0])
        elif not a.startswith("-") and a != spec:
            # `--flag value` (absl's space form) passes a value; `key=value` never is one
            if "=" in a or not prev.startswith("-") or "=" in prev:
                positional.append(a)
        prev = a
    cfg = _load_config_file(spec) if spec is not None else None
    valid = set(_all_keys(cfg)) if cfg is not None else set()
    if positional:
        a = positional[0]
        key, eq, value = a.partition("=")
        if eq and valid:
            local = _by_verl_name(valid).get(key, key).removeprefix("actor_rollout_ref.")
            hint = f" (did you mean --{_CONFIG_FLAG}.{local}={value}?)" if local in valid else _suggest(key, valid)
        else:
            hint = ""
        raise UnknownConfigKeyError(
            f"unexpected argument {a!r}: overrides are written --{_CONFIG_FLAG}.KEY=VALUE{hint}\n{USAGE}"
        )
    for key in keys:
        if key not in valid:
            raise UnknownConfigKeyError(
                f"unknown config key config.{key} (from --{_CONFIG_FLAG}.{key}){_suggest(key, valid)}"
            )
    return cfg


_TYPE_NAMES = {int: "an int", float: "a number", bool: "True or False", str: "a string"}


def split_override_values(argv: list[str], cfg) -> tuple[list[str], list[str]]:
    """Check each `--config.KEY=VALUE` (or `--config.KEY VALUE`) of argv against the type of KEY in `cfg` (int,
    float, bool: absl's parsers) and take the `None` ones out. None is accepted where the config makes the key
    optional: a `FieldReference` field (`configs/base.py`'s `_opt_int` etc.), a string, or a None value.

    Returns: (argv without the None overrides, their keys; `apply_none_overrides` sets them after parsing).
    Raises: OverrideValueError naming the key and the type it takes.
    """
    from absl import flags
    from ml_collections import FieldReference
    from ml_collections.config_flags import config_path

    parsers = {int: flags.IntegerParser(), float: flags.FloatParser(), bool: flags.BooleanParser()}
    prefix = f"--{_CONFIG_FLAG}."
    out, none_keys, i = [], [], 0
    while i < len(argv):
        a, i = argv[i], i + 1
        key, eq, value = a[len(prefix) :].partition("=") if a.startswith(prefix) else ("", "", "")
        if not key or cfg is None:
            out.append(a)
            continue
        ftype, current = config_path.get_type(key, cfg), config_path.get_value(key, cfg)
        if not eq and ftype is not bool and i < len(argv) and not argv[i].startswith("-"):  # absl's `--flag value`
            eq, value, i = "=", argv[i], i + 1
            a = f"{a}={value}"
        none_keys = [k for k in none_keys if k != key]  # the last override of a key wins
        want = _TYPE_NAMES.get(ftype, getattr(ftype, "__name__", str(ftype)))
        if eq and value == "None":
            *path, leaf = key.split(".")
            node = cfg
            for part in path:
                node = node[part]
            field = dict(node.items(preserve_field_references=True)).get(leaf)
            if not (isinstance(field, FieldReference) or ftype is str or current is None):
                raise OverrideValueError(
                    f"config.{key}=None: this key takes {want} and cannot be None (e.g. {current})"
                )
            none_keys.append(key)
            continue
        if eq and ftype in parsers:
            try:
                parsers[ftype].parse(value)
            except ValueError:
                raise OverrideValueError(f"config.{key}={value!r}: expected {want} (e.g. {current!r})") from None
        out.append(a)
    return out, none_keys


def has_config_flag(argv: list[str]) -> bool:
    """Whether argv names a job config (`--config=path[:variant]` or `--config path`) or asks for help."""
    return _config_spec(argv) is not None or any(a in _HELP_FLAGS for a in argv[1:])


def _stop_line(trainer) -> str:
    """The one line printed when a signal ended the run (after `trainer.close()` finished the save)."""
    from jaxrl_post.trainer import checkpoint as ckpt

    n = trainer.global_steps
    path = trainer.checkpointer.step_path(n)
    if n in ckpt.list_complete_steps(trainer.checkpointer.directory):
        return f"interrupted at step {n}; checkpoint saved to {path}; rerun the same command to resume"
    return f"interrupted at step {n}; no checkpoint of step {n} was saved ({path} is missing)"


def lost_line(trainer) -> str:
    """What a second signal loses: the checkpoint being written (`Checkpointer.pending_step`) and/or the
    steps after the last complete checkpoint, and what a rerun resumes from."""
    from jaxrl_post.trainer import checkpoint as ckpt

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


def none_override_keys(argv: list[str]) -> list[str]:
    """The keys of `--config.KEY=None` overrides. absl parses the value of a string field as the string 'None';
    `apply_none_overrides` makes them Python None."""
    prefix = f"--{_CONFIG_FLAG}."
    return [a[len(prefix) : -len("=None")] for a in argv[1:] if a.startswith(prefix) and a.endswith("=None")]


def apply_none_overrides(cfg, keys: list[str]) -> None:
    """Set each `keys` field of `cfg` to None (`--config.KEY=None`). Raises ConfigError naming a field that
    cannot be None (a number or a flag)."""
    from jaxrl_post.trainer.config_check import ConfigError

    for key in keys:
        *path, leaf = key.split(".")
        node = cfg
        for part in path:
            node = node[part]
        try:
            with node.unlocked() if hasattr(node, "unlocked") else _nullcontext():
                node[leaf] = None
        except (TypeError, KeyError) as e:
            raise ConfigError(f"config.{key}=None: this field cannot be None ({e})") from e


def _nullcontext():
    import contextlib

    return contextlib.nullcontext()


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
    from jaxrl_post.api import build_trainer
    from jaxrl_post.data.sources import MalformedRowError
    from jaxrl_post.distributed import DistributedConfigError, initialize_from_config
    from jaxrl_post.error_log import OrbaxTracebacks, failure_text, is_disk_full, write_error_log
    from jaxrl_post.rewards.manager import RewardFunctionError
    from jaxrl_post.rollout.tools import ToolError
    from jaxrl_post.trainer.checkpoint import CheckpointError
    from jaxrl_post.trainer.config_check import ConfigError
    from jaxrl_post.trainer.dynamic_sampling import FilterGroupsError
    from jaxrl_post.trainer.interrupt import GracefulStop, exit_now
    from jaxrl_post.trainer.nonfinite import NonFiniteError
    from jaxrl_post.trainer.trainer import summarize

    stop = _STOP if _STOP is not None else GracefulStop()  # `run()` installs it; a bare one installs nothing
    try:  # jax.distributed first (trainer.distributed.*; auto-detected on pods/SLURM), before any other JAX call
        initialize_from_config(_CONFIG.value)
    except DistributedConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    try:
        apply_none_overrides(_CONFIG.value, _NONE_KEYS)  # --config.KEY=None means None, not the string 'None'
        trainer = build_trainer(_CONFIG.value)  # the top-level key trainer_type picks it (api.TRAINERS)
    except (ConfigError, MalformedRowError, CheckpointError) as e:  # bad config, data or checkpoint to resume
        print(f"error: {e}", file=sys.stderr)  # the message says what and where
        sys.exit(2)
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
    from jaxrl_post.trainer.interrupt import GracefulStop

    argv = list(sys.argv if argv is None else argv)
    from jaxrl_post.platform_defaults import apply_host_defaults

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

        from jaxrl_post.log_noise import quiet_startup_noise

        quiet_startup_noise()
        try:  # our one-line errors for unknown keys and values of the wrong type, before absl's FATAL
            argv, _NONE_KEYS = split_override_values(argv, check_override_keys(argv))
        except (UnknownConfigKeyError, FileNotFoundError, ConfigFileError, OverrideValueError) as e:
            print(f"error: {e}", file=sys.stderr)
            sys.exit(2)
        if any(a in _HELP_FLAGS for a in argv[1:]):  # absl prints __main__'s docstring: add the console legend
            from jaxrl_post.trainer.tracking import console_legend

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
