"""metrics.jsonl belongs to one run: moved aside for a fresh run, truncated (atomically) on resume."""

import json
import os
import pathlib
import time

import pytest

from jaxrl_post.engine.run.run_files import prepare_metrics_file, truncate_after
from jaxrl_post.engine.run.tracking import JsonlLogger


def _write(path, steps, tail=""):
    with open(path, "w") as f:
        for s in steps:
            f.write(json.dumps({"step": s, "critic/score/mean": s / 10}) + "\n")
        f.write(tail)


def _steps(path):
    with open(path) as f:
        return [json.loads(line)["step"] for line in f]


def test_fresh_run_moves_the_old_file_aside(tmp_path):
    path = tmp_path / "metrics.jsonl"
    _write(path, [0, 1, 2])
    stamp = time.mktime((2026, 11, 30, 9, 5, 7, 0, 0, -1))
    os.utime(path, (stamp, stamp))
    msg = prepare_metrics_file(str(tmp_path), None)
    aside = tmp_path / "metrics.20261130-090507.jsonl"
    assert msg == f"{path} of an earlier run (this run starts from scratch) moved to {aside}"
    assert not path.exists() and _steps(aside) == [0, 1, 2]
    # a second old file with the same time stamp does not overwrite the first
    _write(path, [0, 1])
    os.utime(path, (stamp, stamp))
    assert prepare_metrics_file(str(tmp_path), None).endswith("metrics.20261130-090507-1.jsonl")
    assert _steps(aside) == [0, 1, 2] and _steps(tmp_path / "metrics.20261130-090507-1.jsonl") == [0, 1]
    # nothing to move: no file, or an empty one
    assert prepare_metrics_file(str(tmp_path), None) is None
    path.write_text("")
    assert prepare_metrics_file(str(tmp_path), None) is None and path.exists()


def test_resume_drops_lines_after_the_resumed_step(tmp_path):
    path = tmp_path / "metrics.jsonl"
    _write(path, [0, 1, 2, 3, 3, 4, 5], tail='{"step": 6, "critic/sc')  # killed mid-line
    assert prepare_metrics_file(str(tmp_path), 3) is None
    assert _steps(path) == [0, 1, 2, 3, 3]
    assert sorted(os.listdir(tmp_path)) == ["metrics.jsonl"]  # no temp file left behind
    # the resumed run appends after the kept lines
    log = JsonlLogger(str(tmp_path))
    log.log({"critic/score/mean": 0.4}, step=4)
    log.close()
    assert _steps(path) == [0, 1, 2, 3, 3, 4]
    # nothing after the step: the file is left as it is
    before = path.read_bytes()
    assert truncate_after(str(path), 4) == 0 and path.read_bytes() == before


def test_kept_partial_last_line_is_terminated_and_bad_middle_lines_kept(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\nnot json\n{"step": 2}')
    assert truncate_after(str(path), 5) == 0
    assert path.read_text() == '{"step": 1}\nnot json\n{"step": 2}\n'


def test_rewrite_failure_keeps_the_original(tmp_path, monkeypatch):
    path = tmp_path / "metrics.jsonl"
    _write(path, [0, 1, 2])
    before = path.read_bytes()

    def boom(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError, match="disk full"):
        truncate_after(str(path), 1)
    assert path.read_bytes() == before and sorted(os.listdir(tmp_path)) == ["metrics.jsonl"]


def test_jsonl_logger_opens_the_file_at_the_first_line(tmp_path):
    log = JsonlLogger(str(tmp_path))
    assert not (tmp_path / "metrics.jsonl").exists()  # so the trainer can still move/truncate it
    log.log({"a": 1.0}, step=0)
    log.close()
    log.close()  # idempotent
    assert _steps(tmp_path / "metrics.jsonl") == [0]


def test_moved_aside_checkpoints_notice_gives_size_and_rm_command(tmp_path):
    from jaxrl_post.engine.run.run_files import move_aside_old_checkpoints

    root = tmp_path / "checkpoints"
    (root / "global_step_2").mkdir(parents=True)
    (root / "global_step_2" / "params").write_bytes(b"x" * 1500)
    (root / "global_step_4").mkdir()
    (root / "global_step_4" / "params").write_bytes(b"x" * 1000)
    assert move_aside_old_checkpoints(str(root), str(root), [2, 4]) is None  # resumed from: kept
    msg = move_aside_old_checkpoints(str(root), None, [2, 4])
    (aside,) = [p for p in tmp_path.iterdir() if p.name.startswith("checkpoints.")]
    assert msg == (
        f"{root} holds checkpoints of an earlier run (steps [2, 4]) that this run does not resume from; moved to "
        f"{aside} (2.5 kB on disk; if you do not need them: rm -r {aside})"
    )
    assert not root.exists() and (aside / "global_step_4" / "params").read_bytes() == b"x" * 1000


def test_config_diff_warning_and_keep_previous(tmp_path):
    from jaxrl_post.engine.run.run_files import config_diff, keep_previous_config, resume_config_warning

    old = {"a": {"lr": 0.001, "n": 4}, "trainer": {"total_training_steps": 4, "resume_mode": "auto"}}
    new = {"a": {"lr": 0.5, "n": 4, "extra": None}, "trainer": {"total_training_steps": 8, "resume_mode": "auto"}}
    assert config_diff(old, new) == [
        ("a.extra", "<absent>", None),
        ("a.lr", 0.001, 0.5),
        ("trainer.total_training_steps", 4, 8),
    ]
    warn = resume_config_warning(old, new, "ck/global_step_4")
    assert warn.splitlines() == [
        "warning: resuming from ck/global_step_4 with a config that differs from the run's config.json in 2 key(s) "
        "(the steps so far were trained with the old values):",
        '  a.extra: "<absent>" -> null',
        "  a.lr: 0.001 -> 0.5",
    ]  # extending the run (total_training_steps) is not listed
    assert resume_config_warning(old, dict(old, trainer={"total_training_steps": 8}), "x") is None
    many_old, many_new = {f"k{i:02d}": i for i in range(13)}, {f"k{i:02d}": -i for i in range(13)}
    lines = resume_config_warning(many_old, many_new, "x", max_keys=10).splitlines()
    assert len(lines) == 12 and lines[-1] == "  ... and 2 more" and "in 12 key(s)" in lines[0]  # k00: 0 == -0

    assert keep_previous_config(str(tmp_path), old) is None  # no config.json yet
    (tmp_path / "config.json").write_text(json.dumps(old))
    assert keep_previous_config(str(tmp_path), old) is None  # same config: left in place
    aside = keep_previous_config(str(tmp_path), new)
    assert aside.startswith(str(tmp_path / "config.")) and aside.endswith(".json")
    assert json.loads(pathlib.Path(aside).read_text()) == old and not (tmp_path / "config.json").exists()
