"""Multi-host SFT, DPO and reward-model training: tiny runs through `python -m jaxrl_post.main` on 2 processes x
4 fake CPU devices (jax.distributed, coordinator on localhost) equal the same runs on 1 process x 8 devices (every
logged metric and the exported weights), SFT and DPO on the default mesh (fsdp = -1: pure data parallel over the
processes), the reward model on fsdp 4 x tensor 2 (the three share the batch placement, `sft/batches.on_mesh`);
process 0 alone writes metrics.jsonl; a micro-batch whose rows the batch devices do not divide is a one-line error
(exit 2) before any step.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tests.cheap_compile import CHEAP_COMPILE_FLAGS
from tests.e2e.test_multihost import _free_port

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOL = 1e-5  # metrics (gradient sums in another order: 2 processes vs 1)
PARAM_TOL = 5e-5  # params after AdamW steps at lr 1e-3 (see test_multihost.py)
_NOT_COMPARED = ("timing_s/", "perf/")


def _launch(config: str, workdir, n_proc: int, devices: int, *extra: str) -> list[subprocess.Popen]:
    # the cheapest compiles (tiny models: compile time dominates); the 1 x 8 and 2 x 4 runs use the same flags
    flags = f"--xla_force_host_platform_device_count={devices} {CHEAP_COMPILE_FLAGS}"
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=flags)
    cmd = [
        sys.executable,
        "-m",
        "jaxrl_post.main",
        f"--config={config}",
        f"--config.trainer.default_local_dir={workdir}",
    ]
    cmd += ["--config.trainer.logger=(jsonl,)", *extra]
    if n_proc == 1:
        return [subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)]
    port = _free_port()
    dist = [f"--config.trainer.distributed.coordinator_address=localhost:{port}"]
    dist += [f"--config.trainer.distributed.num_processes={n_proc}"]
    return [
        subprocess.Popen(
            cmd + dist + [f"--config.trainer.distributed.process_id={i}"],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(n_proc)
    ]


def _wait(procs: list[subprocess.Popen]) -> list[tuple[int, str]]:
    out = []
    for p in procs:
        try:
            text, _ = p.communicate(timeout=600)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        out.append((p.returncode, text))
    return out


def _metrics(workdir) -> list[dict]:
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def _weights(workdir) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(os.path.join(workdir, "huggingface", "model.safetensors"))


@pytest.mark.slow  # 7 tiny trainer processes and their compiles (~1-2 min on 2 cores)
def test_sft_dpo_and_rm_on_two_processes_equal_one_process(tmp_path):
    rows = [
        {
            "messages": [
                {"role": "user", "content": f"add {i} and {i + 1}"},
                {"role": "assistant", "content": str(2 * i + 1)},
            ]
        }
        for i in range(16)
    ]
    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    sft = ("configs/sft.py:tiny", f"--config.data.train_files={data}", f"--config.data.val_files={data}")
    sft += ("--config.data.train_batch_size=16", "--config.data.micro_batch_size=8")
    dpo = ("configs/dpo.py", "--config.data.micro_batch_size=8")
    rm = ("configs/reward_model.py", "--config.trainer.mesh.fsdp=4", "--config.trainer.mesh.tensor=2")
    runs = {}
    # the 1 x 8 runs one after the other in one launch group, the 2 x 4 runs beside them
    for name, (cfg, *extra) in {"sft": sft, "dpo": dpo, "rm": rm}.items():
        two = _launch(cfg, tmp_path / f"{name}_2x4", 2, 4, *extra)
        one = _wait(_launch(cfg, tmp_path / f"{name}_1x8", 1, 8, *extra))
        runs[name] = (one, _wait(two))
    bad = _wait(_launch("configs/dpo.py", tmp_path / "bad", 1, 8))  # micro-batch of 4 pair rows over 8 devices

    for name, (one, two) in runs.items():
        for rc, text in one + two:
            assert rc == 0, f"{name}: {text[-3000:]}"
        a, b = _metrics(tmp_path / f"{name}_1x8"), _metrics(tmp_path / f"{name}_2x4")
        assert [m["step"] for m in a] == [m["step"] for m in b]  # process 0 alone logs: each step once
        assert len({m["step"] for m in b if "loss" in m}) == len([m for m in b if "loss" in m]) >= 3
        for x, y in zip(a, b):
            keys = [k for k in x if isinstance(x[k], float) and not k.startswith(_NOT_COMPARED)]
            assert keys and set(keys) <= set(y)
            for k in keys:
                assert abs(x[k] - y[k]) <= TOL * max(1.0, abs(x[k])), (name, x["step"], k, x[k], y[k])
        wa, wb = _weights(tmp_path / f"{name}_1x8"), _weights(tmp_path / f"{name}_2x4")
        assert wa.keys() == wb.keys()
        for k in wa:
            np.testing.assert_allclose(wa[k], wb[k], atol=PARAM_TOL, err_msg=f"{name} {k}")
    ((rc, text),) = bad
    assert rc == 2
    assert (
        "error: data.micro_batch_size=4: a micro-batch of 4 rows cannot be split over the 8 devices of the mesh's "
        "batch axes ('data', 'fsdp', 'expert')"
    ) in text
    assert not list((tmp_path / "bad").rglob("global_step_*"))  # nothing trained, nothing saved
