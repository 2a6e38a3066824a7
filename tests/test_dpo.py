"""DPO: preference rows -> ids (by hand on the character tokenizer), errors naming file and row, the batch
layouts, the losses against TRL 1.16's DPOTrainer (loss, metrics and gradients on a tiny Llama), and a tiny
end-to-end run through main.py's trainer with resume."""

from __future__ import annotations

import json

import pytest

from jaxrl_post.data.preference import collate_pairs, load_preference_pairs, pair_ids, tokenize_pairs
from jaxrl_post.data.rows import MalformedRowError
from jaxrl_post.trainer.char_tokenizer import CHARS, build_char_tokenizer

S, E = 1, 2  # <|im_start|>, <|im_end|> (= eos) of the character tokenizer


def c(text: str) -> list[int]:
    """Character-tokenizer ids of plain text, by hand: 4 + the index in CHARS."""
    return [4 + CHARS.index(ch) for ch in text]


def turn(role: str, content: str) -> list[int]:
    return [S] + c(f"{role}\n{content}") + [E] + c("\n")


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def _write(tmp_path, rows, name="p.jsonl"):
    p = tmp_path / name
    p.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(p)


# ----------------------------------------------------------------------------------------- data formats
def test_plain_explicit_and_implicit_prompt(tok):
    assert pair_ids(tok, {"prompt": "2+2=", "chosen": "4", "rejected": "5"}) == (c("2+2="), c("4") + [E], c("5") + [E])
    # implicit: the common prefix (TRL extract_prompt; the space before the split goes to the completions)
    p, ch, rj = pair_ids(tok, {"chosen": "The sky is blue.", "rejected": "The sky is green."})
    assert (p, ch, rj) == (c("The sky is"), c(" blue.") + [E], c(" green.") + [E])
    # a completion already ending with the eos token gets no second one
    assert pair_ids(tok, {"prompt": "a", "chosen": "b<|im_end|>", "rejected": "c"})[1] == c("b") + [E]


def test_conversational_explicit_and_implicit_prompt(tok):
    user = [{"role": "user", "content": "hi"}]
    yes, no = [{"role": "assistant", "content": "yo"}], [{"role": "assistant", "content": "no"}]
    gen = turn("user", "hi") + [S] + c("assistant\n")  # prompt + the generation prompt
    want = (gen, c("yo") + [E], c("no") + [E])  # through <|im_end|>, not the template's "\n" after it
    assert pair_ids(tok, {"prompt": user, "chosen": yes, "rejected": no}) == want
    assert pair_ids(tok, {"chosen": user + yes, "rejected": user + no}) == want
    # multi-turn completion: everything after the prompt through the last assistant turn's end token
    two = yes + [{"role": "user", "content": "?"}, {"role": "assistant", "content": "k"}]
    _, ch, _ = pair_ids(tok, {"prompt": user, "chosen": two, "rejected": no})
    assert ch == c("yo") + [E] + c("\n") + turn("user", "?") + [S] + c("assistant\nk") + [E]


def test_errors_name_file_and_row(tok, tmp_path):
    good = {"prompt": "a", "chosen": "b", "rejected": "c"}
    cases = {
        "missing": ({"prompt": "a", "chosen": "b"}, r"missing 'rejected'"),
        "empty": ({"prompt": "a", "chosen": " ", "rejected": "c"}, r"empty completion \('chosen'\)"),
        "equal": ({"prompt": "a", "chosen": "b", "rejected": "b"}, r"'chosen' equals 'rejected'"),
        "mixed": (
            {"prompt": "a", "chosen": [{"role": "assistant", "content": "b"}], "rejected": "c"},
            "must all be strings",
        ),
        "no_asst": (
            {
                "prompt": [{"role": "user", "content": "a"}],
                "chosen": [{"role": "user", "content": "b"}],
                "rejected": [{"role": "assistant", "content": "c"}],
            },
            r"no assistant turn in 'chosen'",
        ),
    }
    for name, (row, msg) in cases.items():
        f = _write(tmp_path, [good, row], f"{name}.jsonl")
        with pytest.raises(
            MalformedRowError, match=rf"{name}\.jsonl, row 1 \(line 2\): malformed preference row.*{msg}"
        ):
            load_preference_pairs(f, tok, max_length=32)
    bad_json = _write(tmp_path, [good, "{nope"], "j.jsonl")
    with pytest.raises(MalformedRowError, match=r"j\.jsonl, row 1 \(line 2\).*invalid JSON"):
        load_preference_pairs(bad_json, tok, max_length=32)
    f = _write(tmp_path, [good, cases["equal"][0], good], "skip.jsonl")
    d = load_preference_pairs(f, tok, max_length=32, skip_malformed=True)
    assert len(d) == 2 and d.stats["data/num_skipped_malformed"] == 1
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_preference_pairs(str(tmp_path / "nope.jsonl"), tok, max_length=32)


def test_overlong_error_truncate_or_skip(tok):
    rows = [
        ("f, row 0", {"prompt": "abcd", "chosen": "xyz", "rejected": "w"}),
        ("f, row 1", {"prompt": "a", "chosen": "b", "rejected": "c"}),
    ]
    # prompt 4 + chosen 4 (xyz + eos) = 8 > 6
    with pytest.raises(
        MalformedRowError, match=r"f, row 0: overlong: prompt \+ completion = 8 tokens > data.max_length=6"
    ):
        tokenize_pairs(iter(rows), tok, max_length=6)
    d = tokenize_pairs(iter(rows), tok, max_length=6, truncation="keep_start")
    x = d[0]
    assert (x.prompt_ids.tolist(), x.chosen_ids.tolist(), x.rejected_ids.tolist()) == (c("abcd"), c("xy"), c("w") + [E])
    d = tokenize_pairs(iter(rows), tok, max_length=6, truncation="keep_end")
    assert d[0].prompt_ids.tolist() == c("cd") and d[0].chosen_ids.tolist() == c("xyz") + [E]
    assert d.stats["data/num_truncated"] == 1
    with pytest.raises(
        MalformedRowError, match=r"f, row 0: overlong: the prompt has 4 tokens > data.max_prompt_length=3"
    ):
        tokenize_pairs(iter(rows), tok, max_length=16, max_prompt_length=3)
    d = tokenize_pairs(iter(rows), tok, max_length=16, max_prompt_length=3, truncation="keep_start")
    assert d[0].prompt_ids.tolist() == c("bcd")  # the prompt keeps its end
    d = tokenize_pairs(iter(rows), tok, max_length=6, filter_overlong=True)
    assert len(d) == 1 and d.stats["data/num_filtered_overlong"] == 1 and d[0].where == "f, row 1"
    # keep_start with a prompt filling max_length: no completion token would be left (TRL drops such rows)
    with pytest.raises(MalformedRowError, match=r"the prompt alone has 4 tokens >= data.max_length=4"):
        tokenize_pairs(iter(rows), tok, max_length=4, truncation="keep_start")


def test_collate_pairs_chosen_rows_then_rejected_rows(tok):
    d = tokenize_pairs(
        [
            ("r0", {"prompt": "ab", "chosen": "c", "rejected": "de"}),
            ("r1", {"prompt": "f", "chosen": "g", "rejected": "h"}),
        ],
        tok,
        max_length=8,
    )
    b = collate_pairs(d.pairs, max_length=6)
    assert b["input_ids"].tolist() == [
        c("abc") + [E, 0, 0],
        c("fg") + [E, 0, 0, 0],
        c("abde") + [E, 0],
        c("fh") + [E, 0, 0, 0],
    ]
    assert b["attention_mask"].sum(1).tolist() == [4, 3, 5, 3]
    assert b["loss_mask"].tolist()[2] == [0, 0, 1, 1, 1, 0]
    assert b["positions"][2].tolist() == [0, 1, 2, 3, 4, 0]
    with pytest.raises(ValueError, match="does not fit max_length=4"):
        collate_pairs(d.pairs, max_length=4)
