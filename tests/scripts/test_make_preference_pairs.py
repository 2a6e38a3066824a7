"""scripts/make_preference_pairs.py: pairs from scored samples, by hand."""

import json

import pytest

from jaxrl_post.data.preference import load_preference_pairs
from jaxrl_post.models.char_tokenizer import build_char_tokenizer
from tests.script_loader import load_script


def _gen(q, out, score, uid, acc=None):
    row = dict(raw_prompt=[{"role": "user", "content": q}], input=q, output=out, score=score, uid=uid, step=0)
    if acc is not None:
        row["acc"] = acc
    return row


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _read(path):
    return [json.loads(line) for line in open(path)]


def test_pairs_by_hand(tmp_path, capsys):
    mp = load_script("make_preference_pairs")
    rows = [
        # "1+1": right "2" twice (deduplicated), wrong "3" and "4": 2 distinct pairs possible
        _gen("1+1", "2", 1.0, "0/a"),
        _gen("1+1", "2", 1.0, "0/a"),
        _gen("1+1", "3", 0.0, "0/a"),
        _gen("1+1", "4", 0.0, "0/a"),
        _gen("2+2", "4", 1.0, "0/b"),  # all right: no pair
        _gen("2+2", "4", 1.0, "0/b"),
        _gen("3+3", "5", 0.0, "0/c"),  # all wrong: no pair
        # `acc` decides over `score` (a shaped score of 1.0 on a wrong answer)
        _gen("4+4", "8", 0.2, "1/d", acc=1.0),
        _gen("4+4", "9", 1.0, "1/d", acc=0.0),
        _gen("5+5", "10", 1.0, "1/e"),  # in the excluded (held-out) file
        _gen("5+5", "11", 0.0, "1/e"),
    ]
    gens = _write(tmp_path / "0.jsonl", rows)
    held_out = _write(tmp_path / "held.jsonl", [_gen("5+5", "10", 1.0, "0/z")])
    out = tmp_path / "pairs"
    args = [gens, "--out-dir", str(out), "--exclude", held_out, "--pairs-per-prompt", "5", "--val-fraction", "0"]
    stats = mp.main(args)
    assert stats == dict(
        prompts=5, excluded=1, all_right=1, all_wrong=1, with_pairs=2, pairs=3, train_pairs=3, val_pairs=0
    )
    got = {
        (r["prompt"][0]["content"], r["chosen"][0]["content"], r["rejected"][0]["content"])
        for r in _read(out / "train.jsonl")
    }
    assert got == {("1+1", "2", "3"), ("1+1", "2", "4"), ("4+4", "8", "9")}
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == stats
    # the rows are TRL conversational pairs the DPO / RM data loader reads
    data = load_preference_pairs(str(out / "train.jsonl"), build_char_tokenizer(), max_length=64)
    assert len(data) == 3


def test_split_keeps_each_prompt_on_one_side(tmp_path):
    mp = load_script("make_preference_pairs")
    rows = []
    for i in range(20):
        rows.append(_gen(f"q{i}", "right", 1.0, f"0/{i}"))
        rows += [_gen(f"q{i}", f"w{j}", 0.0, f"0/{i}") for j in range(3)]
    gens = _write(tmp_path / "0.jsonl", rows)
    mp.main([gens, "--out-dir", str(tmp_path), "--pairs-per-prompt", "2", "--val-fraction", "0.25"])
    train, val = _read(tmp_path / "train.jsonl"), _read(tmp_path / "val.jsonl")
    assert (len(train), len(val)) == (30, 10)
    prompts = lambda rs: {r["prompt"][0]["content"] for r in rs}
    assert len(prompts(val)) == 5 and not prompts(train) & prompts(val)


def test_malformed_rows_name_file_and_line(tmp_path):
    mp = load_script("make_preference_pairs")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(_gen("1+1", "2", 1.0, "0/a")) + "\n{not json\n")
    with pytest.raises(SystemExit, match=r"bad.jsonl:2: invalid JSON"):
        mp.main([str(bad), "--out-dir", str(tmp_path / "o")])
    bad.write_text(json.dumps({"output": "2", "score": 1.0}) + "\n")
    with pytest.raises(SystemExit, match=r"bad.jsonl:1: missing key\(s\) \['raw_prompt', 'uid'\]"):
        mp.main([str(bad), "--out-dir", str(tmp_path / "o")])
    only_right = tmp_path / "r.jsonl"
    _write(only_right, [_gen("1+1", "2", 1.0, "0/a")])
    with pytest.raises(SystemExit, match="no prompt has both a right and a wrong response"):
        mp.main([str(only_right), "--out-dir", str(tmp_path / "o")])
