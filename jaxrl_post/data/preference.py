"""Preference pairs (TRL's `prompt` / `chosen` / `rejected`) -> token ids, for DPO and reward-model training.

Public API (stable; the DPO trainer and the Bradley-Terry reward model both use it):

* `PreferencePair`: one tokenized pair: `prompt_ids [P]`, `chosen_ids [C]`, `rejected_ids [R]` (`int32` numpy,
  C, R >= 1; each completion ends with the eos / end-of-turn token) and `where` ("<file>, row <i> (line <n>)").
* `load_preference_pairs(files, tokenizer, **options) -> PreferenceData` (a list of pairs + counts): the rows of
  comma-separated .jsonl / .json / .parquet files; `tokenize_pairs(items, tokenizer, **options)` does the same
  for `(where, row)` items; `pair_ids(tokenizer, row)` tokenizes one row.
* `collate_pairs(pairs, max_length=None, pad_id=0) -> dict`: a right-padded batch `[2B, T]`, rows 0..B-1 the
  `prompt + chosen` sequences and rows B..2B-1 the `prompt + rejected` ones (TRL's `DataCollatorForPreference`
  order): `input_ids`, `attention_mask` (1 = a real token), `positions` (0, 1, ... per row) and `loss_mask`
  (1 = a completion token; token t is predicted from the tokens before it; TRL's `completion_mask`), all int32.

Row formats (TRL preference datasets; detected per row):

* standard, explicit prompt: ``{"prompt": "The sky is", "chosen": " blue.", "rejected": " green."}``; no chat
  template: ``tok(prompt)`` (with the tokenizer's special tokens), then ``tok(completion) + eos`` for each
  completion (TRL appends the eos token to completions that do not end with it).
* conversational, explicit prompt: ``{"prompt": [messages], "chosen": [assistant message(s)], "rejected": [...]}``;
  prompt ids = the chat template of the prompt with the generation prompt; each completion = the template of
  ``prompt + completion`` after the prompt's ids, up to and including the last end-of-turn token
  (`models.tokenizer.eos_token_ids`) of its last assistant turn: ChatML's newline after ``<|im_end|>`` is the
  template's, not the model's answer, and is left out (TRL keeps it; SFT (`data/sft.py`) leaves it out too).
* implicit prompt (either of the above without ``prompt``): ``chosen`` / ``rejected`` are whole texts or
  conversations; the prompt is their longest common prefix (TRL ``extract_prompt``: whole messages for
  conversations; characters for strings, a space just before the split going to the completions).

Prompt and completion are tokenized separately and concatenated (as `data/sft.py`), so the boundary is exact;
a chat template whose render of the prompt is not a prefix of the render of ``prompt + completion`` is an error
naming the row (TRL instead starts the completion where the two diverge and warns).

Lengths (TRL `DPOConfig.max_length` / `truncation_mode`, plus the older TRL `max_prompt_length`):
``max_prompt_length`` bounds the prompt, ``max_length`` bounds ``prompt + chosen`` and ``prompt + rejected``.
``truncation='error'`` (default): a longer pair is an error naming the row; ``'keep_start'``: the prompt keeps
its last `max_prompt_length` tokens and the completions keep their first `max_length - P` tokens (TRL
``keep_start``); ``'keep_end'``: the prompt keeps its last tokens and is cut from the left until the longest
completion fits (a completion longer than `max_length - 1` is still an error). ``filter_overlong`` skips and
counts such pairs instead (whatever `truncation`).

Errors (`MalformedRowError` naming file and row; ``skip_malformed=True`` skips and counts instead): a missing
``chosen`` / ``rejected``, wrong types (a string prompt with conversational completions, ...), an empty
completion or one without an assistant turn, chosen equal to rejected (as text or as token ids), an empty
prompt, invalid JSON, an overlong pair (above).

Sources: TRL ``DPOTrainer._prepare_dataset`` (1.16: eos appended, prompt/completion ids, dropped prompts that fill
`max_length`), ``DataCollatorForPreference`` (chosen rows then rejected rows, right padding, completion mask),
``trl.data_utils.extract_prompt``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from jaxrl_post.data.rows import SKIP_MALFORMED_HINT, MalformedRowError
from jaxrl_post.data.sft import _check_messages, _plain_ids, _raw_items, conversation_ids_and_mask

__all__ = [
    "PREFERENCE_BATCH_KEYS",
    "PreferenceData",
    "PreferencePair",
    "TRUNCATIONS",
    "collate_pairs",
    "extract_prompt",
    "load_preference_pairs",
    "pair_ids",
    "tokenize_pairs",
]

log = logging.getLogger(__name__)

TRUNCATIONS = ("error", "keep_start", "keep_end")
PREFERENCE_BATCH_KEYS = ("input_ids", "attention_mask", "positions", "loss_mask")


@dataclasses.dataclass(frozen=True)
class PreferencePair:
    """One tokenized preference pair: `prompt_ids [P]`, `chosen_ids [C]`, `rejected_ids [R]` int32 (P >= 1;
    C, R >= 1, ending with eos / end-of-turn unless truncated), `where`, the row's origin, and `margin`, the
    row's optional numeric `margin` column (TRL `RewardTrainer`'s per-pair margin; None without one)."""

    prompt_ids: np.ndarray
    chosen_ids: np.ndarray
    rejected_ids: np.ndarray
    where: str = ""
    margin: float | None = None


@dataclasses.dataclass
class PreferenceData:
    """Tokenized pairs and their counts (`stats`: `data/num_pairs`, `data/num_skipped_malformed`,
    `data/num_filtered_overlong`, `data/num_truncated`)."""

    pairs: list[PreferencePair]
    stats: dict[str, int]

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, i: int) -> PreferencePair:
        return self.pairs[i]


# ------------------------------------------------------------------------------------------ one row
def extract_prompt(chosen, rejected) -> tuple[Any, Any, Any]:
    """(prompt, chosen, rejected) from two whole texts / conversations sharing a prefix (TRL `extract_prompt`):
    the longest common prefix of messages (conversations) or characters (strings; a space just before the
    split goes to the completions)."""
    k = 0
    while k < min(len(chosen), len(rejected)) and chosen[k] == rejected[k]:
        k += 1
    if isinstance(chosen, str) and k > 0 and chosen[k - 1] == " ":
        k -= 1
    return chosen[:k], chosen[k:], rejected[k:]


def _completion_after(tokenizer, prompt_msgs, prompt_ids, completion, what: str, end_ids) -> list[int]:
    """Ids of `completion` (messages) after the rendered prompt, through the last assistant turn's end token."""
    msgs = _check_messages(completion, repr(what))
    trained = [len(prompt_msgs) + j for j, m in enumerate(msgs) if m["role"] == "assistant"]
    if not trained:
        raise ValueError(f"no assistant turn in {what!r} (roles {[m['role'] for m in msgs]})")
    if any(not m["content"].strip() for m in msgs if m["role"] == "assistant"):
        raise ValueError(f"empty completion ({what!r} has an empty assistant turn)")
    ids, mask = conversation_ids_and_mask(tokenizer, prompt_msgs + msgs, trained, end_ids)
    if ids[: len(prompt_ids)] != prompt_ids:
        raise ValueError(
            f"the chat template renders the prompt differently alone than followed by {what!r} (not a prefix), "
            "so the completion boundary is ambiguous"
        )
    hi = int(np.flatnonzero(mask)[-1]) + 1
    return ids[len(prompt_ids) : hi]


def pair_ids(tokenizer, row: dict[str, Any]) -> tuple[list[int], list[int], list[int]]:
    """(prompt_ids, chosen_ids, rejected_ids) `list[int]` of one preference row (formats: module docstring).

    Raises ValueError (reason only; the caller adds file and row): not an object, a missing key, wrong types,
    an empty prompt or completion, no assistant turn, chosen == rejected, a template that is not append-only.
    """
    # here, not at the top: jaxrl_post.data imports without jax (data scripts, grain workers)
    from jaxrl_post.models.tokenizer import apply_chat_template, eos_token_ids

    if not isinstance(row, dict):
        raise ValueError(f"a row must be a JSON object, got {type(row).__name__}")
    missing = [k for k in ("chosen", "rejected") if k not in row]
    if missing:
        raise ValueError(
            f"missing {' and '.join(repr(k) for k in missing)} (keys {sorted(row)}): a preference row has 'chosen' "
            "and 'rejected', and 'prompt' unless it is implicit (their common prefix)"
        )
    chosen, rejected = row["chosen"], row["rejected"]
    for k, v in (("chosen", chosen), ("rejected", rejected)):
        if hasattr(v, "tolist"):  # numpy arrays from parquet
            v = v.tolist()
        if not isinstance(v, (str, list)):
            raise ValueError(f"{k!r} must be a string or a list of messages, got {type(v).__name__}")
    chosen = chosen.tolist() if hasattr(chosen, "tolist") else chosen
    rejected = rejected.tolist() if hasattr(rejected, "tolist") else rejected
    if "prompt" in row:
        prompt = row["prompt"]
        prompt = prompt.tolist() if hasattr(prompt, "tolist") else prompt
    else:
        if type(chosen) is not type(rejected):
            raise ValueError("'chosen' and 'rejected' must both be strings or both lists of messages")
        prompt, chosen, rejected = extract_prompt(chosen, rejected)
        if not prompt:
            raise ValueError("no 'prompt' and 'chosen' / 'rejected' share no prefix (the implicit prompt is empty)")
    kinds = {type(x).__name__ for x in (prompt, chosen, rejected)}
    if kinds not in ({"str"}, {"list"}):
        raise ValueError(
            "'prompt', 'chosen' and 'rejected' must all be strings or all lists of messages, got "
            f"{type(prompt).__name__}, {type(chosen).__name__} and {type(rejected).__name__}"
        )
    if chosen == rejected:
        raise ValueError("'chosen' equals 'rejected' (no preference to learn)")
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("empty 'prompt'")
        for k, v in (("chosen", chosen), ("rejected", rejected)):
            if not v.strip():
                raise ValueError(f"empty completion ({k!r})")
        eos = tokenizer.eos_token_id
        p = _plain_ids(tokenizer, prompt, True)
        out = []
        for v in (chosen, rejected):
            c = _plain_ids(tokenizer, v, False)
            out.append(c + ([eos] if eos is not None and (not c or c[-1] != eos) else []))
        c_ids, r_ids = out
    else:
        p_msgs = _check_messages(prompt, "'prompt'")
        p = apply_chat_template(tokenizer, p_msgs, add_generation_prompt=True)
        end_ids = set(eos_token_ids(tokenizer))
        c_ids = _completion_after(tokenizer, p_msgs, p, chosen, "chosen", end_ids)
        r_ids = _completion_after(tokenizer, p_msgs, p, rejected, "rejected", end_ids)
    if not p:
        raise ValueError("the prompt tokenizes to no tokens")
    if c_ids == r_ids:
        raise ValueError("'chosen' and 'rejected' tokenize to the same ids (no preference to learn)")
    return p, c_ids, r_ids


# ------------------------------------------------------------------------------------------ lengths
def _fit(p, c, r, *, max_length, max_prompt_length, truncation) -> tuple[list, list, list, bool]:
    """The pair cut to the budget (module docstring), whether it was cut; ValueError('overlong: ...') when it
    does not fit and cannot be cut."""
    cut = False
    if max_prompt_length is not None and len(p) > max_prompt_length:
        if truncation == "error":
            raise ValueError(f"overlong: the prompt has {len(p)} tokens > data.max_prompt_length={max_prompt_length}")
        p, cut = p[-max_prompt_length:], True
    longest = len(p) + max(len(c), len(r))
    if longest > max_length:
        if truncation == "error":
            raise ValueError(f"overlong: prompt + completion = {longest} tokens > data.max_length={max_length}")
        if truncation == "keep_start":
            if len(p) >= max_length:
                raise ValueError(
                    f"overlong: the prompt alone has {len(p)} tokens >= data.max_length={max_length} (keep_start "
                    "would keep no completion token)"
                )
            c, r = c[: max_length - len(p)], r[: max_length - len(p)]
        else:  # keep_end: cut the prompt from the left
            need = max(len(c), len(r))
            if need > max_length - 1:
                raise ValueError(
                    f"overlong: a completion of {need} tokens leaves no prompt token within data.max_length="
                    f"{max_length} (keep_end)"
                )
            p = p[len(p) - (max_length - need) :]
        cut = True
        if c == r:
            raise ValueError("'chosen' and 'rejected' are equal after truncation to data.max_length")
    return p, c, r, cut


def _margin(row) -> float | None:
    """The row's `margin` (a finite number) or None. Raises ValueError for a non-numeric or non-finite one."""
    if not isinstance(row, dict) or row.get("margin") is None:
        return None
    m = row["margin"]
    if isinstance(m, bool) or not isinstance(m, (int, float, np.integer, np.floating)) or not np.isfinite(m):
        raise ValueError(f"'margin' must be a finite number, got {m!r}")
    return float(m)


def tokenize_pairs(
    items: Iterable[tuple[str, Any]],
    tokenizer,
    *,
    max_length: int,
    max_prompt_length: int | None = None,
    truncation: str = "error",
    filter_overlong: bool = False,
    skip_malformed: bool = False,
) -> PreferenceData:
    """Tokenize `(where, row)` items (`where`: "<file>, row <i> (line <n>)"; a row may be an Exception, e.g. a
    JSON error, reported at `where`) into `PreferenceData`.

    Raises:
      MalformedRowError: naming `where`: a malformed row (`pair_ids`; unless `skip_malformed`), an overlong
        pair that `truncation` cannot cut (unless `filter_overlong`).
      ValueError: a bad `truncation`, `max_length` < 2 or `max_prompt_length` < 1.
    """
    if truncation not in TRUNCATIONS:
        raise ValueError(f"data.truncation must be one of {TRUNCATIONS} for preference data, got {truncation!r}")
    if int(max_length) < 2:
        raise ValueError(f"data.max_length must be >= 2, got {max_length}")
    if max_prompt_length is not None and int(max_prompt_length) < 1:
        raise ValueError(f"data.max_prompt_length must be >= 1 or None, got {max_prompt_length}")
    pairs: list[PreferencePair] = []
    skipped = filtered = truncated = 0
    for where, row in items:
        try:
            if isinstance(row, Exception):
                raise ValueError(str(row))
            p, c, r = pair_ids(tokenizer, row)
            margin = _margin(row)
        except (ValueError, KeyError, TypeError) as e:
            if not skip_malformed:
                raise MalformedRowError(f"{where}: malformed preference row: {e}. {SKIP_MALFORMED_HINT}") from e
            skipped += 1
            if skipped <= 5:
                log.warning("skipping malformed preference row at %s: %s", where, e)
            continue
        try:
            p, c, r, cut = _fit(
                p, c, r, max_length=int(max_length), max_prompt_length=max_prompt_length, truncation=truncation
            )
        except ValueError as e:
            if filter_overlong:
                filtered += 1
                continue
            raise MalformedRowError(
                f"{where}: {e}; raise data.max_length / data.max_prompt_length, set data.truncation='keep_start' or "
                "'keep_end', or data.filter_overlong=True (skip and count such pairs)"
            ) from e
        truncated += int(cut)
        pairs.append(PreferencePair(*(np.asarray(x, np.int32) for x in (p, c, r)), where=where, margin=margin))
    stats = {
        "data/num_pairs": len(pairs),
        "data/num_skipped_malformed": skipped,
        "data/num_filtered_overlong": filtered,
        "data/num_truncated": truncated,
    }
    return PreferenceData(pairs, stats)


def load_preference_pairs(files: str | Sequence[str], tokenizer, **kw) -> PreferenceData:
    """`tokenize_pairs` over the rows of `files` (a list of paths or one comma-separated string of .jsonl /
    .json / .parquet files); `kw`: `tokenize_pairs`' options.

    Raises FileNotFoundError naming a missing file, plus what `tokenize_pairs` raises.
    """
    paths = [s.strip() for s in str(files).split(",")] if isinstance(files, str) else [str(f) for f in files]
    paths = [p for p in paths if p]
    if not paths:
        raise FileNotFoundError(f"no data files given ({files!r})")
    for p in paths:
        if not os.path.exists(p):
            raise FileNotFoundError(f"data file not found: {p}")

    def items():
        for p in paths:
            yield from _raw_items(p)

    return tokenize_pairs(items(), tokenizer, **kw)


# ------------------------------------------------------------------------------------------ batch
def collate_pairs(
    pairs: Sequence[PreferencePair], max_length: int | None = None, pad_id: int = 0
) -> dict[str, np.ndarray]:
    """The right-padded `[2B, T] int32` arrays of `PREFERENCE_BATCH_KEYS` for B pairs: row i = prompt + chosen
    of pair i, row B + i = prompt + rejected of pair i (TRL `DataCollatorForPreference` order). `T` =
    `max_length`, or the longest sequence when None. `loss_mask[r, t] = 1`: token t of row r is a completion
    token. Raises ValueError when a sequence is longer than `max_length` or `pairs` is empty."""
    if not pairs:
        raise ValueError("collate_pairs: no pairs")
    seqs = [(x.prompt_ids, x.chosen_ids) for x in pairs] + [(x.prompt_ids, x.rejected_ids) for x in pairs]
    longest = max(len(p) + len(c) for p, c in seqs)
    t = longest if max_length is None else int(max_length)
    if longest > t:
        raise ValueError(f"collate_pairs: a sequence of {longest} tokens does not fit max_length={t}")
    out = {k: np.zeros((len(seqs), t), np.int32) for k in PREFERENCE_BATCH_KEYS}
    out["input_ids"][:] = pad_id
    for i, (p, c) in enumerate(seqs):
        n = len(p) + len(c)
        out["input_ids"][i, :n] = np.concatenate([p, c])
        out["attention_mask"][i, :n] = 1
        out["positions"][i, :n] = np.arange(n)
        out["loss_mask"][i, len(p) : n] = 1
    return out
