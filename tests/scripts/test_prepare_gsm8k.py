"""scripts/prepare_gsm8k.py: local OpenAI-format GSM8K rows -> verl's RL rows (verl's
examples/data_preprocess/gsm8k.py), jsonl and parquet, read back by the trainer's loader; one-line errors."""

import json
import os
import re
import subprocess
import sys

import pyarrow.parquet as pq  # a test extra (parquet output is optional for users)

from jaxrl_post.data.sources import load_rows
from tests.script_loader import REPO, load_script

ROWS = [
    {"question": "Natalia sold clips to 48 of her friends in April. How many?", "answer": "48 + 24 = 72\n#### 72"},
    {"question": "A store had 1,200 apples and sold 400.", "answer": "1,200 - 400 = <<1200-400=800>>800\n#### 800"},
    {"question": "It got 3 degrees colder.", "answer": "The change is -3.\n#### -3"},
    {"question": "Half of 3 is?", "answer": "3 / 2 = 1.5\n#### 1.5"},
    {"question": "How many in total?", "answer": "so 1,600 in all\n#### 1,600"},
]
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'  # verl's instruction_following


def _verl_ground_truth(answer: str) -> str:
    """verl's extract_solution, written out here: the first `#### <number>` match, commas removed."""
    return re.search(r"#### (\-?[0-9\.\,]+)", answer).group(0).split("#### ")[1].replace(",", "")


def _write_raw(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _expected(split, i, ex):
    return {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": ex["question"] + " " + INSTRUCTION}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": _verl_ground_truth(ex["answer"])},
        "extra_info": {"split": split, "index": i, "answer": ex["answer"], "question": ex["question"]},
    }


def test_local_rows_become_verl_rows_in_jsonl_and_parquet(tmp_path):
    raw = tmp_path / "raw"
    raw.mkdir()
    _write_raw(raw / "train.jsonl", ROWS[:3])
    _write_raw(raw / "test.jsonl", ROWS[3:])
    out = tmp_path / "out"
    paths = load_script("prepare_gsm8k").main(
        ["--local_dataset_path", str(raw), "--local_save_dir", str(out), "--formats", "jsonl,parquet"]
    )
    assert sorted(os.path.basename(p) for p in paths) == ["test.jsonl", "test.parquet", "train.jsonl", "train.parquet"]
    assert [_verl_ground_truth(r["answer"]) for r in ROWS] == ["72", "800", "-3", "1.5", "1600"]
    for split, examples in (("train", ROWS[:3]), ("test", ROWS[3:])):
        want = [_expected(split, i, ex) for i, ex in enumerate(examples)]
        with open(out / f"{split}.jsonl", encoding="utf-8") as f:
            assert [json.loads(line) for line in f] == want
        assert pq.read_table(out / f"{split}.parquet").to_pylist() == want
        for fmt in ("jsonl", "parquet"):  # the trainer's loader takes both as verl rows, unchanged
            assert load_rows(str(out / f"{split}.{fmt}")).rows == want


def test_one_file_and_one_line_errors(tmp_path):
    raw = tmp_path / "mine.jsonl"
    _write_raw(raw, ROWS[:2])
    script = os.path.join(REPO, "scripts", "prepare_gsm8k.py")
    run = lambda *a, env=None: subprocess.run(
        [sys.executable, script, *a], capture_output=True, text=True, timeout=120, env=env
    )
    proc = run("--local_dataset_path", str(raw), "--local_save_dir", str(tmp_path / "o"))
    assert proc.returncode == 0, proc.stderr
    with open(tmp_path / "o" / "mine.jsonl", encoding="utf-8") as f:  # one file: its name is the split
        assert [json.loads(line)["extra_info"]["split"] for line in f] == ["mine", "mine"]
    _write_raw(raw, [ROWS[0], {"question": "no answer mark", "answer": "42"}])
    proc = run("--local_dataset_path", str(raw), "--local_save_dir", str(tmp_path / "o"))
    assert proc.returncode == 2 and proc.stderr == f"error: {raw}:2: GSM8K answer has no '####'\n"
    proc = run("--local_dataset_path", str(tmp_path / "nope"))
    assert (
        proc.returncode == 2
        and proc.stderr == f"error: --local_dataset_path={tmp_path / 'nope'}: no such file or directory\n"
    )
    proc = run("--local_dataset_path", str(raw), "--formats", "csv")
    assert proc.returncode == 2 and proc.stderr == "error: --formats='csv': each must be one of ['jsonl', 'parquet']\n"
    no_pyarrow = tmp_path / "no_pyarrow"  # an environment without pyarrow: `import pyarrow` fails
    no_pyarrow.mkdir()
    (no_pyarrow / "sitecustomize.py").write_text("import sys\nsys.modules['pyarrow'] = None\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(no_pyarrow), os.environ.get("PYTHONPATH", "")])}
    proc = run("--local_dataset_path", str(raw), "--formats", "jsonl,parquet", env=env)
    assert proc.returncode == 2 and proc.stderr.startswith("error: --formats includes parquet, which needs pyarrow")
