"""scripts/simulate_async.py: the step timeline of sync, one_step_off and fully_async (partial rollout,
staleness 2) on a case small enough to compute by hand, and the staleness bound on a long-tailed case."""

import dataclasses

import pytest

from tests.script_loader import load_script

sim = load_script("simulate_async")

# a decode dispatch of K = 4 steps costs 4 s (1 byte per step at 1 byte/s); prefill and KV reads are free
COST = sim.Cost(step_bytes=1, kv_token_bytes=0, bandwidth=1, weight_bytes=0, prefill_flops_per_token=0, peak_flops=1)
# every response has 8 tokens (sigma 0); a step trains 2 x 2 prompts of 2 samples; 8 slots hold a whole step's batch
TINY = sim.Workload(
    share=2, n=2, prompt_len=4, max_response=8, mean=8.0, sigma=0.0, max_num_seqs=8, k=4, block_size=4,
    num_pages=64, max_tokens=64, train_s=3.0,
)  # fmt: skip


@pytest.mark.parametrize("train_s", [3.0, 6.0])
def test_timeline_by_hand(train_s):
    """8 tokens each = 2 dispatches = G = 8 s whether a device generates 4 sequences (sync: its half) or 8 (the
    split's rollout device: all fit the 8 slots). sync: G + train_s (each device trains its half). Split: the
    trainer trains the whole batch alone, T = 2 x train_s, and the step is max(G, T): 8 s when train_s = 3,
    12 s when 6 (then the rollout waits for each publication). fully_async keeps the 8 slots busy (64 tokens of
    a step at 8 tokens per 4 s: 8 s) and is trainer-bound at T = 12 s the same way."""
    w = dataclasses.replace(TINY, train_s=train_s)
    res = sim.run("tiny", 8, w, COST)
    by = {r["mode"]: r for r in res["modes"]}
    g, t = 8.0, 2 * train_s
    assert res["generation_split_s"] == g and res["train_split_s"] == t
    assert by["sync"]["step_s"] == g + train_s
    assert by["one_step_off"]["step_s"] == max(g, t)
    assert by["fully_async"]["step_s"] == max(g, t)
    assert by["one_step_off"]["vs_sync"] == pytest.approx((g + train_s) / max(g, t))
    # staleness: sync 0; one_step_off: batch 0 (version 0) at step 0, then batch t (version t - 1) at step t
    assert by["sync"]["staleness_hist"] == {0: 8 * 4}
    assert by["one_step_off"]["staleness_hist"] == {0: 4, 1: 7 * 4}
    assert max(by["fully_async"]["staleness_hist"]) <= 2 and by["fully_async"]["dropped"] == {}
    # one_step_off: step 0 ends at G + T (batch 0 first), then one every max(G, T): the trainer busy 8 T of that
    assert by["one_step_off"]["total_s"] == g + t + 7 * max(g, t)
    assert by["one_step_off"]["trainer_idle"] == pytest.approx(1 - 8 * t / (g + t + 7 * max(g, t)))
    assert res["goal_one_step_off"]


def test_long_tail_staleness_bound_and_accounting():
    """Lognormal lengths (sigma 1, capped at 64) with a fast trainer: groups that start early and finish late
    exceed staleness 2 and are dropped, counted; no trained group is staler than 2, and every group produced is
    trained once, dropped once, or still queued."""
    w = dataclasses.replace(TINY, mean=12.0, sigma=1.0, max_response=64, num_pages=256, train_s=1.0)
    for mode in ("one_step_off", "fully_async"):
        r = sim.simulate_split(mode, w, COST, 12)
        limit = 1 if mode == "one_step_off" else 2
        assert max(r["staleness_hist"]) <= limit, (mode, r["staleness_hist"])
        assert sum(r["staleness_hist"].values()) == r["trained"] == 12 * 4
        assert r["trained"] + sum(r["dropped"].values()) + r["queued"] == r["produced"]
    assert r["dropped"]["stale"] > 0  # fully_async: the tail's groups, started early, came back too stale
    assert r["resumed"] > 0 and r["swaps"] >= 11  # partial rollout stopped and resumed sequences at publications


@pytest.mark.parametrize(
    "argv, line",
    [
        (["--platform", "cpu,nope"], "error: --platform: unknown nope (each one of cpu, h200, h200_tokens)"),
        (["--steps", "0"], "error: --steps must be >= 1 and --sigma >= 0, got 0, 1.0"),
    ],
)
def test_bad_arguments_are_one_usage_error(capsys, argv, line):
    # --steps 0 was a ZeroDivisionError and an unknown platform a ValueError traceback
    with pytest.raises(SystemExit) as e:
        sim.main(argv)
    assert e.value.code == 2 and capsys.readouterr().err.splitlines()[-1].endswith(line)
