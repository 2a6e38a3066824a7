"""Main job: `python -m jaxrl_post.main --config=configs/grpo.py[:variant] [--config.a.b=value ...]`.

Reads the ml_collections config (the only entry point that does), validates it before anything is
compiled, builds `RLTrainer` and runs `fit()`. Metrics go to the console and to
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


def _load_config_file(spec: str):
    path, _, arg = spec.partition(":")
    if not os.path.exists(path):
        raise FileNotFoundError(f"--{_CONFIG_FLAG}: config file not found: {path}")
    mod_spec = importlib.util.spec_from_file_location("_jaxrl_post_job_config", path)
    module = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(module)
    return module.get_config(arg) if arg else module.get_config()


def _all_keys(cfg, prefix: str = "") -> list[str]:
    out = []
    for k, v in cfg.items():
        key = f"{prefix}{k}"
        out.append(key)
        if hasattr(v, "items") and not isinstance(v, dict):
            out += _all_keys(v, key + ".")
    return out


def check_override_keys(argv: list[str]) -> None:
    """Fail with a clear message (and suggestions) when a `--config.<key>=...` names no config field.

    ml_collections rejects such overrides too, but with a bare `AttributeError: "'key'"` traceback.
    """
    spec = None
    keys = []
    prefix = f"--{_CONFIG_FLAG}"
    for a in argv[1:]:
        if a.startswith(prefix + "="):
            spec = a[len(prefix) + 1 :]
        elif a.startswith(prefix + "."):
            keys.append(a[len(prefix) + 1 :].split("=", 1)[0])
    if spec is None or not keys:
        return
    cfg = _load_config_file(spec)
    valid = set(_all_keys(cfg))
    for key in keys:
        if key not in valid:
            close = difflib.get_close_matches(key, sorted(valid), n=3)
            hint = f"; did you mean {', '.join('config.' + c for c in close)}?" if close else ""
            raise UnknownConfigKeyError(f"unknown config key config.{key} (from --{_CONFIG_FLAG}.{key}){hint}")


def has_config_flag(argv: list[str]) -> bool:
    """Whether argv names a job config (`--config=path[:variant]` or `--config path`) or asks for help."""
    args = argv[1:]
    return any(a == f"--{_CONFIG_FLAG}" or a.startswith(f"--{_CONFIG_FLAG}=") or a in _HELP_FLAGS for a in args)


def main(argv) -> None:
    del argv
    from jaxrl_post.trainer.config_check import ConfigError
    from jaxrl_post.trainer.trainer import RLTrainer, summarize

    cfg = _CONFIG.value
    try:
        trainer = RLTrainer(cfg)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    try:
        result = trainer.fit()
    finally:
        trainer.close()
    if result.get("val_before") or result.get("val_after"):
        print(summarize(result), flush=True)


def run(argv=None) -> None:
    global _CONFIG
    from absl import app
    from ml_collections import config_flags

    argv = list(sys.argv if argv is None else argv)
    if not has_config_flag(argv):
        print(f"{USAGE}\nerror: --{_CONFIG_FLAG} is required", file=sys.stderr)
        sys.exit(2)
    from jaxrl_post.log_noise import quiet_startup_noise

    quiet_startup_noise()
    try:
        check_override_keys(argv)
    except UnknownConfigKeyError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    _CONFIG = config_flags.DEFINE_config_file(
        _CONFIG_FLAG, None, "Job config: path/to/config.py[:variant].", lock_config=True
    )
    app.run(main, argv=argv)


_CONFIG = None

if __name__ == "__main__":
    run()
