"""The SFT/DPO vs TRL benchmark scripts without a real model: argument parsing, the trainer configs they build,
the GSM8K pair rows, and the tokens/s / ratio arithmetic (checked by hand)."""

import importlib.util
import json
import os
import sys

import pytest

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _load(rel: str, name: str):
    sys.path.insert(0, os.path.join(_REPO, "scripts", "peers"))
    spec = importlib.util.spec_from_file_location(name, os.path.join(_REPO, rel))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


bench = _load("scripts/bench_sft_dpo.py", "bench_sft_dpo")
rows = _load("scripts/peers/gsm8k_rows.py", "gsm8k_rows")
driver = _load("scripts/peers/run_sft_dpo_rounds.py", "run_sft_dpo_rounds")


def test_parse_args_defaults_per_trainer_and_errors():
    a = bench.parse_args(["--trainer", "dpo", "--model-dir", "m", "--data", "d"])
    assert (a.batch, a.micro, a.lr, a.max_length, a.steps) == (4, 2, 5e-7, 512, 3)
    a = bench.parse_args(["--trainer", "sft", "--model-dir", "m", "--data", "d", "--batch", "16"])
    assert (a.batch, a.micro, a.lr) == (16, 2, 1e-5)
    with pytest.raises(SystemExit):
        bench.parse_args(["--trainer", "ppo", "--model-dir", "m", "--data", "d"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--trainer", "sft", "--model-dir", "m", "--data", "d", "--steps", "0"])


def test_make_config_is_the_benchmark_shape(tmp_path):
    a = bench.parse_args(["--trainer", "sft", "--model-dir", "/m", "--data", "/d.jsonl", "--steps", "2"])
    c = bench.make_config(a, str(tmp_path))
    assert c.trainer_type == "sft" and c.model.use_remove_padding and c.model.dtype == "float32"
    assert (c.data.train_batch_size, c.data.micro_batch_size, c.data.max_length) == (8, 2, 512)
    assert (c.data.format, c.data.prompt_key, c.data.response_key) == ("prompt_completion", "prompt", "completion")
    assert c.trainer.total_training_steps == 3 and c.data.val_files is None and c.optim.weight_decay == 0.0
    assert c.data.packing_strategy == "per_step"
    a = bench.parse_args(["--trainer", "sft", "--model-dir", "/m", "--data", "/d", "--packing-strategy", "bfd"])
    assert bench.make_config(a, str(tmp_path)).data.packing_strategy == "bfd"
    # the driver runs ours at TRL's shape: 4 packed rows of 512 per step (the dataset packed by BFD), micro 2
    ours = driver.SHAPE[("jaxrl_post", "sft")]
    assert ours == ["--batch", "4", "--micro", "2", "--packing-strategy", "bfd"]
    assert driver.SHAPE[("trl", "sft")] == ours[:4]
    a = bench.parse_args(["--trainer", "dpo", "--model-dir", "/m", "--data", "/d.jsonl"])
    c = bench.make_config(a, str(tmp_path))
    assert c.trainer_type == "dpo" and c.dpo.loss_type == "sigmoid" and c.dpo.beta == 0.1
    assert c.data.packing_strategy == "per_step"
    a = bench.parse_args(["--trainer", "dpo", "--model-dir", "/m", "--data", "/d", "--packing-strategy", "bfd"])
    assert bench.make_config(a, str(tmp_path)).data.packing_strategy == "bfd"
    assert driver.SHAPE[("jaxrl_post", "dpo")] == ["--batch", "2", "--micro", "1", "--packing-strategy", "bfd"]
    assert (c.data.train_files, c.optim.lr, c.model.path) == ("/d.jsonl", 5e-7, "/m")


def test_summarize_drops_the_warmup_step():
    a = bench.parse_args(["--trainer", "sft", "--model-dir", "m", "--data", "d"])
    r = bench.summarize(a, [10.0, 2.0, 3.0], [(999, 999), (100, 40), (150, 60)])
    assert r["timed_steps"] == 2 and r["warmup_step_s"] == 10.0
    assert r["input_tokens_per_s"] == 50.0 and r["trained_tokens_per_s"] == 20.0  # 250 / 5, 100 / 5
    json.dumps(r)


def test_gsm8k_rows_rejected_changes_only_the_final_number(tmp_path):
    assert rows.wrong_answer("a 3 b\n#### 72") == "a 3 b\n#### 73"
    assert rows.wrong_answer("x\n#### 1,000") == "x\n#### 1001"
    with pytest.raises(ValueError, match="no final"):
        rows.wrong_answer("no number here")
    src = tmp_path / "train.jsonl"
    src.write_text(
        json.dumps({"question": "q?", "answer": "so 2\n#### 5"})
        + "\n"
        + json.dumps({"question": "z", "answer": "#### 1"})
        + "\n"
    )
    rows.write_rows(str(tmp_path / "out"), 1, src=str(src))
    dpo = [json.loads(x) for x in (tmp_path / "out" / "dpo.jsonl").read_text().splitlines()]
    sft = [json.loads(x) for x in (tmp_path / "out" / "sft.jsonl").read_text().splitlines()]
    assert len(dpo) == len(sft) == 1
    assert dpo[0]["prompt"] == [{"role": "user", "content": "q?"}] == sft[0]["prompt"]
    assert dpo[0]["chosen"][0]["content"] == "so 2\n#### 5" and dpo[0]["rejected"][0]["content"] == "so 2\n#### 6"


def test_driver_summary_medians_and_ratios():
    rec = lambda s, i, t, m: dict(trainer="sft", system=s, input_tokens_per_s=i, trained_tokens_per_s=t, rss_mb=m)
    recs = [rec("jaxrl_post", 100, 50, 4000), rec("jaxrl_post", 300, 70, 6000), rec("trl", 50, 20, 5000)]
    s = driver.summarize(recs)["sft"]
    assert s["jaxrl_post"] == {"input_tokens_per_s": 200, "trained_tokens_per_s": 60, "rss_mb": 5000, "runs": 2}
    assert s["ratio"] == {"input_tokens_per_s": 4.0, "trained_tokens_per_s": 3.0, "rss_mb": 1.0}
    assert "| sft | ours / TRL | | 4.00x | 3.00x | 1.00x |" in driver.table({"sft": s})


def test_token_counter_maps_bfd_rows_to_their_examples():
    from types import SimpleNamespace as NS

    import numpy as np

    pairs = [
        NS(prompt_ids=[0] * p, chosen_ids=[0] * c, rejected_ids=[0] * r)
        for p, c, r in [(2, 3, 4), (1, 1, 1), (5, 0, 2)]
    ]
    t = NS(packed_rows=None, train=NS(pairs=pairs))
    assert bench.token_counter("dpo", t)([0, 2]) == (2 * 2 + 3 + 4 + 2 * 5 + 0 + 2, 3 + 4 + 0 + 2)
    t.packed_rows = [[2, 1], [0]]  # row 0 holds pairs 2 and 1
    assert bench.token_counter("dpo", t)([0]) == (2 * 5 + 2 + 2 * 1 + 1 + 1, 2 + 1 + 1)
    ids, mask = [np.zeros(3), np.zeros(4)], [np.array([0, 1, 1]), np.array([1, 1, 1, 1])]
    t = NS(packed_rows=[[1, 0]], train=NS(input_ids=ids, loss_mask=mask))
    assert bench.token_counter("sft", t)([0]) == (7, 6)


def test_matmul_floor_counts_every_matmul_flop_of_a_training_step():
    """The linears' and LM head's FLOPs over forward + both gradients are 6 x tokens x their parameters (SmolLM2-135M:
    134,515,008 parameters less 61 RMSNorm weights of 576), and the attention core's 6 products per layer are
    2 x row_len^2 x head_dim each per (row, head): all by hand, not from the script."""
    floor = _load("scripts/bench_matmul_floor.py", "bench_matmul_floor")
    tokens, row_len = 1024, 512
    mm = floor.matmuls(floor.SMOLLM2_135M, tokens, row_len)
    flops = {name: count * 2 * m * k * n * b for name, count, (m, k, n), b in mm}
    assert sum(v for name, v in flops.items() if not name.startswith("attn")) == 6 * tokens * (134_515_008 - 61 * 576)
    attn = sum(count * 2 * m * k * n * b for name, count, (m, k, n), b in mm if name.startswith("attn"))
    assert attn == 30 * 6 * (2 * row_len * row_len * 64) * (tokens // row_len) * 9
    assert floor.time_jax(8, 8, 8, 1, reps=1) > 0
