"""reasoning-gym reward: the task's own `score_answer(answer, entry)`.

How a row finds its scorer (rows made by `jaxrl_post.data.sources.reasoning_gym_rows`):
  extra_info = {"task": name, "config": {config fields incl. seed and size}, "index": i,
                "entry": {"question", "answer", "metadata"}, "answer_format": "answer_tag" | ...}
The scorer is `create_dataset(task, **config).score_answer(answer, entry)`, with the dataset instance
cached per (task, config) in each process. The stored entry is used as is (robust to dataset code
changes and cheap); when a row carries no entry, it is re-generated deterministically as
`create_dataset(task, **config)[index]` (reasoning-gym seeds item i with seed + i). With neither
config nor entry, the task's default scorer gets `{"answer": ground_truth, "metadata": {}}`.

The task name comes from `extra_info["task"]` or from the data source "reasoning_gym/<task>".

Answer extraction (`extract_model_answer`), chosen by `extra_info["answer_format"]` so that it always
matches the instruction the prompt gave:
  "answer_tag"   -> content of the last <answer>...</answer> (reasoning_gym.utils.extract_answer);
                    no tag -> no answer (score 0).
  "last_line"    -> the last non-empty line, with a trailing period removed.
  "tag_or_last_line" -> the tag if present, else the last line.
  "last_number"  -> the last number in the response ("1,000" -> "1000", "-3.50" -> "-3.50"), for
                    tasks whose answers are numbers; small models rarely follow tag formats.
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any

__all__ = ["ANSWER_FORMATS", "compute_score", "extract_model_answer", "task_from_data_source"]

ANSWER_FORMATS = ("answer_tag", "last_line", "tag_or_last_line", "last_number")
DATA_SOURCE_PREFIXES = ("reasoning_gym/", "reasoning-gym/", "reasoning_gym:", "rg/")


def task_from_data_source(data_source: str) -> str | None:
    """'reasoning_gym/chain_sum' -> 'chain_sum'; None if the source has no task suffix."""
    for p in DATA_SOURCE_PREFIXES:
        if data_source.startswith(p) and len(data_source) > len(p):
            return data_source[len(p) :]
    return None


def _last_line(text: str) -> str | None:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    if not lines:
        return None
    line = lines[-1]
    return line[:-1].rstrip() if line.endswith(".") else line


_NUMBER_RE = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?")


def _last_number(text: str) -> str | None:
    matches = _NUMBER_RE.findall(text)
    return matches[-1].replace(",", "") if matches else None


def extract_model_answer(solution_str: str, answer_format: str = "answer_tag") -> str | None:
    """The model's answer string from a decoded response (see module docstring), or None.

    Raises:
      ValueError: unknown `answer_format`.
    """
    from reasoning_gym.utils import extract_answer

    if answer_format == "answer_tag":
        return extract_answer(solution_str, tag_name="answer")
    if answer_format == "last_line":
        return _last_line(solution_str)
    if answer_format == "tag_or_last_line":
        tagged = extract_answer(solution_str, tag_name="answer")
        return tagged if tagged is not None else _last_line(solution_str)
    if answer_format == "last_number":
        return _last_number(solution_str)
    raise ValueError(f"unknown answer_format {answer_format!r}; expected one of {ANSWER_FORMATS}")


def _json_default(o: Any) -> Any:
    import enum

    if isinstance(o, enum.Enum):
        return o.value
    if isinstance(o, (set, frozenset, tuple)):
        return list(o)
    return str(o)


def _config_key(config: dict[str, Any] | None) -> str:
    return json.dumps(config or {}, sort_keys=True, default=_json_default)


@functools.lru_cache(maxsize=64)
def _dataset(task: str, config_key: str):
    import reasoning_gym
    from reasoning_gym.factory import DATASETS

    if task not in DATASETS:
        raise ValueError(f"reasoning-gym task {task!r} is not registered")
    config = json.loads(config_key)
    if not config:
        cls, cfg_cls = DATASETS[task]
        return cls(config=cfg_cls())
    return reasoning_gym.create_dataset(task, **_restore_types(task, config))


def _restore_types(task: str, config: dict[str, Any]) -> dict[str, Any]:
    """JSON turns tuple config fields into lists and enums into their values; restore them using the
    type of the config class's default for that field."""
    import dataclasses
    import enum

    from reasoning_gym.factory import DATASETS

    _, cfg_cls = DATASETS[task]
    defaults = {f.name: f.default for f in dataclasses.fields(cfg_cls)}
    out = dict(config)
    for k, v in config.items():
        d = defaults.get(k)
        if isinstance(v, list) and isinstance(d, tuple):
            out[k] = tuple(v)
        elif isinstance(d, enum.Enum) and not isinstance(v, enum.Enum):
            out[k] = type(d)(v)
    return out


def compute_score(
    solution_str: str,
    ground_truth: str,
    extra_info: dict[str, Any] | None = None,
    data_source: str | None = None,
) -> float:
    """Score a response with the reasoning-gym task's own scorer.

    Returns:
      float in [0, 1] from `score_answer` (1.0 = correct; some tasks give partial credit); 0.0 when no
      answer can be extracted.
    Raises:
      ValueError: task unknown / not derivable from `extra_info` or `data_source`.
    """
    info = dict(extra_info or {})
    task = info.get("task") or (task_from_data_source(data_source) if data_source else None)
    if not task:
        raise ValueError(
            f"reasoning-gym reward: no task name (extra_info['task'] missing and data_source={data_source!r} "
            "is not 'reasoning_gym/<task>')"
        )
    answer = extract_model_answer(solution_str, info.get("answer_format", "answer_tag"))
    if answer is None:
        return 0.0
    config = info.get("config")
    dataset = _dataset(task, _config_key(config))
    entry = info.get("entry")
    if entry is None:
        if config and info.get("index") is not None:
            entry = dataset[int(info["index"])]
        else:
            entry = {"answer": str(ground_truth), "metadata": {}}
    return float(dataset.score_answer(answer, entry))
