"""A fully asynchronous run resumes with its queue onto another device count (issue 57 item 4: 8 -> 4 -> 8 fake CPU
devices, a subprocess per device count: the count is fixed before jax is imported).

The run: `configs/grpo.py:tiny` trained `fully_async` (dense rollout, staleness <= 2, two generation batches per
step), a checkpoint every step. Straight on 8 devices for 4 steps; again on 8 devices stopped after step 2 (the
checkpoint holds queued groups); step 3 resumed on 4 devices; step 4 resumed from that on 8 devices. The resumed steps
equal the straight run's: the same queue (group ids and versions: exact) and the same metrics
within float32 tolerance (1e-5 relative: a 4-device mesh reduces in another order), final params within 1e-5."""

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from tests.cheap_compile import CHEAP_COMPILE_FLAGS

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
_TIME = ("timing_s/", "timing_per_token_ms/", "perf/time_per_step", "perf/throughput", "perf/mfu/")

SCRIPT = textwrap.dedent(
    """
    import json, sys
    import jax
    import numpy as np
    from configs import grpo
    from jaxrl_post.rl.trainer import RLTrainer

    def run(workdir, steps, max_steps):
        c = grpo.get_config("tiny")
        c.trainer.default_local_dir = workdir
        c.trainer.total_training_steps = steps
        c.trainer.val_before_train = c.trainer.val_at_end = False
        c.trainer.save_freq = 1
        c.trainer.mesh.tensor = 2 if jax.device_count() == 8 else 1  # tiny's micro-batch of 4 over <= 4 shards
        c.async_training.mode = "fully_async"
        c.async_training.staleness_threshold = 2
        c.async_training.require_batches = 2
        t = RLTrainer(c, console_write=lambda s: None)
        try:
            hist = t.fit(max_steps=max_steps)["history"]
            saved = t.state_dict()["host"]["async"]
            queue = [[it["group_id"], it["version"]] for it in saved["queue"]["items"]]
            params = {"/".join(map(str, p)): np.asarray(x).ravel()[:64].tolist()
                      for p, x in jax.tree_util.tree_leaves_with_path(t.state.actor.params)}
            return {"hist": hist, "queue": queue, "params": params, "devices": jax.device_count()}
        finally:
            t.close()

    jobs = json.loads(sys.argv[1])
    print("RESULT" + json.dumps([run(*j) for j in jobs], default=str))
    """
)


def _run(n_devices: int, jobs: list) -> list:
    flags = f"--xla_force_host_platform_device_count={n_devices} {CHEAP_COMPILE_FLAGS}"
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=flags, PYTHONPATH=REPO)
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, json.dumps(jobs)], cwd=REPO, env=env, capture_output=True, text=True, timeout=900
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.split("RESULT", 1)[1])


def _close(got: dict, want: dict) -> None:
    keys = [k for k in want if not k.startswith(_TIME)]
    assert set(got) == set(want)
    bad = [k for k in keys if not np.isclose(got[k], want[k], rtol=1e-5, atol=1e-7)]
    assert not bad, {k: (got[k], want[k]) for k in bad}
    exact = [k for k in keys if k.startswith(("async/", "response_length/", "prompt_length/"))]
    assert exact and {k: got[k] for k in exact} == {k: want[k] for k in exact}  # queue, staleness, lengths: exact


@pytest.mark.slow  # 3 subprocesses, 4 tiny trainers (~2-3 min on 2 cores)
def test_fully_async_resumes_with_its_queue_on_4_then_8_devices(tmp_path):
    run, straight = str(tmp_path / "run"), str(tmp_path / "straight")
    want, first = _run(8, [[straight, 4, None], [run, 4, 2]])
    assert want["devices"] == 8 and [m["training/global_step"] for m in want["hist"]] == [1, 2, 3, 4]
    assert first["queue"], "the step-2 checkpoint holds no queued groups: nothing to test"
    assert max(m["async/staleness/max"] for m in want["hist"]) >= 1  # really off-policy
    (on4,) = _run(4, [[run, 4, 3]])  # resumes from step 2, runs step 3, saves
    (on8,) = _run(8, [[run, 4, None]])  # resumes from step 3, runs step 4
    assert on4["devices"] == 4 and on8["devices"] == 8
    assert [m["training/global_step"] for m in on4["hist"] + on8["hist"]] == [3, 4]
    for got, w in zip(on4["hist"] + on8["hist"], want["hist"][2:], strict=True):
        _close(got, w)
    assert on8["queue"] == want["queue"]  # the queue at the end: the same groups, the same versions
    for k, w in want["params"].items():
        np.testing.assert_allclose(on8["params"][k], w, rtol=1e-5, atol=1e-6, err_msg=k)
