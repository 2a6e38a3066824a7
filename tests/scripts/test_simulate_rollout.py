"""scripts/simulate_rollout.py on a case small enough to follow by hand: the real scheduler's dispatches, the
pages each decode step reads, the dense waves' compaction, and the bandwidth bound."""

import pytest

from tests.script_loader import load_script

sim = load_script("simulate_rollout")

# 100 bytes per step besides the KV, 1 byte per token of context, 1 byte/s: seconds == bytes
COST = sim.Cost(step_bytes=100, kv_token_bytes=1, bandwidth=1, weight_bytes=7, prefill_flops_per_token=0, peak_flops=1)


def test_paged_simulation_by_hand():
    """One prompt of 4 tokens (one full page of 4, shared by its 2 samples: no copy), samples of 3 and 5 tokens,
    2 slots, K = 4. Dispatch 1: both decode; at step j a slot reads ceil((4 + min(j, emitted) + 1) / 4) pages:
    2 + 2 + 2 + 2 each = 16 pages. The 3-token sample is done; dispatch 2: the other one at length 8 emits 1 token
    (3 pages at every step: 12) and the freed slot reads the null page (4): 16. 32 pages x 4 tokens = 128 bytes
    + 8 steps x 100 = 928 s of decode, plus one prefill dispatch (max(7 B of weights / 1, 0 FLOPs) = 7 s)."""
    out = sim.simulate_paged(
        4, [3, 5], 2, max_response=8, num_pages=16, block_size=4, max_num_seqs=2, max_tokens=16, k=4, cost=COST
    )
    assert (out["prefill_dispatches"], out["decode_dispatches"], out["decode_steps"]) == (1, 2, 8)
    assert out["emitted"] == 8 and out["kv_pages_read"] == 32 and out["preemptions"] == 0
    assert out["decode_seconds"] == 928 and out["seconds"] == 935
    assert out["occupancy"] == 8 / 16  # emitted tokens / (slots x decode steps)
    assert out["tail_seconds"] == 928  # everything after the last admission
    # a length past R_max stops at R_max
    capped = sim.simulate_paged(
        4, [3, 50], 2, max_response=8, num_pages=16, block_size=4, max_num_seqs=2, max_tokens=16, k=4, cost=COST
    )
    assert capped["emitted"] == 3 + 8


def test_dense_simulation_by_hand():
    """2 rows of 4 + 8 slots, lengths 3 and 5: 3 steps at 2 rows (100 + 24 each), then one row is left, at most
    half of 2: compacted to 1 row for the last 2 steps (100 + 12 each): 596 s, plus the wave's prefill (7 s)."""
    out = sim.simulate_dense(4, [3, 5], max_response=8, rows=2, cost=COST, min_rows=1)
    assert out["decode_steps"] == 5 and out["seconds"] == 3 * 124 + 2 * 112 + 7
    assert out["tokens_per_s"] == pytest.approx(8 / 603)


def test_bandwidth_bound_by_hand():
    """Lengths 3 and 5 after a prompt of 4: mean context per token (3 x 6 + 5 x 7) / 8 = 6.625; held per sequence
    4 / 2 + 2.625 + 2 = 6.625 tokens; a pool of 53 tokens holds 8 sequences (max_num_seqs 100):
    8 / (100 + 8 x 6.625) tokens/s."""
    bound, seqs = sim.bandwidth_bound(4, [3, 5], 2, pool_tokens=53, max_num_seqs=100, block_size=4, cost=COST)
    assert seqs == pytest.approx(8.0) and bound == pytest.approx(8 / (100 + 8 * 6.625))
    assert sim.bandwidth_bound(4, [3, 5], 2, pool_tokens=53, max_num_seqs=4, block_size=4, cost=COST)[1] == 4


def test_lognormal_lengths_are_capped_and_have_the_mean():
    x = sim.lognormal_lengths(20000, 500.0, 0.5, 4000, seed=1)
    assert x.min() >= 1 and x.max() <= 4000 and abs(x.mean() / 500 - 1) < 0.02


def test_retime_changes_only_the_step_cost():
    out = sim.simulate_paged(
        4, [3, 5], 2, max_response=8, num_pages=16, block_size=4, max_num_seqs=2, max_tokens=16, k=4, cost=COST
    )
    other = sim.Cost(
        step_bytes=10, kv_token_bytes=1, bandwidth=1, weight_bytes=7, prefill_flops_per_token=0, peak_flops=1
    )
    got = sim.retime(out, COST, other)
    assert got["seconds"] == 8 * 10 + 128 + 7 and got["tail_seconds"] == 8 * 10 + 128
    assert got["tokens_per_s"] == pytest.approx(8 / 215)


def test_logged_lengths_are_read_and_stretched(tmp_path):
    """`--lengths` reads trainer.rollout_data_dir's files (a directory: every <step>.jsonl in name order) or a JSON
    list; `--lengths-max 256` stretches a run's lengths to a plan's R_max (x 16384 / 256 = 64, rounded up, capped)."""
    d = tmp_path / "rollouts"
    d.mkdir()
    (d / "1.jsonl").write_text('{"response_length": 3.0, "output": "a"}\n{"response_length": 256.0}\n')
    (d / "2.jsonl").write_text('{"response_length": 100.0}\n')
    assert sim.read_lengths(str(d)) == [3, 256, 100]
    assert sim.read_lengths(str(d / "2.jsonl")) == [100]
    (tmp_path / "l.json").write_text("[5, 7]")
    assert sim.read_lengths(str(tmp_path / "l.json")) == [5, 7]
    assert sim.stretch_lengths([3, 256, 100, 300], 256, 16384).tolist() == [192, 16384, 6400, 16384]
    assert sim.stretch_lengths([3, 20000], None, 16384).tolist() == [3, 16384]
    assert sim.stretch_lengths([1], 48, 16384).tolist() == [342]  # 341.3 rounded up
    (d / "3.jsonl").write_text("")
    with pytest.raises(ValueError, match="no response lengths"):
        sim.read_lengths(str(d / "3.jsonl"))


def test_step_bytes_follow_the_decode_batch_by_hand():
    """With `Cost.rows` the non-weight bytes of a step scale with its batch: 100 bytes at 16 rows, 20 of them
    weights, so a step of the engine's 8-row batch (2 sequences in 16 slots: decode sizes 8, 16) moves
    20 + 80 x 8 / 16 = 60. The by-hand case above in 16 slots: 8 steps x 60 = 480, the 16 real pages as there
    plus 6 padding entries x 4 steps on the null page (dispatch 1), 12 + 7 x 4 (dispatch 2): 80 pages x 4 tokens =
    320; + the prefill (20 bytes of weights: 20 s). The dense engine's 2 rows (then 1) cost 20 + 80 x 2 / 16 = 30
    (25) + the KV; retimed to `rows` 0 the paged run pays 100 a step."""
    cost = sim.Cost(
        step_bytes=100, kv_token_bytes=1, bandwidth=1, weight_bytes=20, prefill_flops_per_token=0, peak_flops=1, rows=16
    )
    out = sim.simulate_paged(
        4, [3, 5], 2, max_response=8, num_pages=16, block_size=4, max_num_seqs=16, max_tokens=16, k=4, cost=cost
    )
    assert out["kv_pages_read"] == 80 and out["row_steps"] == 2 * 4 * 8
    assert out["decode_seconds"] == 8 * 60 + 320 and out["seconds"] == 8 * 60 + 320 + 20
    dense = sim.simulate_dense(4, [3, 5], max_response=8, rows=2, cost=cost, min_rows=1)
    assert dense["seconds"] == 3 * (30 + 24) + 2 * (25 + 12) + 20
    flat = sim.Cost(**{**cost.__dict__, "rows": 0})
    assert sim.retime(out, cost, flat)["decode_seconds"] == 8 * 100 + 320
