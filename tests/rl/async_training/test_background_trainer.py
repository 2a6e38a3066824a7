"""The background producer in the trainer, on the split placement (2 fake CPU devices: 1 rollout + 1 training; a
subprocess per case, the device count is fixed before jax is imported; tests/cheap_compile.py flags, the session's
persistent compilation cache, tests/conftest.py): the threaded run equals the take-turns run
(`async_training.background_producer=False`) bit for bit, every non-timing metric of 3 steps, the final params and
the producer's saved state (queue, versions, batch in flight); generation ran on the worker while the update ran
(`updates.update_actor` timed by a hook); a reward failure raised on the worker surfaces on the main thread with
its message and a note naming the thread, the step is saved with its job owed and the resumed run pays it and
equals the straight run; a split asynchronous run stopped after step 2 with groups queued and a batch in flight
resumes exactly."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from tests.cheap_compile import CHEAP_COMPILE_FLAGS

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

SCRIPT = textwrap.dedent(
    """
    import glob, hashlib, json, os, sys, threading, time
    import jax
    import numpy as np
    # the session's cache (tests/conftest.py) when the environment names one: the 'error' case's one_step_off
    # trainer then loads the programs the one_step_off case compiled (same shapes and flags: same cache keys)
    cache = os.environ.get("JAX_COMPILATION_CACHE_DIR") or sys.argv[1] + "/jax_cache"
    jax.config.update("jax_compilation_cache_dir", cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    from configs import grpo
    from jaxrl_post.rewards import RewardFunctionError
    from jaxrl_post.rl import step as step_mod
    from jaxrl_post.rl.trainer import RLTrainer

    TIME = ("timing_s/", "timing_per_token_ms/", "perf/time_per_step", "perf/throughput", "perf/mfu/")
    UPDATES = []  # (global step, start, end) of every actor update: the timing hook
    _update = step_mod.updates.update_actor

    def timed_update(cfg, policy, g, state, host, *rest):
        t0 = time.perf_counter()
        out = _update(cfg, policy, g, state, host, *rest)
        jax.block_until_ready(out[0].actor.params)
        UPDATES.append((host.global_steps, t0, time.perf_counter()))
        return out

    step_mod.updates.update_actor = timed_update

    def config(mode, workdir, threaded, steps=3):
        c = grpo.get_config("async" if mode == "fully_async" else "tiny")
        if mode == "one_step_off":
            c.async_training.mode = "one_step_off"
        c.trainer.default_local_dir = workdir
        c.trainer.total_training_steps = steps
        c.trainer.val_before_train = c.trainer.val_at_end = False
        c.trainer.save_freq = 2
        c.rollout.n_gpus_per_node = 1
        c.async_training.background_producer = threaded
        return c

    def fit(c, max_steps=None, fail_at_step=None, slow_reward_s=0.0):
        t = RLTrainer(c, console_write=lambda s: lines.append(s))
        compute = t.reward_fn.compute
        def compute_on_worker(data):  # on the worker only: a slow reward function, or a failing one
            if threading.current_thread() is not threading.main_thread():
                if t.global_steps == fail_at_step:
                    raise RewardFunctionError("injected reward failure")
                time.sleep(slow_reward_s)
            return compute(data)
        t.reward_fn.compute = compute_on_worker
        UPDATES.clear()
        try:
            hist = t.fit(max_steps=max_steps)["history"]
            params = jax.tree.leaves(jax.tree.map(np.asarray, t.state.actor.params))
            digest = hashlib.sha256(b"".join(x.tobytes() for x in params)).hexdigest()
            bg = t.async_rollout.background
            return {
                "hist": [{k: v for k, v in m.items() if not k.startswith(TIME)} for m in hist],
                "wait": [m.get("timing_s/wait_producer") for m in hist],
                "params": digest,
                "producer": t.async_rollout.state_dict(),
                "threaded": bg is not None,
                "events": [] if bg is None else [list(e) for e in bg.events],
                "updates": [list(u) for u in UPDATES],
            }
        except Exception as e:
            return {"error": type(e).__name__, "message": str(e), "notes": getattr(e, "__notes__", [])}
        finally:
            t.close()

    lines = []
    root, case = sys.argv[1], sys.argv[2]
    if case == "error":  # fails in step 2's background job; resumed by a new trainer whose reward works
        out = {"failed": fit(config("one_step_off", root + "/err", True), fail_at_step=1), "lines": list(lines)}
        out["resumed"] = fit(config("one_step_off", root + "/err", True))
        out["logged"] = [json.loads(x) for x in open(glob.glob(root + "/err/**/metrics.jsonl", recursive=True)[0])]
    else:
        mode = case
        out = {
            "turns": fit(config(mode, root + "/turns", False)),
            "thread": fit(config(mode, root + "/thread", True), slow_reward_s=2.0),
        }
        if mode == "fully_async":  # stopped after step 2 (queue and a batch in flight), resumed by a new trainer
            first = fit(config(mode, root + "/resumed", True), max_steps=2)
            out["resumed"] = {"first": first, "rest": fit(config(mode, root + "/resumed", True))}
    print("RESULT" + json.dumps(out))
    """
)


def _run(tmp_path, case: str) -> dict:
    flags = "--xla_force_host_platform_device_count=2 " + CHEAP_COMPILE_FLAGS
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=flags, PYTHONPATH=REPO)
    cmd = [sys.executable, "-c", SCRIPT, str(tmp_path), case]
    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1200)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.split("RESULT", 1)[1])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return {m: _run(tmp_path_factory.mktemp(m), m) for m in ("one_step_off", "fully_async")}


def _intersect(a, b) -> float:
    return min(a[1], b[1]) - max(a[0], b[0])


@pytest.mark.slow  # 2 + 4 tiny trainers in two subprocesses (measured: 2.4 min at load avg 3-10, 5.3 min at 12-14)
@pytest.mark.parametrize("mode", ["one_step_off", "fully_async"])
def test_threaded_run_equals_take_turns_bit_for_bit(runs, mode):
    """fully_async is configs/grpo.py:async: paged engine, partial rollout, two batches ahead, staleness <= 2."""
    turns, thread = runs[mode]["turns"], runs[mode]["thread"]
    assert "error" not in turns and "error" not in thread, (turns.get("message"), thread.get("message"))
    assert not turns["threaded"] and thread["threaded"]
    assert len(thread["hist"]) == len(turns["hist"]) == 3
    for t, (a, b) in enumerate(zip(turns["hist"], thread["hist"], strict=True)):
        assert b == a, (t, {k: (a.get(k), b.get(k)) for k in a.keys() | b.keys() if a.get(k) != b.get(k)})
    assert thread["params"] == turns["params"]
    assert thread["producer"] == turns["producer"]  # queue (rows, versions), batch in flight, pending, counters
    assert all(w is not None and w >= 0 for w in thread["wait"]) and not any(turns["wait"])
    if mode == "fully_async":
        assert thread["producer"]["in_flight"] is not None and thread["producer"]["queue"]


@pytest.mark.slow  # shares the runs above
@pytest.mark.parametrize("mode", ["one_step_off", "fully_async"])
def test_generation_overlaps_the_update(runs, mode):
    """The worker's job of step t (the batches generated ahead, scored by a reward function that takes 2 s on the
    worker, as a sandboxed or remote one would: the tiny model generates a batch in ~0.2 s, less than the old
    log-prob stage before the update) and the actor update of step t ran at the same time at least once:
    intervals of `time.perf_counter()` that intersect."""
    r = runs[mode]["thread"]
    produce = {e[1]: e[2:] for e in r["events"] if e[0] == "produce"}
    updates = {u[0]: u[1:] for u in r["updates"]}
    assert sorted(produce) == sorted(updates) == [0, 1, 2]
    overlaps = {t: _intersect(produce[t], updates[t]) for t in produce}
    assert max(overlaps.values()) > 0, overlaps


@pytest.mark.slow  # two tiny trainers in a subprocess (measured: 45 s at load avg ~10, 86 s at 12-14) + the runs
def test_reward_failure_on_the_worker_saves_the_step_and_the_resumed_run_pays_its_job(tmp_path, runs):
    """The reward fails in step 2's background job (after step 2's update): the error surfaces on the main thread
    with its message and a note naming the thread; step 2 is logged and saved with the job owed (nothing trained is
    lost); a new trainer resumes at step 2, runs the owed job, publishes, and its step 3 equals the straight run's
    bit for bit (metrics, params, the producer's saved state)."""
    r = _run(tmp_path, "error")
    f, straight = r["failed"], runs["one_step_off"]["thread"]
    assert f.get("error") == "RewardFunctionError" and f["message"] == "injected reward failure"
    assert any("background thread" in n and "step 1" in n for n in f["notes"]), f["notes"]
    saved = [line for line in r["lines"] if "generation ahead (background thread) of step 2" in line]
    assert saved and "checkpoint of step 2 saved to" in saved[0], r["lines"]
    logged = {}  # step -> its lines merged (a run's first line holds the data stats at its start step)
    for m in r["logged"]:
        logged.setdefault(m["step"], {}).update(m)
    assert sorted(logged) == [0, 1, 2, 3]  # step 2 logged by the failed run, step 3 by the resumed one
    for t in (1, 2):  # the failed job's queue counts are not in step 2's line; everything else is the straight run's
        want = {k: v for k, v in straight["hist"][t - 1].items() if not k.startswith("async/")}
        got = {k: logged[t][k] for k in want}
        assert got == want, (t, {k: (got[k], want[k]) for k in want if got[k] != want[k]})
    rest = r["resumed"]
    assert "error" not in rest, rest.get("message")
    assert rest["hist"] == straight["hist"][2:]
    assert rest["params"] == straight["params"] and rest["producer"] == straight["producer"]


@pytest.mark.slow  # shares the runs above
def test_split_async_run_resumes_exactly_mid_queue(runs):
    straight, res = runs["fully_async"]["thread"], runs["fully_async"]["resumed"]
    first, rest = res["first"], res["rest"]
    assert "error" not in first and "error" not in rest, (first.get("message"), rest.get("message"))
    assert first["hist"] == straight["hist"][:2]
    assert first["producer"]["queue"] and first["producer"]["in_flight"] is not None  # stopped mid-queue
    assert rest["hist"] == straight["hist"][2:]
    assert rest["params"] == straight["params"] and rest["producer"] == straight["producer"]
