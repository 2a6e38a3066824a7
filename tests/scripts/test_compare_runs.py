"""scripts/compare_runs.py on two synthetic runs: the summary values by hand, the table, the PNG, the errors."""

import json
import os

import pytest

from tests.script_loader import load_script

VAL = "val-core/rg/reward/mean@1"


def _write(workdir, rows):
    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, "metrics.jsonl"), "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def _run(step_s, stale=None):
    rows = [{"step": 0, VAL: 0.25}]
    for t in range(1, 13):
        r = {"step": t, "critic/score/mean": 0.1 * t, "timing_s/step": step_s(t)}
        if stale is not None:
            r["async/staleness/max"] = stale(t)
        rows.append(r)
    rows[-1][VAL] = 0.5
    return rows


def test_summary_table_and_plot(tmp_path):
    mod = load_script("compare_runs")
    _write(tmp_path / "a", _run(lambda t: 60.0 if t == 1 else 10.0 + t))
    _write(tmp_path / "b", _run(lambda t: 5.0, stale=lambda t: min(t - 1, 2)))
    out, js = str(tmp_path / "c.png"), str(tmp_path / "c.json")
    rc = mod.main([str(tmp_path / "a"), str(tmp_path / "b"), "--labels", "sync,async", "--out", out, "--json", js])
    assert rc == 0 and os.path.getsize(out) > 10_000
    with open(js) as f:
        got = json.load(f)
    a, b = got["sync"], got["async"]
    # by hand: the last 10 of 0.1 .. 1.2 are 0.3 .. 1.2 (mean 0.75); steps 2..12 take 12..22 s (median 17); the
    # sum adds step 1's 60 s: 60 + sum(12..22) = 60 + 187
    assert a["score_last"] == pytest.approx(0.75) and a["step_s_median"] == 17.0 and a["steps_s_total"] == 247.0
    assert (a["val_first"], a["val_last"], a["val_first_step"], a["val_last_step"]) == (0.25, 0.5, 0.0, 12.0)
    assert a["staleness_max"] == 0.0 and b["staleness_max"] == 2.0 and a["steps"] == 12.0
    assert b["step_s_median"] == 5.0 and b["steps_s_total"] == 60.0


def test_bad_inputs_are_one_error_line(tmp_path, capsys):
    mod = load_script("compare_runs")
    _write(tmp_path / "a", [{"step": 0, VAL: 0.1}])  # a validation-only file: no training score
    assert mod.main([str(tmp_path / "a"), "--out", str(tmp_path / "x.png")]) == 2
    assert "no critic/score/mean logged" in capsys.readouterr().err
    assert mod.main([str(tmp_path / "missing"), "--out", str(tmp_path / "x.png")]) == 2
    assert "error:" in capsys.readouterr().err
    assert mod.main([str(tmp_path / "a"), "--labels", "x,y"]) == 2
    assert mod.main([str(tmp_path / "a"), "--window", "0"]) == 2
    assert "--window 0: must be >= 1" in capsys.readouterr().err
