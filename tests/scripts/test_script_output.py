"""scripts/evaluate.py and scripts/export_hf.py: the metrics JSON goes beside the checkpoint (never the
current directory by default) and the last line says where; start-up noise is hidden as in the main job."""

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from configs import grpo
from tests.script_loader import load_script


def _complete_step(root, step):
    d = root / f"global_step_{step}"
    d.mkdir(parents=True)
    (d / "_CHECKPOINT_METADATA").write_text("{}")  # what list_complete_steps counts as committed


def test_metrics_path_is_beside_the_checkpoint(tmp_path):
    ev = load_script("evaluate")
    run = tmp_path / "run"
    _complete_step(run / "checkpoints", 2)
    _complete_step(run / "checkpoints", 3)
    c = grpo.get_config("tiny")
    c.trainer.default_local_dir = str(tmp_path / "base_run")
    want = str(run / "eval_metrics.global_step_3.json")
    assert ev.metrics_path(c, str(run), 3) == want  # a run dir (latest step)
    assert ev.metrics_path(c, str(run / "checkpoints"), 3) == want
    assert ev.metrics_path(c, str(run / "checkpoints" / "global_step_2"), 2) == str(
        run / "eval_metrics.global_step_2.json"
    )
    other = tmp_path / "ckpts"  # a checkpoint root not named checkpoints/: the file goes into it
    _complete_step(other, 5)
    assert ev.metrics_path(c, str(other), 5) == str(other / "eval_metrics.global_step_5.json")
    assert ev.metrics_path(c, None, -1) == str(tmp_path / "base_run" / "eval_metrics.base_model.json")
    assert ev.metrics_path(c, str(run), 3, workdir="w") == os.path.join("w", "eval_metrics.json")
    assert ev.metrics_path(c, str(run), 3, workdir="w", output="o.json") == "o.json"


_FAKE_EVAL = """
import sys
sys.argv = ["evaluate.py", "--config=configs/grpo.py:tiny", "--config.trainer.default_local_dir=" + sys.argv[1]]
from absl import app
from tests.script_loader import load_script
ev = load_script("evaluate")
def fake_evaluate(cfg, checkpoint=None, *, step=None, workdir=None):
    import jax
    jax.devices()  # the backend probe (a TPU-less machine logs "Unable to initialize backend 'tpu'")
    return {"val-core/x/reward/mean@1": 0.5, "eval/checkpoint_step": -1.0}
ev.evaluate = fake_evaluate
ev.FLAGS = ev._define_flags()
app.run(ev.main)
"""


def test_evaluate_hides_start_up_noise_and_says_where_the_metrics_went(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}  # let jax probe its backends
    # tool caches (.benchmarks, .pytest_cache, ...) may appear meanwhile from tests on the other xdist worker
    visible = lambda: sorted(n for n in os.listdir(REPO) if not n.startswith("."))
    cwd_before = visible()
    proc = subprocess.run(
        [sys.executable, "-c", _FAKE_EVAL, str(tmp_path / "run")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Unable to initialize backend" not in proc.stderr and "PyTorch was not found" not in proc.stderr
    out = tmp_path / "run" / "eval_metrics.base_model.json"
    assert proc.stdout.splitlines()[-1] == f"metrics written to {out}"
    assert json.loads(out.read_text())["val-core/x/reward/mean@1"] == 0.5
    assert visible() == cwd_before  # nothing written into the current directory
