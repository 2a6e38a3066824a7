"""Rows in verl's RL dataset format: the `Rows` container, row validation (`normalize_row`) and verl-format
files (`read_verl_file`: .jsonl / .json / .parquet; `write_jsonl`). A malformed row raises
`MalformedRowError` naming the file and row, or is skipped and counted with `skip_malformed=True`.
The sources that build rows (GSM8K, reasoning-gym, HF datasets, TFDS) and `load_rows`: `data.sources`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any

__all__ = ["MalformedRowError", "Rows", "SKIP_MALFORMED_HINT", "normalize_row", "read_verl_file", "write_jsonl"]

log = logging.getLogger(__name__)

SKIP_MALFORMED_HINT = (
    "Fix the row, or skip and count malformed rows with skip_malformed=True (--config.data.skip_malformed=True)."
)


class MalformedRowError(ValueError):
    """A row that is not valid verl format; the message names the file/source, the row number, what is wrong,
    and how to skip such rows (`skip_malformed=True`, i.e. `--config.data.skip_malformed=True`)."""


@dataclasses.dataclass
class Rows:
    """Loaded rows plus bookkeeping: `num_skipped` malformed rows (with skip_malformed=True) and `where`,
    each row's origin ("<file>, row <i> (line <n>)"; empty when unknown) for error messages downstream."""

    rows: list[dict[str, Any]]
    num_skipped: int = 0
    source: str = ""
    where: list[str] = dataclasses.field(default_factory=list)

    def __len__(self) -> int:
        return len(self.rows)

    def __add__(self, other: Rows) -> Rows:
        where = self.where + other.where if len(self.where) == len(self) and len(other.where) == len(other) else []
        return Rows(
            self.rows + other.rows, self.num_skipped + other.num_skipped, f"{self.source}+{other.source}", where
        )

    def select(self, indices: Sequence[int]) -> Rows:
        """The rows at `indices` (their `where` entries follow them)."""
        where = [self.where[i] for i in indices] if len(self.where) == len(self) else []
        return Rows([self.rows[i] for i in indices], self.num_skipped, self.source, where)


# ------------------------------------------------------------------------------------------ checks
def normalize_row(row: Any) -> dict[str, Any]:
    """Validate one verl row and return a normalized copy.

    A string `prompt` becomes [{"role": "user", "content": prompt}]; a missing `extra_info` becomes {};
    a numeric ground truth becomes its string. Raises ValueError (reason only; callers add where).
    """
    if not isinstance(row, dict):
        raise ValueError(f"row is a {type(row).__name__}, expected a JSON object")
    out = dict(row)
    ds = out.get("data_source")
    if not isinstance(ds, str) or not ds:
        raise ValueError("missing or empty 'data_source' (a string)")
    prompt = out.get("prompt")
    if isinstance(prompt, str):
        prompt = [{"role": "user", "content": prompt}]
    if hasattr(prompt, "tolist"):  # numpy array from parquet
        prompt = prompt.tolist()
    if not isinstance(prompt, list) or not prompt:
        raise ValueError("'prompt' must be a non-empty list of chat messages")
    msgs = []
    for j, m in enumerate(prompt):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ValueError(f"prompt message {j} must be {{'role': str, 'content': str}}, got {m!r:.80}")
        msgs.append({"role": m["role"], "content": m["content"]})
    out["prompt"] = msgs
    rm = out.get("reward_model")
    if not isinstance(rm, dict) or "ground_truth" not in rm or rm["ground_truth"] is None:
        raise ValueError("missing 'reward_model.ground_truth'")
    gt = rm["ground_truth"]
    if isinstance(gt, (int, float)) and not isinstance(gt, bool):
        gt = str(gt)
    if not isinstance(gt, str):
        raise ValueError(f"'reward_model.ground_truth' must be a string, got {type(gt).__name__}")
    out["reward_model"] = {**rm, "ground_truth": gt, "style": rm.get("style", "rule")}
    info = out.get("extra_info")
    if info is None:
        info = {}
    if not isinstance(info, dict):
        raise ValueError(f"'extra_info' must be a dict, got {type(info).__name__}")
    out["extra_info"] = info
    return out


def collect_rows(
    items: Iterable[tuple[str, Any]],
    convert: Callable[[Any, int], dict[str, Any]],
    skip_malformed: bool,
    source: str,
) -> Rows:
    """Convert (where, raw) items with convert(raw, position); malformed -> MalformedRowError(where:
    reason) or skip + count."""
    rows, wheres, skipped = [], [], 0
    for i, (where, raw) in enumerate(items):
        try:
            rows.append(normalize_row(convert(_raise_bad(raw), i)))
            wheres.append(where)
        except (ValueError, KeyError, TypeError) as e:
            if not skip_malformed:
                raise MalformedRowError(f"{where}: malformed row: {e}. {SKIP_MALFORMED_HINT}") from e
            skipped += 1
            if skipped <= 5:
                log.warning("skipping malformed row at %s: %s", where, e)
    if skipped:
        log.warning("%s: skipped %d malformed rows (skip_malformed=True)", source, skipped)
    return Rows(rows, skipped, source, wheres)


class _BadLine:
    def __init__(self, err: str):
        self.err = err


def jsonl_items(path: str) -> Iterable[tuple[str, Any]]:
    with open(path, encoding="utf-8") as f:
        row = 0
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}, row {row} (line {lineno})"
            row += 1
            try:
                yield where, json.loads(line)
            except json.JSONDecodeError as e:
                yield where, _BadLine(f"invalid JSON ({e})")


def _raise_bad(raw: Any) -> Any:
    if isinstance(raw, _BadLine):
        raise ValueError(raw.err)
    return raw


def _file_items(path: str) -> Iterable[tuple[str, Any]]:
    ext = os.path.splitext(path)[1].lower()
    if ext == ".jsonl":
        yield from jsonl_items(path)
    elif ext == ".json":
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        if not isinstance(data, list):
            raise MalformedRowError(f"{path}: a .json file must hold a list of rows")
        for i, r in enumerate(data):
            yield f"{path}, row {i}", r
    elif ext == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError as e:
            raise ImportError(f"reading {path} needs pyarrow: pip install pyarrow") from e
        table = pq.read_table(path)
        for i, r in enumerate(table.to_pylist()):
            yield f"{path}, row {i}", r
    else:
        raise ValueError(f"{path}: unsupported file type {ext!r}; expected .jsonl, .json or .parquet")


def read_verl_file(path: str, skip_malformed: bool = False) -> Rows:
    """Rows of a verl-format .jsonl / .json / .parquet file.

    Raises: FileNotFoundError; MalformedRowError naming the file and row (0-based; jsonl also gives the
    1-based line) unless `skip_malformed`; ImportError for parquet without pyarrow.
    """
    if not os.path.exists(path):
        raise FileNotFoundError(f"data file not found: {path}")
    return collect_rows(_file_items(path), lambda raw, i: raw, skip_malformed, path)


def write_jsonl(rows: Iterable[dict[str, Any]], path: str) -> None:
    """Write rows as jsonl (tuples become lists; non-JSON values become strings)."""
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, default=lambda o: sorted(o) if isinstance(o, set) else str(o)) + "\n")
