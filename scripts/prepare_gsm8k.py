"""GSM8K in verl's RL format, as verl's `examples/data_preprocess/gsm8k.py` writes it.

    python scripts/prepare_gsm8k.py --local_save_dir data/gsm8k                     # from the HF hub (network)
    python scripts/prepare_gsm8k.py --local_dataset_path ../shared/data/gsm8k --local_save_dir data/gsm8k
    python scripts/prepare_gsm8k.py --local_dataset_path train.jsonl --formats jsonl,parquet
    python -m jaxrl_post.main --config=configs/grpo.py:gsm8k \\
        --config.data.train_files=data/gsm8k/train.jsonl --config.data.val_files=data/gsm8k/test.jsonl

Input: without `--local_dataset_path`, `datasets.load_dataset("openai/gsm8k", "main")` (needs `datasets` and
network, or its cache); with it, a directory holding `train.jsonl` / `test.jsonl` (or either) or one `.jsonl`
file (its name without `.jsonl` is the split), in OpenAI's format: one `{"question", "answer"}` object per line,
the answer ending in `#### <number>`.

Output: `<local_save_dir>/<split>.jsonl` (and `.parquet` with `--formats ...,parquet`; parquet needs `pyarrow`,
`pip install -e '.[data]'`), one row per example with verl's fields (`jaxrl_post.data.sources.gsm8k_row`, the same
preprocessing `gsm8k:<path>` specs apply when reading raw files):

    data_source   "openai/gsm8k"
    prompt        [{"role": "user", "content": question + ' Let\'s think step by step and output the final answer
                  after "####".'}]
    ability       "math"
    reward_model  {"style": "rule", "ground_truth": the number after "#### ", commas removed}
    extra_info    {"split", "index", "answer" (the raw solution), "question" (the raw question)}

Exit 2 with one `error:` line: a missing input, a row without a question or a `####` answer (file and line),
parquet asked for without pyarrow, no `datasets` / no network for the hub.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:  # run as `python scripts/prepare_gsm8k.py` without an install
    sys.path.insert(0, REPO)

from jaxrl_post.data.sources import gsm8k_row  # noqa: E402

DATA_SOURCE = "openai/gsm8k"  # verl's data_source (the built-in GSM8K reward of jaxrl_post.rewards)
SPLITS = ("train", "test")
FORMATS = ("jsonl", "parquet")


class PrepareError(Exception):
    """A user-caused failure: printed as one `error:` line, exit 2."""


def local_examples(path: str) -> dict[str, list[tuple[str, dict]]]:
    """`{split: [(where, example), ...]}` from a directory of `<split>.jsonl` files or one `.jsonl` file
    (`where` = "file:line"). Raises PrepareError: nothing to read, a line that is not a JSON object."""
    if os.path.isdir(path):
        files = {s: os.path.join(path, f"{s}.jsonl") for s in SPLITS}
        files = {s: f for s, f in files.items() if os.path.isfile(f)}
        if not files:
            raise PrepareError(f"--local_dataset_path={path}: no train.jsonl or test.jsonl in this directory")
    elif os.path.isfile(path):
        files = {os.path.splitext(os.path.basename(path))[0]: path}
    else:
        raise PrepareError(f"--local_dataset_path={path}: no such file or directory")
    out: dict[str, list[tuple[str, dict]]] = {}
    for split, file in files.items():
        rows = out[split] = []
        with open(file, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rows.append((f"{file}:{n}", json.loads(line)))
                except json.JSONDecodeError as e:
                    raise PrepareError(f"{file}:{n}: not a JSON line ({e})") from None
    return out


def hub_examples() -> dict[str, list[tuple[str, dict]]]:
    """verl's source: `datasets.load_dataset("openai/gsm8k", "main")`, both splits. Raises PrepareError when
    `datasets` is missing or the download fails."""
    try:
        import datasets  # optional (the `data` extra); only this path needs it
    except ImportError:
        raise PrepareError(
            "reading GSM8K from the Hugging Face hub needs `datasets` (pip install -e '.[data]'); or pass a local "
            "copy: --local_dataset_path=DIR_WITH_train.jsonl"
        ) from None
    try:
        ds = datasets.load_dataset(DATA_SOURCE, "main")
    except Exception as e:  # a network / hub failure: one line with the cause, and the offline alternative
        raise PrepareError(
            f"could not load {DATA_SOURCE} from the hub ({type(e).__name__}: {e}); without network, pass a local "
            "copy: --local_dataset_path=DIR_WITH_train.jsonl"
        ) from None
    return {s: [(f"{DATA_SOURCE}[{s}] row {i}", dict(ex)) for i, ex in enumerate(ds[s])] for s in SPLITS if s in ds}


def to_verl_rows(split: str, examples: list[tuple[str, dict]]) -> list[dict]:
    """verl's `make_map_fn(split)` over the examples (index = position in the split). Raises PrepareError
    naming the row of a malformed example."""
    rows = []
    for i, (where, ex) in enumerate(examples):
        try:
            rows.append(gsm8k_row(ex, i, split, data_source=DATA_SOURCE))
        except ValueError as e:
            raise PrepareError(f"{where}: {e}") from None
    return rows


def write(rows: list[dict], out_dir: str, split: str, formats: tuple[str, ...]) -> list[str]:
    """Write `<out_dir>/<split>.<fmt>` for each format; returns the paths."""
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    if "jsonl" in formats:
        path = os.path.join(out_dir, f"{split}.jsonl")
        with open(path, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
        paths.append(path)
    if "parquet" in formats:
        import pyarrow as pa  # checked in parse_formats
        import pyarrow.parquet as pq

        path = os.path.join(out_dir, f"{split}.parquet")
        pq.write_table(pa.Table.from_pylist(rows), path)
        paths.append(path)
    return paths


def parse_formats(value: str) -> tuple[str, ...]:
    """'jsonl,parquet' -> ('jsonl', 'parquet'). Raises PrepareError: an unknown format, parquet without pyarrow."""
    formats = tuple(dict.fromkeys(s.strip() for s in value.split(",") if s.strip()))
    bad = [f for f in formats if f not in FORMATS]
    if bad or not formats:
        raise PrepareError(f"--formats={value!r}: each must be one of {list(FORMATS)}")
    if "parquet" in formats:
        try:
            import pyarrow.parquet  # noqa: F401 (optional: only parquet output needs it)
        except ImportError:
            raise PrepareError(
                "--formats includes parquet, which needs pyarrow (pip install -e '.[data]'); or write jsonl only "
                "(--formats=jsonl: the trainer reads both)"
            ) from None
    return formats


def main(argv: list[str] | None = None) -> list[str]:
    """Convert and write; returns the written paths. Raises PrepareError (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--local_dataset_path", default=None, help="directory of train/test .jsonl, or one .jsonl file")
    p.add_argument("--local_save_dir", default="data/gsm8k", help="output directory")
    p.add_argument("--formats", default="jsonl", help="comma-separated: jsonl, parquet")
    args = p.parse_args(argv)
    formats = parse_formats(args.formats)
    splits = local_examples(args.local_dataset_path) if args.local_dataset_path else hub_examples()
    paths = []
    for split, examples in splits.items():
        paths += write(to_verl_rows(split, examples), args.local_save_dir, split, formats)
        print(f"{split}: {len(examples)} rows -> {', '.join(paths[-len(formats) :])}")
    return paths


if __name__ == "__main__":
    try:
        main()
    except PrepareError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
