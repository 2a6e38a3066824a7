"""Job-config loading for `python -m jaxrl_post.main` and `jaxrl_post.api`: the `--config=path[:variant]` file,
`--config.KEY=VALUE` overrides checked against the config's fields (unknown keys answered with suggestions,
verl's full key names mapped to ours), and `--config.KEY=None` for optional fields.
"""

from __future__ import annotations

import contextlib
import difflib
import importlib.util
import os

from jaxrl_post.errors import ConfigError

_CONFIG_FLAG = "config"
USAGE = "usage: python -m jaxrl_post.main --config=configs/grpo.py[:variant] [--config.key=value ...]"
_HELP_FLAGS = ("-h", "--help", "--helpshort", "--helpfull", "--helpxml")


class UnknownConfigKeyError(ValueError):
    """A `--config.<key>` override names no field of the config."""


class ConfigFileError(ValueError):
    """The `--config` file's `get_config(arg)` refused its argument (e.g. an unknown variant)."""


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


def check_override_keys(argv: list[str]) -> None:
    """Fail with a clear message (and suggestions) when a `--config.<key>=...` names no config field, or when
    argv has a bare `key=value` (Hydra/verl style), which absl would silently ignore.

    ml_collections rejects unknown keys too, but with a bare `AttributeError: "'key'"` traceback.

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


def has_config_flag(argv: list[str]) -> bool:
    """Whether argv names a job config (`--config=path[:variant]` or `--config path`) or asks for help."""
    return _config_spec(argv) is not None or any(a in _HELP_FLAGS for a in argv[1:])


def none_override_keys(argv: list[str]) -> list[str]:
    """The keys of `--config.KEY=None` overrides. absl parses the value of a string field as the string 'None';
    `apply_none_overrides` makes them Python None."""
    prefix = f"--{_CONFIG_FLAG}."
    return [a[len(prefix) : -len("=None")] for a in argv[1:] if a.startswith(prefix) and a.endswith("=None")]


def apply_none_overrides(cfg, keys: list[str]) -> None:
    """Set each `keys` field of `cfg` to None (`--config.KEY=None`). Raises ConfigError naming a field that
    cannot be None (a number or a flag)."""
    for key in keys:
        *path, leaf = key.split(".")
        node = cfg
        for part in path:
            node = node[part]
        try:
            with node.unlocked() if hasattr(node, "unlocked") else contextlib.nullcontext():
                node[leaf] = None
        except (TypeError, KeyError) as e:
            raise ConfigError(f"config.{key}=None: this field cannot be None ({e})") from e
