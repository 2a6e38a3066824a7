"""grain input pipeline: verl rows -> shuffled, left-padded prompt batches as DataProto.

    rows --(chat template + tokenize, all rows once)--> filter overlong prompts (counted)
         --grain.MapDataset: shuffle(seed) -> batch(train_batch_size, drop_remainder) -> repeat(epochs)
         --> left-pad to max_prompt_length -> DataProto

Tokenization happens once, up front, like verl's `RLHFDataset` with `filter_overlong_prompts`: the
number of kept rows, and so the number of batches per epoch (`len(loader)`), is known before training
starts. The grain part is a random-access `MapDataset`, so an iterator's state is just its position
(`{"next_index": k}`); `get_state()` / `set_state()` resume exactly. Shuffling reseeds every epoch
(grain derives each epoch's permutation from `seed` and the epoch), and batches never straddle epochs.

Multi-host: every process walks the same global batches (same rows, seed and state: resuming restores the
same position everywhere) but builds only its own rows of each (`shard(lo, hi)`, set by the trainer from the
mesh); `uid`s stay global. No grain worker processes are used (prompt batches are tiny).

Batch layout (verl's prompt batch):
  batch:      input_ids [B, P] int32 (left-padded with pad_token_id), attention_mask [B, P] int32,
              position_ids [B, P] int32 (= cumsum(mask) - 1, clamped at 0: verl's
              compute_position_id_with_mask)
  non_tensor: data_source, ground_truth, extra_info, raw_prompt (the chat messages), index (the row's
              position in `rows`, int64), uid (str, unique per sample over the whole run)
  meta_info:  step (global batch number), epoch
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxrl_post.data.sources import SKIP_MALFORMED_HINT, MalformedRowError

__all__ = [
    "PromptDataLoader",
    "NotEnoughPromptsError",
    "PromptError",
    "PromptIterator",
    "compute_position_ids",
    "left_pad",
    "make_dataloader",
    "tokenize_prompt",
    "tokenize_prompts",
]

log = logging.getLogger(__name__)


class PromptError(ValueError):
    """A prompt that cannot be used (chat template fails, too long with truncation='error'); `index` is the
    row's position in the list given to the pipeline. `PromptDataLoader` re-raises it naming the row's origin."""

    def __init__(self, index: int, reason: str):
        super().__init__(f"row {index}: {reason}")
        self.index = index
        self.reason = reason


class NotEnoughPromptsError(ValueError):
    """Fewer prompts than one batch are left after filtering overlong ones (none at all included).

    Attributes: `num_rows` (rows given), `num_kept` (prompts left), `num_filtered` (dropped as longer than
    `max_prompt_length`), `batch_size`, `max_prompt_length`, `lengths` (token length of every row's prompt).
    """

    def __init__(self, message: str, *, num_rows, num_kept, num_filtered, batch_size, max_prompt_length, lengths):
        super().__init__(message)
        self.num_rows = num_rows
        self.num_kept = num_kept
        self.num_filtered = num_filtered
        self.batch_size = batch_size
        self.max_prompt_length = max_prompt_length
        self.lengths = list(lengths)


def tokenize_prompts(tokenizer, conversations: Sequence[Sequence[dict]], chunk: int = 512) -> list[list[int]]:
    """Chat-template token ids (with the generation prompt) of many conversations, exactly one BOS each.

    Same result as `jaxrl_post.models.tokenizer.apply_chat_template` per conversation (render the
    template to text, tokenize without special tokens, prepend BOS only if the tokenizer normally adds
    one and the template did not, collapse a doubled BOS), but the BOS probe runs once and the texts are
    tokenized in batches (the per-call version costs ~10x more on GSM8K-sized data).

    Raises: PromptError naming the position of a conversation the chat template rejects.
    """
    # here, not at the top: jaxrl_post.data imports without jax (data scripts, grain workers)
    from jaxrl_post.models.tokenizer import render_chat, tokenizer_adds_bos

    bos = tokenizer.bos_token_id
    add_bos = bos is not None and tokenizer_adds_bos(tokenizer)
    out: list[list[int]] = []
    for start in range(0, len(conversations), chunk):
        texts = []
        for j, m in enumerate(conversations[start : start + chunk]):
            try:
                texts.append(render_chat(tokenizer, list(m), add_generation_prompt=True))
            except Exception as e:
                raise PromptError(start + j, f"the chat template failed on its prompt: {type(e).__name__}: {e}") from e
        for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]:
            ids = [int(i) for i in ids]
            if bos is not None:
                if add_bos and (not ids or ids[0] != bos):
                    ids = [int(bos)] + ids
                while len(ids) >= 2 and ids[0] == bos and ids[1] == bos:
                    ids = ids[1:]
            out.append(ids)
    return out


def tokenize_prompt(tokenizer, messages: Sequence[dict]) -> list[int]:
    """Chat-template token ids of one conversation (see `tokenize_prompts`)."""
    return tokenize_prompts(tokenizer, [messages])[0]


def left_pad(seqs: Sequence[Sequence[int]], length: int, pad_token_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Left-pad token lists to `length` -> (ids [B, length] int32, mask [B, length] int32).

    Raises: ValueError if a sequence is longer than `length`.
    """
    ids = np.full((len(seqs), length), pad_token_id, np.int32)
    mask = np.zeros((len(seqs), length), np.int32)
    for i, s in enumerate(seqs):
        n = len(s)
        if n > length:
            raise ValueError(f"sequence {i} has {n} tokens > max length {length}")
        if n:
            ids[i, length - n :] = s
            mask[i, length - n :] = 1
    return ids, mask


def compute_position_ids(attention_mask: np.ndarray) -> np.ndarray:
    """[B, T] int mask -> [B, T] int32 positions: cumsum(mask) - 1 clamped at 0 (verl)."""
    return np.maximum(np.cumsum(attention_mask, axis=-1) - 1, 0).astype(np.int32)


def _object_array(values: Sequence[Any]) -> np.ndarray:
    out = np.empty(len(values), dtype=object)
    for i, v in enumerate(values):
        out[i] = v
    return out


class PromptDataLoader:
    """Iterable of prompt DataProto batches over `rows` (see module docstring).

    Args:
      rows: verl rows (`jaxrl_post.data.sources`).
      tokenizer: HF tokenizer with a chat template.
      batch_size: prompts per batch (verl `data.train_batch_size`).
      max_prompt_length: P; prompts are left-padded to it.
      seed: shuffle seed. shuffle: False keeps row order (validation).
      num_epochs: passes over the data; None = forever.
      drop_remainder: drop each epoch's last partial batch (training); keep it for validation.
      filter_overlong_prompts: drop prompts longer than P (counted in `num_filtered`); when False,
        `truncation` decides: 'error' (raise, naming the row), 'left' (keep the last P tokens) or
        'right' (keep the first P).
      pad_token_id: default tokenizer.pad_token_id, else eos_token_id, else 0.
      where: each row's origin ("<file>, row <i>", `sources.Rows.where`), used in error messages.
    Raises:
      NotEnoughPromptsError (a ValueError): no rows, no rows left after filtering, or fewer than
        batch_size with drop_remainder. ValueError: bad arguments. MalformedRowError (a ValueError): a
        prompt the chat template rejects, or an overlong prompt with truncation='error'; the message names
        the row's file and row number.
    """

    def __init__(
        self,
        rows: Sequence[dict[str, Any]],
        tokenizer,
        *,
        batch_size: int,
        max_prompt_length: int,
        seed: int = 0,
        shuffle: bool = True,
        num_epochs: int | None = None,
        drop_remainder: bool = True,
        filter_overlong_prompts: bool = True,
        truncation: str = "error",
        pad_token_id: int | None = None,
        where: Sequence[str] | None = None,
    ):
        import grain

        if batch_size < 1 or max_prompt_length < 1:
            raise ValueError(f"batch_size ({batch_size}) and max_prompt_length ({max_prompt_length}) must be >= 1")
        if truncation not in ("error", "left", "right"):
            raise ValueError(f"truncation must be 'error', 'left' or 'right', got {truncation!r}")
        if num_epochs is not None and num_epochs < 1:
            raise ValueError(f"num_epochs must be >= 1 or None, got {num_epochs}")
        self.batch_size = int(batch_size)
        self.max_prompt_length = int(max_prompt_length)
        self.seed = int(seed)
        self.num_rows = len(rows)
        if pad_token_id is None:
            pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.pad_token_id = int(pad_token_id if pad_token_id is not None else 0)

        P = self.max_prompt_length
        self._rows: list[dict[str, Any]] = []
        self._ids: list[np.ndarray] = []
        self._index: list[int] = []
        self.num_filtered = 0
        self.num_truncated = 0
        name = lambda i: where[i] if where is not None and len(where) == len(rows) else f"row {i}"
        try:
            all_ids = tokenize_prompts(tokenizer, [row["prompt"] for row in rows])
        except PromptError as e:
            raise MalformedRowError(f"{name(e.index)}: malformed row: {e.reason}. {SKIP_MALFORMED_HINT}") from e
        for i, (row, ids) in enumerate(zip(rows, all_ids)):
            if len(ids) > P:
                if filter_overlong_prompts:
                    self.num_filtered += 1
                    continue
                if truncation == "error":
                    raise MalformedRowError(
                        f"{name(i)} (data_source={row.get('data_source')!r}) has a "
                        f"{len(ids)}-token prompt > max_prompt_length={P}; raise data.max_prompt_length, set "
                        "data.filter_overlong_prompts=True, or data.truncation='left'/'right'"
                    )
                ids = ids[-P:] if truncation == "left" else ids[:P]
                self.num_truncated += 1
            self._rows.append(row)
            self._ids.append(np.asarray(ids, np.int32))
            self._index.append(i)
        if self.num_filtered:
            log.info("filtered %d of %d prompts longer than %d tokens", self.num_filtered, self.num_rows, P)
        n = len(self._rows)
        if n == 0 or (drop_remainder and n < self.batch_size):
            why = (
                f"no prompts left: all {self.num_rows} rows are longer than max_prompt_length={P}"
                if n == 0 and self.num_rows
                else "no rows"
                if n == 0
                else f"only {n} prompts (after filtering) for batch_size={self.batch_size} with drop_remainder=True"
            )
            raise NotEnoughPromptsError(
                why,
                num_rows=self.num_rows,
                num_kept=n,
                num_filtered=self.num_filtered,
                batch_size=self.batch_size,
                max_prompt_length=P,
                lengths=[len(ids) for ids in all_ids],
            )

        ds = grain.MapDataset.range(n)
        if shuffle:
            ds = ds.shuffle(seed=self.seed)
        ds = ds.batch(self.batch_size, drop_remainder=drop_remainder, batch_fn=lambda xs: np.asarray(xs, np.int64))
        self.batches_per_epoch = len(ds)
        self._dataset = ds.repeat(num_epochs).map_with_index(self._make_batch)
        self.num_epochs = num_epochs
        self._iter = None
        self._share = slice(None)  # rows of each global batch this process builds (`shard`)

    def shard(self, lo: int, hi: int) -> None:
        """Build only rows [lo, hi) of every global batch from now on (this process's share; multi-host).

        Raises ValueError for an empty or out-of-range share."""
        if not 0 <= lo < hi <= self.batch_size:
            raise ValueError(f"share [{lo}, {hi}) is not inside a batch of {self.batch_size} prompts")
        self._share = slice(int(lo), int(hi))

    # --------------------------------------------------------------------------------------------
    @property
    def num_prompts(self) -> int:
        """Prompts kept after filtering."""
        return len(self._rows)

    @property
    def stats(self) -> dict[str, int]:
        return {
            "data/num_rows": self.num_rows,
            "data/num_prompts": self.num_prompts,
            "data/num_filtered_overlong": self.num_filtered,
            "data/num_truncated": self.num_truncated,
        }

    def __len__(self) -> int:
        """Batches per epoch (verl's len(train_dataloader))."""
        return self.batches_per_epoch

    def _make_batch(self, step: int, positions: np.ndarray) -> dict[str, Any]:
        first = step * self.batch_size + (self._share.start or 0)
        positions = positions[self._share]
        ids, mask = left_pad([self._ids[p] for p in positions], self.max_prompt_length, self.pad_token_id)
        rows = [self._rows[p] for p in positions]
        return {
            "tensors": {"input_ids": ids, "attention_mask": mask, "position_ids": compute_position_ids(mask)},
            "non_tensors": {
                "data_source": _object_array([r["data_source"] for r in rows]),
                "ground_truth": _object_array([r["reward_model"]["ground_truth"] for r in rows]),
                "extra_info": _object_array([r.get("extra_info") or {} for r in rows]),
                "raw_prompt": _object_array([r["prompt"] for r in rows]),
                "index": np.asarray([self._index[p] for p in positions], np.int64),
                "uid": _object_array([str(first + j) for j in range(len(rows))]),
            },
            "meta_info": {"step": int(step), "epoch": int(step // self.batches_per_epoch)},
        }

    @staticmethod
    def _to_proto(item: dict[str, Any]):
        # here, not at the top: jaxrl_post.data imports without jax (data scripts, grain workers)
        from jaxrl_post.batch.protocol import DataProto

        return DataProto.from_dict(
            tensors=item["tensors"], non_tensors=item["non_tensors"], meta_info=item["meta_info"]
        )

    # ----------------------------------------------------------------------------------- iteration
    def iterator(self) -> PromptIterator:
        """A new iterator from the first batch, independent of the loader's own position."""
        return PromptIterator(self)

    def __iter__(self) -> PromptIterator:
        """`for batch in loader` always makes a fresh pass from the start (validation); it does not
        move the loader's own stateful position used by `next(loader)` / `get_state()`."""
        return self.iterator()

    def __next__(self):
        """Next batch of the loader's own stateful stream (training)."""
        if self._iter is None:
            self._iter = self.iterator()
        return next(self._iter)

    def get_state(self) -> dict[str, Any]:
        """JSON-serializable position of the stream `next(loader)` reads (grain iterator state)."""
        if self._iter is None:
            self._iter = self.iterator()
        return self._iter.get_state()

    def set_state(self, state: dict[str, Any]) -> None:
        """Resume `next(loader)` at `state` (from `get_state()`, possibly in another process)."""
        self._iter = self.iterator()
        self._iter.set_state(state)


class PromptIterator:
    """Iterator over a PromptDataLoader's batches (DataProto), wrapping a grain DatasetIterator."""

    def __init__(self, loader: PromptDataLoader):
        import grain

        # Synchronous: a batch is a few padded rows (~1 ms); grain's default read-ahead (16 threads,
        # 500 elements) would build hundreds of batches in background threads next to the trainer.
        read_options = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)
        self._grain_iter = iter(loader._dataset.to_iter_dataset(read_options))
        self._to_proto = loader._to_proto

    def __iter__(self) -> PromptIterator:
        return self

    def __next__(self):
        return self._to_proto(next(self._grain_iter))

    def get_state(self) -> dict[str, Any]:
        return dict(self._grain_iter.get_state())

    def set_state(self, state: dict[str, Any]) -> None:
        self._grain_iter.set_state(dict(state))


def make_dataloader(
    rows: Sequence[dict[str, Any]],
    tokenizer,
    *,
    batch_size: int,
    max_prompt_length: int,
    seed: int = 0,
    shuffle: bool = True,
    num_epochs: int | None = None,
    drop_remainder: bool = True,
    filter_overlong_prompts: bool = True,
    truncation: str = "error",
    pad_token_id: int | None = None,
) -> PromptDataLoader:
    """Build the prompt pipeline (see PromptDataLoader). `rows` may be a `sources.Rows` (its `where` then
    names rows in error messages)."""
    where = getattr(rows, "where", None) or None
    rows = getattr(rows, "rows", rows)
    return PromptDataLoader(
        rows,
        tokenizer,
        batch_size=batch_size,
        max_prompt_length=max_prompt_length,
        seed=seed,
        shuffle=shuffle,
        num_epochs=num_epochs,
        drop_remainder=drop_remainder,
        filter_overlong_prompts=filter_overlong_prompts,
        truncation=truncation,
        pad_token_id=pad_token_id,
        where=where,
    )
