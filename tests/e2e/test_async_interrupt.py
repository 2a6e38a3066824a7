"""Asynchronous training stopped mid-queue and resumed, as a user runs it (`python -m jaxrl_post.main
--config=configs/grpo.py:async`, 8 steps): Ctrl-C after a step (exit 130, the checkpoint written at the interrupt
holds queued groups and a batch stopped half-way), a rerun resumes from it and is killed with SIGKILL right after
its next checkpoint (a batch in flight again), and a third run resumes from that one to the end. Every step is
logged once, and every step's metrics equal, bit for bit, those of the same config run 8 steps straight (the
fixture of test_resume_old_checkpoint.py: `expected_straight.json`, whose code trains exactly as today's, which
that test checks).
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from test_interrupt import REPO, _assert_clean, _Run
from test_resume_old_checkpoint import ASYNC_FIXTURE

from jaxrl_post.engine.run import checkpoint as ckpt
from tests.recorded import assert_recorded

TOTAL = 8
_TIME = ("timing", "perf/")


def _cmd(workdir, *extra):
    return [
        sys.executable,
        "-m",
        "jaxrl_post.main",
        "--config=configs/grpo.py:async",
        f"--config.trainer.default_local_dir={workdir}",
        f"--config.trainer.total_training_steps={TOTAL}",
        "--config.trainer.val_before_train=False",
        "--config.trainer.val_at_end=False",
        *extra,
    ]


def _host(root, step):
    with open(os.path.join(root, f"global_step_{step}", "host", "metadata")) as f:
        return json.load(f)


@pytest.mark.slow  # three runs of the tiny asynchronous config in subprocesses (~60 s on 2 cores)
@pytest.mark.production_xla_flags  # compared bit for bit with the fixture's metrics, recorded under those flags
def test_sigint_and_sigkill_mid_queue_resume_to_the_straight_run(tmp_path):
    want = json.loads((ASYNC_FIXTURE / "expected_straight.json").read_text())["async_tiny_straight_8_steps"]
    env = dict(os.environ, JAX_PLATFORMS="cpu", HF_HUB_OFFLINE="1")  # conftest's compilation cache, if any
    workdir = tmp_path / "run"
    root = str(workdir / "checkpoints")

    # 1. Ctrl-C after step 1: the step in progress finishes, is checkpointed with the queue, exit 130
    run = _Run(_cmd(workdir), env)
    run.wait_for("step 1 |")
    os.killpg(run.p.pid, signal.SIGINT)
    rc, _ = run.finish()
    assert rc == 130, run.text[-3000:]
    _assert_clean(run.text)
    (line,) = [s for _, s in run.lines if s.startswith("interrupted at step")]
    n = int(line.split()[3].rstrip(";"))
    assert 1 <= n < TOTAL - 1 and ckpt.list_complete_steps(root) == [n]
    host = _host(root, n)
    assert "async.arrays" in host["items"] and host["async"]["queue"]["items"]  # groups queued ...
    assert any(s["tokens"]["shape"][0] for s in host["async"]["in_flight"]["unfinished"])  # ... a batch half done

    # 2. the rerun resumes from step n; SIGKILL as soon as it completed a checkpoint of its own (every step saved)
    again = _cmd(workdir, "--config.trainer.save_freq=1")
    p = subprocess.Popen(again, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and p.poll() is None and ckpt.list_complete_steps(root)[-1] == n:
            time.sleep(0.02)
    finally:
        p.kill()
        out = p.communicate()[0]
    m = ckpt.list_complete_steps(root)[-1]
    assert f"resumed from step {n} of {TOTAL}" in out and n < m < TOTAL, out[-3000:]
    assert _host(root, m)["async"]["in_flight"] is not None  # again a batch in flight

    # 3. the last run resumes from step m (the lines the killed run logged after it are dropped) to the end
    r = subprocess.run(again, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert f"resumed from step {m} of {TOTAL} ({os.path.join(root, f'global_step_{m}')})" in r.stdout
    with open(workdir / "metrics.jsonl") as f:
        rows = [row for row in map(json.loads, f) if "critic/score/mean" in row]
    assert [row["step"] for row in rows] == list(range(1, TOTAL + 1))  # every step once, across the three runs
    for row, w in zip(rows, want, strict=True):
        assert_recorded({k: row.get(k) for k in w}, w, f"step {row['step']}")
