"""Tokenizer helpers: load (HF dir or GGUF), chat template with exactly one BOS, stop-token ids.

Tokenizers come from ``transformers``: ``AutoTokenizer`` for an HF directory, and for a GGUF file
:func:`gguf_tokenizer`, which builds the same tokenizer as ``AutoTokenizer.from_pretrained(dir,
gguf_file=...)`` without importing torch (transformers' own GGUF path parses the file with a torch-based
reader; nothing at run time here may need torch).

The double-BOS problem: many chat templates render ``{{ bos_token }}`` themselves (Llama 3, Gemma), and
tokenizers of those models also prepend BOS when encoding with special tokens, giving ``<bos><bos>...``.
:func:`apply_chat_template` renders the template to text, tokenizes it *without* special tokens, and then
adds BOS only if the model's tokenizer would prepend one and the template did not, so the result
starts with exactly one BOS for models that use one and with none for models that do not.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Sequence
from typing import Any

from jaxrl_post.models.gguf_io import gguf_metadata
from jaxrl_post.models.resolve import resolve_model_path

__all__ = [
    "load_tokenizer",
    "gguf_tokenizer",
    "render_chat",
    "apply_chat_template",
    "tokenizer_adds_bos",
    "eos_token_ids",
    "END_OF_TURN_TOKENS",
]

log = logging.getLogger(__name__)

# Special tokens that end an assistant turn (or the text) in the chat formats of the supported families:
# ChatML (SmolLM2, Qwen), Llama 3, Gemma. Included in `eos_token_ids` when the vocabulary has them.
END_OF_TURN_TOKENS = (
    "<|im_end|>",  # ChatML: SmolLM2-Instruct, Qwen2/2.5/3
    "<|endoftext|>",  # Qwen / SmolLM2 end of text
    "<|eot_id|>",  # Llama 3 end of turn
    "<|eom_id|>",  # Llama 3.1 end of message (tool calls)
    "<|end_of_text|>",  # Llama 3 end of text
    "<end_of_turn>",  # Gemma
    "<eos>",  # Gemma end of text
)

# `AutoTokenizer`'s special-token kwarg -> GGUF metadata key `tokenizer.ggml.<key>` holding its id
# (as in transformers.integrations.gguf.gguf_tokenizer_mapping._SPECIAL_TOKENS).
_GGUF_SPECIAL_TOKEN_KEYS = {
    "bos_token": "bos_token_id",
    "eos_token": "eos_token_id",
    "unk_token": "unknown_token_id",
    "pad_token": "padding_token_id",
}

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")


def _has_tokenizer_files(directory: str) -> bool:
    return any(os.path.exists(os.path.join(directory, f)) for f in _TOKENIZER_FILES)


def load_tokenizer(path_or_name: str | os.PathLike, *, missing_ok: bool = False):
    """Load a ``transformers`` tokenizer and make sure it has a pad token.

    Args:
      path_or_name: an HF directory, a ``.gguf`` file, or anything ``resolve_model_path`` accepts
        (alias ``smollm2-135m-instruct``, HF hub id).
      missing_ok: for an HF directory without tokenizer files, return None instead of raising.
    Returns: a ``transformers`` tokenizer. If it has no pad token, ``pad_token`` is set to the EOS token
      (the usual choice for decoder-only models, as verl does; padding positions are masked everywhere,
      so the id only has to be a valid one).
    A ``.gguf`` goes through :func:`gguf_tokenizer` (no torch); an HF directory through
    ``transformers.AutoTokenizer``.

    Raises:
      FileNotFoundError: a directory without tokenizer files (unless ``missing_ok``), or a missing path.
      ValueError / RuntimeError: from ``resolve_model_path`` for unknown names or unreachable hub ids;
        from :func:`gguf_tokenizer` for a GGUF without a usable vocabulary.
    """
    from transformers import AutoTokenizer

    kind, path = resolve_model_path(path_or_name)
    if kind == "gguf":
        tok = gguf_tokenizer(path)
    else:
        if not _has_tokenizer_files(path):
            if missing_ok:
                return None
            raise FileNotFoundError(f"{path} has no tokenizer files (looked for {', '.join(_TOKENIZER_FILES)})")
        tok = AutoTokenizer.from_pretrained(path)
    if tok.pad_token is None:
        if tok.eos_token is None:
            raise ValueError(f"tokenizer from {path} has neither a pad nor an eos token")
        tok.pad_token = tok.eos_token
        log.info("tokenizer has no pad token; using eos %r as pad", tok.eos_token)
    return tok


def gguf_tokenizer(path: str | os.PathLike):
    """The tokenizer a GGUF file describes, equal to ``AutoTokenizer.from_pretrained(dir, gguf_file=...)``.

    Built without torch from the file's metadata (read with the ``gguf`` package through
    ``gguf_io.gguf_metadata``): vocabulary, merges and token types (``tokenizer.ggml.*``), the special
    tokens from the ``tokenizer.ggml.{bos,eos,unknown,padding}_token_id`` ids, ``add_bos_token`` /
    ``add_eos_token``, and the chat template (``tokenizer.chat_template``). The backend tokenizer
    (normalizer, pre-tokenizer, decoder, control tokens as special tokens, user-defined tokens as added
    tokens) comes from transformers' torch-free ``convert_gguf_tokenizer``; the result is wrapped in
    ``transformers.PreTrainedTokenizerFast``.

    Source: transformers ``integrations/gguf/gguf_tokenizer_mapping.py::get_gguf_tokenizer`` (which reads
    the file with ``integrations/gguf/reader.py``, a module that imports torch) and
    ``TokenizersBackend.__init__``'s ``gguf_file`` branch; the metadata grouping, the llama/gemma4
    ``add_bos_token`` rules and the special-token lookup are theirs, repeated here. The pad token is the
    file's (``padding_token_id``) and may be None; :func:`load_tokenizer` fills it in.

    Args:
      path: a ``.gguf`` file.
    Returns: ``transformers.PreTrainedTokenizerFast``; ``len(tok)`` is the GGUF vocabulary size (special
      tokens are vocabulary entries, so none are appended).
    Raises:
      FileNotFoundError: ``path`` does not exist.
      ValueError: the file has no ``tokenizer.ggml.tokens``, or names a tokenizer model transformers
        cannot build (``tokenizer.ggml.model`` not in its builders).
      ImportError: transformers older than 5.23 (``pyproject.toml`` requires ``>=5.23``; earlier versions
        lack the torch-free ``integrations.gguf.gguf_tokenizer_mapping`` or build llama-type files differently).
    """
    import transformers
    from transformers import PreTrainedTokenizerFast

    try:  # transformers >= 5.18; the add_bos_token rules below match its GGUF tokenizer from 5.23 on
        from transformers.integrations.gguf.gguf_tokenizer_mapping import (
            GGUF_TOKENIZER_MAPPING,
            convert_gguf_tokenizer,
        )
    except ImportError as e:
        raise ImportError(
            f"building a tokenizer from a GGUF file without torch needs transformers>=5.23 "
            f"(found {transformers.__version__}): pip install -U 'transformers>=5.23'"
        ) from e

    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file {path} does not exist")
    meta = gguf_metadata(path, include_vocab=True)
    tokenizer_dict, tokenizer_config = (
        {
            name: meta[f"tokenizer.{key}"]
            for key, name in GGUF_TOKENIZER_MAPPING[group].items()
            if f"tokenizer.{key}" in meta
        }
        for group in ("tokenizer", "tokenizer_config")
    )
    if not tokenizer_dict.get("tokens"):
        raise ValueError(f"{path} has no tokenizer vocabulary (metadata key tokenizer.ggml.tokens)")
    tokenizer_type = tokenizer_dict.get("tokenizer_type")
    if tokenizer_type == "llama":  # older sentencepiece files have no flag; llama.cpp adds BOS for them
        tokenizer_config.setdefault("add_bos_token", True)
    elif tokenizer_type == "gemma4":  # the chat template writes <bos> itself
        tokenizer_config["add_bos_token"] = False
    for name, key in _GGUF_SPECIAL_TOKEN_KEYS.items():
        token_id = meta.get(f"tokenizer.ggml.{key}")
        tokenizer_config[name] = tokenizer_dict["tokens"][token_id] if token_id is not None else None
    backend, extra_kwargs = convert_gguf_tokenizer(meta["general.architecture"], tokenizer_dict)
    tokenizer_config.update(extra_kwargs)
    return PreTrainedTokenizerFast(tokenizer_object=backend, name_or_path=path, **tokenizer_config)


def tokenizer_adds_bos(tokenizer) -> bool:
    """True when ``tokenizer(text)`` (with special tokens) prepends ``bos_token_id`` to the text."""
    bos = tokenizer.bos_token_id
    if bos is None:
        return False
    with_special = tokenizer("a", add_special_tokens=True)["input_ids"]
    without = tokenizer("a", add_special_tokens=False)["input_ids"]
    return len(with_special) > 0 and with_special[0] == bos and (not without or without[0] != bos)


def render_chat(tokenizer, messages: Sequence[dict], add_generation_prompt: bool = True, **template_kwargs: Any) -> str:
    """The chat template rendered to text (no tokenization).

    Raises:
      ValueError: the tokenizer has no chat template (a base model); format prompts as plain text.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("tokenizer has no chat_template; use plain-text prompts for this model")
    return tokenizer.apply_chat_template(
        list(messages), tokenize=False, add_generation_prompt=add_generation_prompt, **template_kwargs
    )


def apply_chat_template(
    tokenizer, messages: Sequence[dict], add_generation_prompt: bool = True, **template_kwargs: Any
) -> list[int]:
    """Token ids of ``messages`` rendered with the tokenizer's chat template, with exactly one BOS.

    The rendered text is tokenized with ``add_special_tokens=False`` (so a ``{{ bos_token }}`` in the
    template is the only BOS), then BOS is prepended when the tokenizer normally adds one and the template
    did not; a doubled leading BOS is collapsed. Models without BOS (Qwen) get none. SmolLM2-Instruct's
    ``bos_token`` is ``<|im_start|>`` and its tokenizer adds nothing, so its ids start with the single
    ``<|im_start|>`` the template writes.

    Args:
      tokenizer: a ``transformers`` tokenizer with a chat template.
      messages: ``[{"role": "user"|"system"|"assistant", "content": str}, ...]``.
      add_generation_prompt: append the assistant header (for prompting a response).
      **template_kwargs: passed to the template (e.g. ``enable_thinking=False`` for Qwen3).
    Returns: ``list[int]``.
    Raises: ValueError if the tokenizer has no chat template.
    """
    text = render_chat(tokenizer, messages, add_generation_prompt, **template_kwargs)
    ids = [int(i) for i in tokenizer(text, add_special_tokens=False)["input_ids"]]
    bos = tokenizer.bos_token_id
    if bos is not None:
        if tokenizer_adds_bos(tokenizer) and (not ids or ids[0] != bos):
            ids = [int(bos)] + ids
        while len(ids) >= 2 and ids[0] == bos and ids[1] == bos:
            ids = ids[1:]
    return ids


def _as_id_list(value) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, Iterable):
        return [int(v) for v in value if v is not None]
    return [int(value)]


def eos_token_ids(tokenizer, generation_config=None) -> tuple[int, ...]:
    """Token ids that end a response, in a stable order without duplicates.

    Union of ``generation_config.eos_token_id`` (int or list; a ``GenerationConfig``, an object with that
    attribute, or a dict), ``tokenizer.eos_token_id``, and those of :data:`END_OF_TURN_TOKENS` that are
    single special tokens of this vocabulary (e.g. SmolLM2-Instruct ends turns with ``<|im_end|>``;
    Llama 3 instruct with ``<|eot_id|>`` while its ``eos_token`` may be ``<|end_of_text|>``).

    Returns: ``tuple[int, ...]`` (non-empty unless the tokenizer has no EOS-like token at all).
    """
    ids: list[int] = []
    if generation_config is not None:
        gen_eos = (
            generation_config.get("eos_token_id")
            if isinstance(generation_config, dict)
            else getattr(generation_config, "eos_token_id", None)
        )
        ids += _as_id_list(gen_eos)
    ids += _as_id_list(tokenizer.eos_token_id)
    special = set(getattr(tokenizer, "all_special_tokens", []) or [])
    added = getattr(tokenizer, "get_added_vocab", lambda: {})() or {}
    vocab_unk = tokenizer.unk_token_id
    for tok in END_OF_TURN_TOKENS:
        if tok not in special and tok not in added:
            continue
        tid = tokenizer.convert_tokens_to_ids(tok)
        if tid is None or (vocab_unk is not None and tid == vocab_unk and tok != tokenizer.unk_token):
            continue
        ids.append(int(tid))
    out: list[int] = []
    for i in ids:
        if i not in out:
            out.append(i)
    return tuple(out)
