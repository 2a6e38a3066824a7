"""scripts/bench_grpo_step.py's parsing and arithmetic on hand-written inputs (no trainer run)."""

import json
import os
from types import SimpleNamespace

import pytest

from tests.script_loader import load_script

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "scripts", "bench_grpo_step.py")


def _module():
    return load_script("bench_grpo_step")


def _step(step, total, update, tokens, p_len, r_len, **extra):
    return {
        "step": step,
        "timing_s/step": total,
        "timing_s/gen": total / 2,
        "timing_s/reward": 0.5,
        "timing_s/update_actor": update,
        "perf/total_num_tokens": tokens,
        "prompt_length/mean": p_len,
        "response_length/mean": r_len,
        "perf/mfu/actor": 0.1 * step,
        **extra,
    }


def test_summarize_metrics_and_real_token_mfu(tmp_path):
    bench = _module()
    rows = [
        {"step": 0, "data/num_rows": 64.0},  # data statistics: no timing, skipped
        _step(3, 14.0, 6.0, 1200.0, 25.0, 35.0),  # out of order on purpose
        _step(1, 100.0, 50.0, 900.0, 20.0, 25.0, **{"timing_s/old_log_prob": 9.0}),  # compile step: excluded
        _step(2, 10.0, 4.0, 1000.0, 20.0, 30.0, **{"timing_s/old_log_prob": 2.0}),
    ]
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + "\n")
    m = bench.summarize_metrics(str(path))
    assert (m["steps"], m["steady_steps"], m["first_step_s"]) == (3, 2, 100.0)
    assert m["step_s"] == 12.0 and m["gen_s"] == 6.0 and m["reward_s"] == 0.5 and m["update_actor_s"] == 5.0
    assert m["old_log_prob_s"] is None  # missing in step 3
    assert m["tokens"] == 1100.0 and m["mean_seq_len"] == 55.0 and m["mfu_trainer"] == pytest.approx(0.25)
    assert m["_per_step"] == [(1000.0, 50.0, 4.0), (1200.0, 60.0, 6.0)]

    # 1 layer, d 2, 1 head of width 2, 1 kv head, MLP width 1, vocab 3: per layer 4 + 8 + 4 + 6 = 22 weights;
    # training FLOPs of a length-T sequence = 3 * (2 * (22 + 6) * T + 4 * 2 * T^2) = 168 T + 24 T^2.
    cfg = SimpleNamespace(
        hidden_size=2, num_heads=1, head_dim=2, num_kv_heads=1, intermediate_size=1, num_layers=1, vocab_size=3
    )
    tok_s, mfu = bench.real_token_mfu(cfg, m["_per_step"], epochs=1, peak=1e6)
    # step 2: 20 x (168*50 + 24*2500) / 4 s = 342,000 FLOP/s; step 3: 20 x (168*60 + 24*3600) / 6 s = 321,600
    assert tok_s == pytest.approx((250.0 + 200.0) / 2)
    assert mfu == pytest.approx((0.342 + 0.3216) / 2)
    _, mfu2 = bench.real_token_mfu(cfg, m["_per_step"], epochs=2, peak=1e6)
    assert mfu2 == pytest.approx(2 * mfu)


def test_summarize_metrics_needs_two_steps(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps(_step(1, 1.0, 1.0, 10.0, 1.0, 1.0)) + "\n")
    with pytest.raises(ValueError, match="need >= 2"):
        _module().summarize_metrics(str(path))


def test_compile_stats():
    lines = [
        "step 0 | data/num_rows=64",
        "W1201 dispatch.py:204] Finished XLA compilation of jit(fn) in 1.5 sec",
        "W1201 pxla.py:712] Compiling jit(fn) with global shapes and types (...)",
        "W1201 dispatch.py:204] Finished XLA compilation of jit(stage) in 0.25 sec",
        "step 1 | score=0.1 | step_s=16.8",
        "W1201 pxla.py:712] Compiling jit(stage) with global shapes and types (...)",  # during step 2
        "step 2 | score=0.1 | step_s=0.3",
        "step 3 | score=0.1 | step_s=0.3",
        "W1201 pxla.py:712] Compiling jit(fn) with global shapes and types (...)",  # after the last step
        "step 3 | val-core/rg/reward/mean@1=0.2",
    ]
    assert _module().compile_stats(lines) == (1.75, 1)
    assert _module().compile_stats(["no step lines", "Compiling jit(fn)"]) == (0.0, None)
