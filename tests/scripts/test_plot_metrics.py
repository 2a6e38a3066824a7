"""scripts/plot_metrics.py on a synthetic metrics.jsonl."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tests.script_loader import load_script

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "scripts", "plot_metrics.py")


def _module():
    return load_script("plot_metrics")


def _write_run(workdir, with_kl=True):
    os.makedirs(workdir, exist_ok=True)
    rows = [{"step": 0, "val-core/rg/reward/mean@1": 0.2, "data/num_train_prompts": 100}]
    for step in range(1, 9):
        r = {
            "step": step,
            "critic/score/mean": 0.1 * step,
            "critic/score/max": 1.0,
            "critic/score/min": 0.0,
            "response_length/mean": 50 + step,
            "response_length/max": 64,
            "response_length/min": 10,
            "response_length/clip_ratio": 0.1,
            "actor/entropy": 1.0 / step,
            "actor/pg_clipfrac": 0.01 * step,
            "actor/pg_clipfrac_lower": 0.0,
            "timing_s/gen": 2.0,
            "timing_s/reward": 0.5,
            "timing_s/update_actor": 1.0,
            "timing_s/step": 4.0 + step,
            "actor/pg_loss": "nan",
        }
        if with_kl:
            r["actor/ppo_kl"] = 0.001 * step
        rows.append(r)
    rows.append({"step": 8, "val-core/rg/reward/mean@1": 0.6})
    rows.append({"step": 8, "critic/score/mean": 0.99, "timing_s/step": 4.0})  # same step logged again
    with open(os.path.join(workdir, "metrics.jsonl"), "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def test_load_metrics_last_line_wins_and_nan(tmp_path):
    _write_run(tmp_path)
    notes = []
    s = _module().load_metrics(os.path.join(tmp_path, "metrics.jsonl"), note=notes.append)
    assert s["critic/score/mean"][8] == 0.99 and s["critic/score/mean"][3] == pytest.approx(0.3)
    assert s["val-core/rg/reward/mean@1"] == {0: 0.2, 8: 0.6}
    assert np.isnan(s["actor/pg_loss"][1])
    assert notes == []  # one run


def _two_runs(path):
    """An old run (steps 0-5) and a new one (steps 0-2) in one file: what appending used to produce."""
    with open(path, "w") as f:
        for step in range(6):
            f.write(json.dumps({"step": step, "critic/score/mean": 0.5}) + "\n")
        for step in range(3):
            f.write(json.dumps({"step": step, "critic/score/mean": 0.1 * step, "timing_s/step": 1.0}) + "\n")


def test_two_runs_in_one_file_are_never_merged(tmp_path):
    path = os.path.join(tmp_path, "metrics.jsonl")
    _two_runs(path)
    notes = []
    s = _module().load_metrics(path, note=notes.append)
    assert s["critic/score/mean"] == {0: 0.0, 1: 0.1, 2: pytest.approx(0.2)}  # the last run only
    assert notes == [
        f"note: {path} holds 2 runs (the step goes back from 5 to 0 at line 7); plotting only the last run "
        "(lines 7-9); runs are never merged"
    ]
    r = subprocess.run([sys.executable, SCRIPT, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "plotting only the last run (lines 7-9)" in r.stderr, r.stderr


def test_timing_panel_is_stacked_to_step_time(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    _write_run(tmp_path)
    mod = _module()
    s = mod.load_metrics(os.path.join(tmp_path, "metrics.jsonl"))
    fig, ax = plt.subplots()
    assert mod._panel_timing(ax, s)
    labels = [c.get_label() for c in ax.containers]
    assert labels == ["gen", "reward", "update_actor", "other"]
    tops = np.sum([[r.get_height() for r in c] for c in ax.containers], axis=0)
    np.testing.assert_allclose(tops, [s["timing_s/step"][k] for k in sorted(s["timing_s/step"])])
    # step 8 was re-logged with 4.0 s (the later line wins): 0.5 s more than its parts -> 'other'
    plt.close(fig)


@pytest.mark.slow  # a subprocess importing matplotlib and drawing every panel (74 s on 2 shared, loaded cores)
def test_cli_writes_pngs(tmp_path):
    _write_run(tmp_path / "a")
    _write_run(tmp_path / "b", with_kl=False)
    r = subprocess.run([sys.executable, SCRIPT, str(tmp_path / "a")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [
        str(tmp_path / "a" / "plots" / f"{n}.png")
        for n in ("overview", "score", "response_length", "kl", "entropy", "clip_fraction", "timing")
    ]
    _module().main([str(tmp_path / "b"), "--out", str(tmp_path / "b_plots")])
    names = lambda d: sorted(os.listdir(d))
    assert names(tmp_path / "a" / "plots") == [
        "clip_fraction.png",
        "entropy.png",
        "kl.png",
        "overview.png",
        "response_length.png",
        "score.png",
        "timing.png",
    ]
    assert "kl.png" not in names(tmp_path / "b_plots")  # no KL metrics -> panel skipped
    with open(tmp_path / "a" / "plots" / "overview.png", "rb") as f:
        head = f.read(8)
    assert head == b"\x89PNG\r\n\x1a\n"
    assert os.path.getsize(tmp_path / "a" / "plots" / "overview.png") > 20_000


def test_cli_errors(tmp_path):
    r = subprocess.run([sys.executable, SCRIPT, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.splitlines() == [
        f"error: {tmp_path}/metrics.jsonl not found: pass the run working directory (trainer.default_local_dir)"
    ]
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\nnot json\n')
    with pytest.raises(ValueError, match="metrics.jsonl:2"):
        _module().load_metrics(str(tmp_path / "metrics.jsonl"))


@pytest.mark.parametrize(
    "text, line",
    [
        ('{"step": 1}\n[1, 2]\n', "metrics.jsonl:2: not a JSON object"),
        ('{"step": 1, "data/num_prompts": 4}\n', "metrics.jsonl has none of the plotted metrics"),
    ],
)
def test_main_says_one_error_line_for_a_file_it_cannot_plot(tmp_path, capsys, text, line):
    (tmp_path / "metrics.jsonl").write_text(text)
    assert _module().main([str(tmp_path)]) == 2
    (err,) = capsys.readouterr().err.splitlines()
    assert err.startswith(f"error: {tmp_path}/") and line in err


def test_score_panel_puts_extra_reward_keys_on_a_right_axis(tmp_path):
    # A reward-model run logs its RM score as critic/score/* and the rule accuracy as reward/extra/acc/mean;
    # the panel plots both in one figure, the extras (and their validation means) on a twin axis.
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(os.path.join(tmp_path, "metrics.jsonl"), "w") as f:
        for step in range(1, 4):
            row = {"step": step, "critic/score/mean": 2.0 * step, "reward/extra/acc/mean": 0.5 / step}
            if step == 3:
                row["val-core/rg/acc/mean@1"] = 0.25
                row["val-core/rg/reward/mean@1"] = 5.0
            f.write(json.dumps(row) + "\n")
    mod = _module()
    s = mod.load_metrics(os.path.join(tmp_path, "metrics.jsonl"))
    fig, ax = plt.subplots()
    assert mod._panel_score(ax, s)
    left = {ln.get_label(): list(ln.get_ydata()) for ln in ax.get_lines()}
    (ax2,) = [a for a in fig.axes if a is not ax]
    right = {ln.get_label(): list(ln.get_ydata()) for ln in ax2.get_lines()}
    assert left == {"critic/score/mean": [2.0, 4.0, 6.0], "val-core/rg/reward/mean@1": [5.0]}
    assert right == {"reward/extra/acc/mean": pytest.approx([0.5, 0.25, 0.5 / 3]), "val-core/rg/acc/mean@1": [0.25]}
    plt.close(fig)
