"""SFT rows -> token ids + loss mask, in the formats users have (TRL and verl).

Row formats (`detect_format`, or forced with `data.format`):

* ``messages`` (TRL conversational language modeling): ``{"messages": [{"role", "content"}, ...]}``; the
  loss is on every assistant turn. The key is `data.messages_key`.
* ``prompt_completion`` (TRL prompt-completion): ``{"prompt": ..., "completion": ...}``, either both plain
  strings (no chat template, as TRL: ``tok(prompt)`` then ``tok(completion) + eos``) or both conversational
  lists (``prompt + completion`` rendered with the chat template, loss on the completion's assistant turns).
* ``prompt_response`` (verl SFT, `data.prompt_key` / `data.response_key`, e.g. GSM8K ``question`` /
  ``answer``): the prompt as one user turn through the chat template with the generation prompt, then the
  response text + eos (verl ``SFTDataset``); loss on the response + eos.

Assistant spans of a conversation come from rendering prefixes (``render(messages[:i])`` with the
generation prompt vs ``render(messages[:i + 1])``) and checking that the template is append-only on token
ids (every prefix's ids are a prefix of the whole conversation's ids); a template that rewrites earlier turns
(e.g. one that drops past reasoning) is reported, naming the row. A span ends at its last end-of-turn token
(`models.tokenizer.eos_token_ids`): ChatML's newline after ``<|im_end|>`` belongs to the template, not to the
model's answer, and is not trained.

Prompt and completion are tokenized separately and concatenated (verl), so the mask boundary is exact
(TRL tokenizes ``prompt + completion`` jointly and warns when the prompt's ids are not a prefix).

Errors (`MalformedRowError`, naming file and row, unless `skip_malformed`): no assistant turn, an empty
completion / response, an unknown row format; a sequence longer than `max_length` with
``truncation='error'`` (``'right'`` keeps the first `max_length` tokens; ``filter_overlong`` skips and counts).

Sources: TRL ``SFTTrainer`` dataset formats and ``completion_only_loss`` / ``assistant_only_loss``; verl
``SFTDataset`` / ``MultiTurnSFTDataset`` (prompt_key, response_key, max_length, truncation).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxrl_post.data.rows import SKIP_MALFORMED_HINT, MalformedRowError, _BadLine, _file_items

log = logging.getLogger(__name__)

FORMATS = ("auto", "messages", "prompt_completion", "prompt_response")
TRUNCATIONS = ("error", "right")


@dataclasses.dataclass(frozen=True)
class SFTKeys:
    """Which row keys hold what (verl `data.messages_key`, `data.prompt_key`, `data.response_key`)."""

    messages_key: str = "messages"
    prompt_key: str = "prompt"
    response_key: str = "response"


@dataclasses.dataclass
class SFTData:
    """Tokenized examples: `input_ids[i]` and `loss_mask[i]` `[T_i] int32` (1 = a trained token: its id is
    predicted from the tokens before it), `where[i]` the row's origin, and counts (`stats`, `data/*` names)."""

    input_ids: list[np.ndarray]
    loss_mask: list[np.ndarray]
    where: list[str]
    stats: dict[str, int]

    def __len__(self) -> int:
        return len(self.input_ids)


def detect_format(row: dict[str, Any], keys: SFTKeys) -> str:
    """The row's format: 'messages', 'prompt_completion' or 'prompt_response'. Raises ValueError naming the
    keys the row has when none fits."""
    if not isinstance(row, dict):
        raise ValueError(f"a row must be a JSON object, got {type(row).__name__}")
    if keys.messages_key in row:
        return "messages"
    if "prompt" in row and "completion" in row:
        return "prompt_completion"
    if keys.prompt_key in row and keys.response_key in row:
        return "prompt_response"
    raise ValueError(
        f"unknown SFT row format (keys {sorted(row)}): expected {keys.messages_key!r} (conversational), "
        f"'prompt' + 'completion' (TRL), or {keys.prompt_key!r} + {keys.response_key!r} (verl; set "
        "data.prompt_key / data.response_key)"
    )


def _check_messages(messages: Any, what: str) -> list[dict[str, str]]:
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{what} must be a non-empty list of {{role, content}} messages")
    for j, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ValueError(f"{what}[{j}] must be a {{'role': str, 'content': str}} message, got {m!r}"[:300])
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def conversation_ids_and_mask(tokenizer, messages: Sequence[dict], trained: Sequence[int], eos_ids) -> tuple:
    """Token ids of `messages` through the chat template and a mask of the assistant turns `trained`
    (message indices), both `list[int]`.

    Raises ValueError when the template is not append-only on token ids at a trained turn (its span would
    be ambiguous) or renders a trained turn as no tokens.
    """
    # here, not at the top: jaxrl_post.data imports without jax (data scripts, grain workers)
    from jaxrl_post.models.tokenizer import apply_chat_template

    ids = apply_chat_template(tokenizer, messages, add_generation_prompt=False)
    mask = [0] * len(ids)
    for i in trained:
        before = apply_chat_template(tokenizer, messages[:i], add_generation_prompt=True) if i else []
        upto = apply_chat_template(tokenizer, messages[: i + 1], add_generation_prompt=False)
        if ids[: len(before)] != before or ids[: len(upto)] != upto or len(upto) < len(before):
            raise ValueError(
                f"the chat template is not append-only at message {i} (rendering the conversation up to it does "
                "not give a prefix of the whole conversation's tokens), so its assistant span is ambiguous"
            )
        lo, hi = len(before), len(upto)
        ends = [k for k in range(lo, hi) if ids[k] in eos_ids]
        if ends:
            hi = ends[-1] + 1  # train through the end-of-turn token, not the template's separator after it
        if hi <= lo:
            raise ValueError(f"assistant message {i} renders as no tokens")
        mask[lo:hi] = [1] * (hi - lo)
    return ids, mask


def _plain_ids(tokenizer, text: str, special: bool) -> list[int]:
    return [int(t) for t in tokenizer(text, add_special_tokens=special)["input_ids"]]


def row_ids_and_mask(tokenizer, row: dict[str, Any], fmt: str, keys: SFTKeys) -> tuple[list[int], list[int]]:
    """(input_ids, loss_mask) `list[int]` of one row in format `fmt` (see the module docstring).

    Raises ValueError (reason only; the caller adds file and row): wrong types, no assistant turn, empty
    completion / response, a template that is not append-only.
    """
    # here, not at the top: jaxrl_post.data imports without jax (data scripts, grain workers)
    from jaxrl_post.models.tokenizer import eos_token_ids

    fmt = detect_format(row, keys) if fmt == "auto" else fmt
    eos = tokenizer.eos_token_id
    end_ids = set(eos_token_ids(tokenizer))
    if fmt == "messages":
        if keys.messages_key not in row:
            raise ValueError(f"no {keys.messages_key!r} key (data.format='messages')")
        msgs = _check_messages(row[keys.messages_key], repr(keys.messages_key))
        trained = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
        if not trained:
            raise ValueError(f"no assistant turn in {keys.messages_key!r} (roles {[m['role'] for m in msgs]})")
        if any(not msgs[i]["content"].strip() for i in trained):
            raise ValueError("an assistant turn has empty content")
        return conversation_ids_and_mask(tokenizer, msgs, trained, end_ids)
    if fmt == "prompt_completion":
        prompt, completion = row.get("prompt"), row.get("completion")
        if isinstance(prompt, str) and isinstance(completion, str):
            if not completion.strip():
                raise ValueError("empty completion")
            p = _plain_ids(tokenizer, prompt, True)
            c = _plain_ids(tokenizer, completion, False)
            c = c + ([eos] if eos is not None and (not c or c[-1] != eos) else [])
            return p + c, [0] * len(p) + [1] * len(c)
        if isinstance(prompt, list) and isinstance(completion, list):
            p, c = _check_messages(prompt, "'prompt'"), _check_messages(completion, "'completion'")
            trained = [len(p) + j for j, m in enumerate(c) if m["role"] == "assistant"]
            if not trained:
                raise ValueError("no assistant turn in 'completion'")
            if any(not m["content"].strip() for m in c if m["role"] == "assistant"):
                raise ValueError("empty completion")
            return conversation_ids_and_mask(tokenizer, p + c, trained, end_ids)
        raise ValueError(
            "'prompt' and 'completion' must both be strings or both lists of messages, got "
            f"{type(prompt).__name__} and {type(completion).__name__}"
        )
    if fmt == "prompt_response":
        # here, not at the top: jaxrl_post.data imports without jax (data scripts, grain workers)
        from jaxrl_post.models.tokenizer import apply_chat_template

        prompt, response = row.get(keys.prompt_key), row.get(keys.response_key)
        if not isinstance(prompt, str) or not isinstance(response, str):
            raise ValueError(
                f"{keys.prompt_key!r} and {keys.response_key!r} must be strings, got "
                f"{type(prompt).__name__} and {type(response).__name__}"
            )
        if not response.strip():
            raise ValueError(f"empty response ({keys.response_key!r})")
        p = apply_chat_template(tokenizer, [{"role": "user", "content": prompt}], add_generation_prompt=True)
        r = _plain_ids(tokenizer, response, False) + ([eos] if eos is not None else [])
        return p + r, [0] * len(p) + [1] * len(r)
    raise ValueError(f"unknown data.format {fmt!r}; expected one of {FORMATS}")


def tokenize_rows(
    items,
    tokenizer,
    *,
    fmt: str = "auto",
    keys: SFTKeys = SFTKeys(),
    max_length: int,
    truncation: str = "error",
    filter_overlong: bool = False,
    skip_malformed: bool = False,
) -> SFTData:
    """Tokenize `(where, row)` items (`where`: "<file>, row <i>") into `SFTData`.

    Returns stats `data/num_examples`, `data/num_skipped_malformed`, `data/num_filtered_overlong`,
    `data/num_truncated`, `data/num_loss_tokens`.

    Raises:
      MalformedRowError: naming `where` (unless `skip_malformed`): a malformed row (see `row_ids_and_mask`); a
        sequence longer than `max_length` with truncation='error' and not `filter_overlong`; a row truncated
        to no trained token.
      ValueError: a bad `fmt` / `truncation` / `max_length`.
    """
    if fmt not in FORMATS:
        raise ValueError(f"data.format must be one of {FORMATS}, got {fmt!r}")
    if truncation not in TRUNCATIONS:
        raise ValueError(f"data.truncation must be one of {TRUNCATIONS} for SFT, got {truncation!r}")
    if int(max_length) < 2:
        raise ValueError(f"data.max_length must be >= 2, got {max_length}")
    ids_out, mask_out, where_out = [], [], []
    skipped = filtered = truncated = 0
    for where, row in items:
        try:
            if isinstance(row, Exception):
                raise ValueError(str(row))
            ids, mask = row_ids_and_mask(tokenizer, row, fmt, keys)
            if len(ids) > max_length:
                if filter_overlong:
                    filtered += 1
                    continue
                if truncation == "error":
                    raise MalformedRowError(
                        f"{where}: {len(ids)} tokens > data.max_length={max_length}; raise data.max_length, set "
                        "data.truncation='right' (keep the first max_length tokens) or data.filter_overlong=True "
                        "(skip and count such rows)"
                    )
                ids, mask = ids[:max_length], mask[:max_length]
                truncated += 1
                if not any(mask[1:]):
                    raise ValueError(f"no trained token left after truncation to data.max_length={max_length}")
            if mask[0]:
                raise ValueError("the first token is marked for the loss (nothing before it predicts it)")
        except MalformedRowError:
            raise
        except (ValueError, KeyError, TypeError) as e:
            if not skip_malformed:
                raise MalformedRowError(f"{where}: malformed SFT row: {e}. {SKIP_MALFORMED_HINT}") from e
            skipped += 1
            if skipped <= 5:
                log.warning("skipping malformed SFT row at %s: %s", where, e)
            continue
        ids_out.append(np.asarray(ids, np.int32))
        mask_out.append(np.asarray(mask, np.int32))
        where_out.append(where)
    stats = {
        "data/num_examples": len(ids_out),
        "data/num_skipped_malformed": skipped,
        "data/num_filtered_overlong": filtered,
        "data/num_truncated": truncated,
        "data/num_loss_tokens": int(sum(int(m.sum()) for m in mask_out)),
    }
    return SFTData(ids_out, mask_out, where_out, stats)


def _raw_items(path: str):
    for where, raw in _file_items(path):
        yield where, (ValueError(raw.err) if isinstance(raw, _BadLine) else raw)


def load_sft_data(spec: str, tokenizer, **kw) -> SFTData:
    """`tokenize_rows` over the rows of comma-separated .jsonl / .json / .parquet files (`spec`).

    Raises FileNotFoundError naming a missing file, plus what `tokenize_rows` raises.
    """
    import os

    paths = [s.strip() for s in str(spec).split(",") if s.strip()]
    if not paths:
        raise FileNotFoundError(f"no data files given ({spec!r})")
    for p in paths:
        if not os.path.exists(p):
            raise FileNotFoundError(f"data file not found: {p}")

    def items():
        for p in paths:
            yield from _raw_items(p)

    return tokenize_rows(items(), tokenizer, **kw)
