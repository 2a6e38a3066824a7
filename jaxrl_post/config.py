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
