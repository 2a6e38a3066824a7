"""Prompt sources -> rows in verl's format.

A row (verl's RL dataset format):
    {"data_source": str, "prompt": [{"role": "user", "content": str}, ...],
     "reward_model": {"style": "rule", "ground_truth": str}, "extra_info": dict}
(other keys, e.g. "ability", are kept). Sources:
  - verl jsonl / json / parquet files (`read_verl_file`; parquet needs `pyarrow`);
  - raw GSM8K jsonl with "question"/"answer" (`gsm8k_rows`; verl's prompt suffix and "####" answer);
  - reasoning-gym procedural tasks (`reasoning_gym_rows`; deterministic by seed);
  - Hugging Face `datasets` (`hf_rows`, imported lazily; works offline when cached);
  - TFDS (`tfds_rows`, `tfds.data_source`, imported lazily; no TensorFlow needed).
`load_rows(spec, ...)` picks one from a string spec. A malformed row raises `MalformedRowError`
naming the file (or source) and the row, or is skipped and counted with `skip_malformed=True`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any

__all__ = [
    "GSM8K_INSTRUCTION",
    "MalformedRowError",
    "PROMPT_FORMATS",
    "Rows",
    "SKIP_MALFORMED_HINT",
    "gsm8k_rows",
    "hf_rows",
    "load_rows",
    "normalize_row",
    "disjoint_seed",
    "read_verl_file",
    "reasoning_gym_rows",
    "tfds_rows",
    "write_jsonl",
]

log = logging.getLogger(__name__)

# verl's examples/data_preprocess/gsm8k.py instruction, appended to the question after one space.
GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'

# reasoning-gym prompt formats: name -> (instruction appended to the question, answer_format used by
# jaxrl_post.rewards.reasoning_gym_reward.extract_model_answer). The instruction and the extraction
# always travel together in the row's extra_info, so the reward matches what the prompt asked for.
PROMPT_FORMATS: dict[str, tuple[str, str]] = {
    "answer_tag": (
        "Give your final answer inside <answer></answer> tags, for example <answer>42</answer>.",
        "answer_tag",
    ),
    "answer_tag_think": (
        "Think step by step, then give your final answer inside <answer></answer> tags, "
        "for example <answer>42</answer>.",
        "answer_tag",
    ),
    "last_line": ("Give only the final answer on the last line.", "last_line"),
    "direct": ("Reply with only the final answer.", "last_line"),
    "number": ("Answer with just the number.", "last_number"),
    "plain": ("", "last_number"),  # the task's question as is; the last number is the answer
}


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


def _collect(
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


def _jsonl_items(path: str) -> Iterable[tuple[str, Any]]:
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
        yield from _jsonl_items(path)
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
    return _collect(_file_items(path), lambda raw, i: raw, skip_malformed, path)


# ------------------------------------------------------------------------------------------ GSM8K
def gsm8k_ground_truth(answer: str) -> str:
    """The number after '####' in a GSM8K answer, commas removed ("1,600" -> "1600")."""
    if "####" not in answer:
        raise ValueError("GSM8K answer has no '####'")
    gt = answer.split("####")[-1].strip().replace(",", "")
    if not gt:
        raise ValueError("GSM8K answer has nothing after '####'")
    return gt


def gsm8k_row(example: dict[str, Any], index: int, split: str, data_source: str = "openai/gsm8k") -> dict:
    """verl's GSM8K preprocessing of one {"question", "answer"} example."""
    if not isinstance(example, dict):
        raise ValueError(f"row is a {type(example).__name__}, expected a JSON object")
    q, a = example.get("question"), example.get("answer")
    if not isinstance(q, str) or not q.strip():
        raise ValueError("missing or empty 'question'")
    if not isinstance(a, str):
        raise ValueError("missing 'answer'")
    return {
        "data_source": data_source,
        "prompt": [{"role": "user", "content": q + " " + GSM8K_INSTRUCTION}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": gsm8k_ground_truth(a)},
        "extra_info": {"split": split, "index": index, "answer": a, "question": q},
    }


def gsm8k_rows(path: str, split: str | None = None, skip_malformed: bool = False) -> Rows:
    """Raw GSM8K jsonl ({"question", "answer"} per line) -> verl rows (data_source 'openai/gsm8k')."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"GSM8K file not found: {path}")
    split = split or os.path.splitext(os.path.basename(path))[0]
    return _collect(_jsonl_items(path), lambda raw, i: gsm8k_row(raw, i, split), skip_malformed, path)


# ------------------------------------------------------------------------------------------ reasoning-gym
def reasoning_gym_rows(
    task: str,
    size: int,
    seed: int,
    config: dict[str, Any] | None = None,
    prompt_format: str = "answer_tag",
    system_prompt: str | None = None,
) -> list[dict[str, Any]]:
    """`size` rows of a reasoning-gym task, deterministic in (task, config, seed).

    Row i is reasoning-gym's item i of `create_dataset(task, size=size, seed=seed, **config)`:
    prompt = [system?] + user(question + "\\n\\n" + instruction of `prompt_format`); data_source
    'reasoning_gym/<task>'; ground_truth = the item's answer; extra_info = {"task", "config" (all config
    fields, seed and size included), "index", "entry" (the item: question/answer/metadata),
    "answer_format"} -- everything `reasoning_gym_reward.compute_score` needs.

    Seeds: reasoning-gym generates item i from `Random(seed + i)`, so (seed=s, size=n) are items
    s .. s+n-1 of ONE stream: a held-out set made with seed s2 overlaps the training set whenever
    s <= s2 < s + n (e.g. train seed 42 / size 10000 and val seed 4242 share 400 items). Use
    `val_seed >= train_seed + train_size` (or `disjoint_seed`). Small problem spaces (e.g. 1-digit
    sums: 200 questions) also repeat questions across seeds; de-duplicate by question if needed.

    Raises: ValueError for an unknown task, prompt format or invalid config.
    """
    import reasoning_gym

    if prompt_format not in PROMPT_FORMATS:
        raise ValueError(f"unknown prompt_format {prompt_format!r}; expected one of {sorted(PROMPT_FORMATS)}")
    instruction, answer_format = PROMPT_FORMATS[prompt_format]
    cfg = dict(config or {})
    cfg.update(size=int(size), seed=int(seed))
    ds = reasoning_gym.create_dataset(task, **cfg)
    full_cfg = dataclasses.asdict(ds.config)
    rows = []
    for i in range(int(size)):
        entry = ds[i]
        msgs = [{"role": "system", "content": system_prompt}] if system_prompt else []
        content = entry["question"].rstrip() + ("\n\n" + instruction if instruction else "")
        msgs.append({"role": "user", "content": content})
        rows.append(
            {
                "data_source": f"reasoning_gym/{task}",
                "prompt": msgs,
                "ability": "reasoning",
                "reward_model": {"style": "rule", "ground_truth": str(entry["answer"])},
                "extra_info": {
                    "task": task,
                    "config": full_cfg,
                    "index": i,
                    "entry": entry,
                    "answer_format": answer_format,
                },
            }
        )
    return rows


def disjoint_seed(train_seed: int, train_size: int) -> int:
    """A seed whose reasoning-gym items never coincide (by index) with those of (train_seed, train_size)."""
    return int(train_seed) + int(train_size)


# ------------------------------------------------------------------------------------------ HF / TFDS
def _auto_convert(data_source: str, split: str, converter: Callable | None) -> Callable[[Any, int], dict]:
    def convert(example, i):
        if not isinstance(example, dict):
            raise ValueError(f"example is a {type(example).__name__}, expected a dict")
        example = {k: (v.decode("utf-8") if isinstance(v, bytes) else v) for k, v in example.items()}
        if converter is not None:
            return converter(example, i)
        if "prompt" in example and "reward_model" in example:
            return example
        if "question" in example and "answer" in example:  # GSM8K layout
            return gsm8k_row(example, i, split, data_source=data_source)
        raise ValueError(
            f"cannot convert example with columns {sorted(example)}; pass converter(example, index) -> verl row"
        )

    return convert


def hf_rows(
    path: str,
    name: str | None = None,
    split: str = "train",
    converter: Callable[[dict, int], dict] | None = None,
    data_source: str | None = None,
    skip_malformed: bool = False,
    **load_kwargs: Any,
) -> Rows:
    """Rows from `datasets.load_dataset(path, name, split=split, **load_kwargs)` (imported lazily).

    Examples already in verl format are used as is; {"question", "answer"} examples are converted as
    GSM8K (data_source defaults to `path`, e.g. 'openai/gsm8k'); anything else needs `converter`.
    Works offline when the dataset is cached (set HF_DATASETS_OFFLINE=1).
    """
    try:
        import datasets
    except ImportError as e:
        raise ImportError("the Hugging Face source needs `datasets`: pip install datasets") from e
    ds = datasets.load_dataset(path, name, split=split, **load_kwargs)
    src = f"hf:{path}" + (f"/{name}" if name else "") + f"[{split}]"
    items = ((f"{src}, row {i}", ex) for i, ex in enumerate(ds))
    return _collect(items, _auto_convert(data_source or path, split, converter), skip_malformed, src)


def tfds_rows(
    name: str,
    split: str = "train",
    data_dir: str | None = None,
    converter: Callable[[dict, int], dict] | None = None,
    data_source: str | None = None,
    skip_malformed: bool = False,
) -> Rows:
    """Rows from `tfds.data_source(name, split=split)` (random-access ArrayRecord; no TensorFlow).

    Conversion as in `hf_rows` (bytes are decoded as UTF-8). The dataset must be prepared in
    `data_dir` (or the TFDS default dir) in array_record format.
    """
    try:
        import tensorflow_datasets as tfds
    except ImportError as e:
        raise ImportError("the TFDS source needs `tensorflow-datasets`: pip install tensorflow-datasets") from e
    ds = tfds.data_source(name, split=split, data_dir=data_dir)
    src = f"tfds:{name}[{split}]"
    items = ((f"{src}, row {i}", ds[i]) for i in range(len(ds)))
    return _collect(items, _auto_convert(data_source or name, split, converter), skip_malformed, src)


# ------------------------------------------------------------------------------------------ dispatch
def _looks_like_raw_gsm8k(path: str) -> bool:
    if not path.endswith(".jsonl"):
        return False
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                try:
                    first = json.loads(line)
                except json.JSONDecodeError:
                    return False
                return isinstance(first, dict) and "question" in first and "prompt" not in first
    return False


def load_rows(
    spec: str | Sequence[str],
    *,
    split: str = "train",
    skip_malformed: bool = False,
    size: int = 1000,
    seed: int = 0,
    config: dict[str, Any] | None = None,
    prompt_format: str = "answer_tag",
    system_prompt: str | None = None,
) -> Rows:
    """Rows from a spec string (or a list of specs, concatenated):

    "path.jsonl|.json|.parquet"  verl rows; a .jsonl of raw {"question","answer"} is read as GSM8K
    "gsm8k:path.jsonl"           raw GSM8K jsonl
    "reasoning_gym:<task>"       `size` procedural rows from `seed` (with `config`, `prompt_format`)
    "hf:<path>[:<name>]"         Hugging Face datasets, `split`
    "tfds:<name>"                TFDS data source, `split`
    """
    if not isinstance(spec, str):
        specs = list(spec)
        if not specs:
            raise ValueError("empty list of data specs")
        out = load_rows(
            specs[0],
            split=split,
            skip_malformed=skip_malformed,
            size=size,
            seed=seed,
            config=config,
            prompt_format=prompt_format,
            system_prompt=system_prompt,
        )
        for s in specs[1:]:
            out = out + load_rows(
                s,
                split=split,
                skip_malformed=skip_malformed,
                size=size,
                seed=seed,
                config=config,
                prompt_format=prompt_format,
                system_prompt=system_prompt,
            )
        return out
    if spec.startswith(("reasoning_gym:", "reasoning_gym/")):
        task = spec.split(":", 1)[1] if ":" in spec else spec.split("/", 1)[1]
        rows = reasoning_gym_rows(task, size, seed, config, prompt_format, system_prompt)
        return Rows(rows, 0, spec, [f"{spec} (seed {seed}), row {i}" for i in range(len(rows))])
    if spec.startswith("hf:"):
        path, _, name = spec[3:].partition(":")
        return hf_rows(path, name or None, split=split, skip_malformed=skip_malformed)
    if spec.startswith("tfds:"):
        return tfds_rows(spec[5:], split=split, skip_malformed=skip_malformed)
    if spec.startswith("gsm8k:"):
        return gsm8k_rows(spec[6:], skip_malformed=skip_malformed)
    path = os.path.expanduser(spec)
    if not os.path.exists(path):
        raise FileNotFoundError(f"data file not found: {path}")
    if _looks_like_raw_gsm8k(path):
        return gsm8k_rows(path, skip_malformed=skip_malformed)
    return read_verl_file(path, skip_malformed=skip_malformed)


def write_jsonl(rows: Iterable[dict[str, Any]], path: str) -> None:
    """Write rows as jsonl (tuples become lists; non-JSON values become strings)."""
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, default=lambda o: sorted(o) if isinstance(o, set) else str(o)) + "\n")
