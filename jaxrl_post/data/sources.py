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
`load_rows(spec, ...)` picks one from a string spec. `Rows`, row validation and the verl-format file
reader live in `data.rows` (re-exported here). A malformed row raises `MalformedRowError`
naming the file (or source) and the row, or is skipped and counted with `skip_malformed=True`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

from jaxrl_post.data.rows import (
    SKIP_MALFORMED_HINT,
    MalformedRowError,
    Rows,
    collect_rows,
    jsonl_items,
    normalize_row,
    read_verl_file,
    write_jsonl,
)

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
    return collect_rows(jsonl_items(path), lambda raw, i: gsm8k_row(raw, i, split), skip_malformed, path)


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
    return collect_rows(items, _auto_convert(data_source or path, split, converter), skip_malformed, src)


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
    return collect_rows(items, _auto_convert(data_source or name, split, converter), skip_malformed, src)


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
