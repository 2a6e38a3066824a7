"""Wall time per step of an asynchronous run on the split placement, the background producer on
(`async_training.background_producer=True`: the ahead generation on a thread while the update runs) vs off (the
two take turns), on 2 fake CPU devices (1 rollout + 1 training). Runs alternate (on, off, on, off, ...) so that the
machine's load drifts over both alike; each run is a subprocess (the device count is fixed before jax is imported).

Configs: `tiny` (configs/grpo.py:tiny, one_step_off, dense engine) and `async` (configs/grpo.py:async: paged,
partial rollout, two batches ahead), and `larger` (`tiny` one_step_off with a 2-layer 128-wide model, 8 prompts x 4
samples of up to 32 tokens). Reported per run: the mean of `timing_s/step` over the steps after the first two
(compilation), `timing_s/gen` and `timing_s/update_actor` of those steps, `timing_s/wait_producer` (the trainer
blocked at the join), and the 1-minute load average before the run (`os.getloadavg`).

Usage: python scripts/bench_overlap.py [--configs tiny,async,larger] [--repeats 3] [--steps 6] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KEYS = ("step", "gen", "update_actor", "wait_producer")


def build_config(name: str, workdir: str, steps: int, threaded: bool):
    """The job config of run `name` (see the module docstring)."""
    from configs import grpo

    c = grpo.get_config("async" if name == "async" else "tiny")
    if name != "async":
        c.async_training.mode = "one_step_off"
    if name == "larger":
        a = c.model.arch
        a.hidden_size, a.intermediate_size, a.num_layers, a.head_dim = 128, 256, 2, 32
        c.data.train_batch_size, c.data.max_response_length = 8, 32
        c.actor.ppo_mini_batch_size = 4
    c.trainer.default_local_dir = workdir
    c.trainer.total_training_steps = steps
    c.trainer.val_before_train = c.trainer.val_at_end = False
    c.trainer.save_freq = -1
    c.rollout.n_gpus_per_node = 1
    c.async_training.background_producer = threaded
    return c


def run_one(name: str, steps: int, threaded: bool) -> dict:
    """In this process (2 fake devices): the per-step timings after the first two steps."""
    from jaxrl_post.rl.trainer import RLTrainer

    with tempfile.TemporaryDirectory() as d:
        t = RLTrainer(build_config(name, d, steps, threaded), console_write=lambda s: None)
        try:
            hist = t.fit()["history"][2:]
        finally:
            t.close()
    return {k: sum(m.get(f"timing_s/{k}", 0.0) for m in hist) / len(hist) for k in KEYS}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", default="tiny,async,larger")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--json", default=None)
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: name,threaded in a subprocess
    args = p.parse_args()
    if args.one:
        name, threaded = args.one.split(",")
        print("RESULT" + json.dumps(run_one(name, args.steps, threaded == "1")))
        return
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=2", PYTHONPATH=REPO)
    rows = []
    for name in args.configs.split(","):
        for i in range(args.repeats):
            for threaded in (True, False) if i % 2 == 0 else (False, True):
                load = os.getloadavg()[0]
                cmd = [sys.executable, __file__, "--one", f"{name},{int(threaded)}", "--steps", str(args.steps)]
                out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, check=True)
                r = json.loads(out.stdout.split("RESULT", 1)[1])
                rows.append(dict(config=name, threaded=threaded, load=load, **r))
                print(
                    f"{name:7s} {'thread' if threaded else 'turns ':6s} load {load:5.2f} | step {r['step']:.3f} s"
                    f" | gen {r['gen']:.3f} | update {r['update_actor']:.3f} | wait {r['wait_producer']:.3f}",
                    flush=True,
                )
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
