"""The paged engine's memory plan (rollout/paged/plan.py): the rollout rows' arithmetic by hand, and the compiled
decode program at Qwen2.5-7B's shapes, whose memory is set by the page budget, not by the batch or R_max."""

import dataclasses

import pytest

from jaxrl_post.models import get_preset
from jaxrl_post.rollout.paged import plan

QWEN7B = get_preset("qwen2_5_7b")


def test_rollout_row_by_hand():
    # Qwen2.5-7B: 28 layers x (K, V) x 4 kv heads x 128 x 2 bytes = 56 KiB per token (issue 56's number)
    assert plan.kv_bytes_per_token(QWEN7B) == 28 * 2 * 4 * 128 * 2 == 56 * 1024
    assert plan.kv_bytes_per_token(QWEN7B, tp=4) == 14 * 1024  # one kv head per chip
    assert plan.kv_bytes_per_token(QWEN7B, tp=8) == 14 * 1024  # replicated past the kv heads
    r = plan.rollout_row("x", QWEN7B, "v5p", chips=32, gpu_memory_utilization=0.9, max_num_seqs=256)
    w = QWEN7B.num_params() * 2
    pool = 0.9 * 95e9 - w - 256 * 152064 * 4
    assert r["weights_gb"] == pytest.approx(w / 1e9) and r["pool_gb"] == pytest.approx(pool / 1e9)
    assert r["pages"] == int(pool // (56 * 1024 * 16))
    held = 1024 / 16 + 5000 + 8  # shared prompt pages, mean response, half a page
    assert r["paged_seqs_per_group"] == pytest.approx(r["pages"] * 16 / held)
    assert r["dense_rows_per_group"] == pytest.approx(pool / (56 * 1024 * (1024 + 16384)))
    assert r["dense_cache_gb_total"] == pytest.approx(56 * 1024 * 512 * 16 * 17408 / 1e9)  # 8.2 TB (issue 56)
    assert r["paged_seqs_total"] == pytest.approx(min(32 * r["paged_seqs_per_group"], 512 * 16))


@pytest.mark.slow  # two XLA:CPU compiles of a 7B-wide decode step (~5 s each when the machine is quiet)
def test_decode_memory_at_7b_shapes_is_set_by_the_page_budget():
    """One layer of Qwen2.5-7B's real shapes (full vocabulary, bf16 weights; fewer layers only to compile fast:
    each layer adds its weights and pool pages), 8 slots, one decode step, the float32 pool the engine uses on
    CPU. The batch never enters the decode program (slots are fixed); R_max enters only as the page-table width,
    which `max_model_len` fixes: 512 x 16 prompts with R_max 16k and 64 x 16 with R_max 4k lower to the same
    program. Twice the pages: the arguments grow by exactly the pool's bytes, the temporaries not at all, and the
    pool is donated (updated in place)."""
    cfg = dataclasses.replace(QWEN7B, num_layers=1)
    kw = dict(max_num_seqs=8, steps_per_dispatch=1, max_model_len=1024 + 16384, scan_layers=False)
    eng = plan.abstract_engine(cfg, num_pages=2048, **kw)
    big, small = (plan.decode_program(eng, 1024, r, "float32") for r in (16384, 4096))
    assert big.as_text() == small.as_text()
    m1 = plan.decode_memory(big)
    pool1 = plan.engine_pool_bytes(eng, "float32")
    assert pool1 == 2048 * 16 * 8 * 128 * 4
    s, pps, v = 8, (1024 + 16384) // 16, cfg.vocab_size
    # weights + pool + [S, V] f32 logits + idx, pos, t, rows, limit [S] int32 + done [S] bool + tables + the key
    assert m1["arguments"] == cfg.num_params() * 2 + pool1 + s * v * 4 + 5 * s * 4 + s + s * pps * 4 + 8
    assert m1["aliased"] == pool1 + s * v * 4  # pool and logits donated
    eng2 = plan.abstract_engine(cfg, num_pages=4096, **kw)
    m2 = plan.decode_memory(plan.decode_program(eng2, 1024, 16384, "float32"))
    assert m2["arguments"] - m1["arguments"] == plan.engine_pool_bytes(eng2, "float32") - pool1 == pool1
    assert m2["temps"] == m1["temps"] < pool1


def test_memory_plan_prints_the_rollout_rows(capsys):
    from tests.script_loader import load_script

    rows = load_script("memory_plan").main(["--rollout"])
    assert [r["plan"] for r in rows] == list(plan.ROLLOUT_PLANS)
    tp4 = rows[3]  # 32B, rollout TP 4 on v5p: a quarter of the weights and of the kv heads per chip
    assert tp4["weights_gb"] == pytest.approx(get_preset("qwen3_32b").num_params() * 2 / 4 / 1e9)
    assert tp4["kv_per_token_kib"] == 64 * 2 * 2 * 128 * 2 / 1024
    assert "| 32b_v5p64_tp4 | 32 x TPU v5p | 4 |" in capsys.readouterr().out
