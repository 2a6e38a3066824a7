"""End to end on the tiny GRPO config: exact resume, SIGKILL + resume, resume modes, non-finite updates
stopping the run, failing/slow reward functions, sampled validation (n > 1), scripts/evaluate.py and
scripts/export_hf.py, TensorBoard logging.

Every test builds its trainer with the same tiny shapes, so a persistent XLA compilation cache (the session's,
tests/conftest.py, else a module-wide one; also handed to the subprocesses) makes every trainer after the first
cheap to start.
"""

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from tests.script_loader import load_script, load_test_module

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from configs import grpo
from jaxrl_post.engine.run import checkpoint as ckpt

# metrics that depend on wall-clock time (everything else must repeat bit for bit)
_TIME_KEYS = ("timing_s/", "timing_per_token_ms/", "perf/time_per_step", "perf/throughput", "perf/mfu/")


@pytest.fixture(scope="module")
def jax_cache(tmp_path_factory):
    from jax._src import compilation_cache

    # the session's cache (tests/conftest.py; shared with the other files that build the tiny GRPO trainer),
    # else one for this module; every compile is kept (no minimum compile time or size)
    d = os.environ.get("JAX_COMPILATION_CACHE_DIR") or str(tmp_path_factory.mktemp("jax_cache"))
    names = (
        "jax_compilation_cache_dir",
        "jax_persistent_cache_min_compile_time_secs",
        "jax_persistent_cache_min_entry_size_bytes",
    )
    old = {n: getattr(jax.config, n) for n in names}
    jax.config.update("jax_compilation_cache_dir", d)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    yield d
    for n, v in old.items():
        jax.config.update(n, v)
    compilation_cache.reset_cache()


def _cfg(workdir, **overrides):
    c = grpo.get_config("tiny")
    c.trainer.default_local_dir = str(workdir)
    c.trainer.total_training_steps = 4
    c.trainer.save_freq = 2
    c.trainer.test_freq = 2
    c.trainer.val_before_train = False
    c.trainer.val_at_end = False
    c.trainer.resume_mode = "auto"
    for key, value in overrides.items():
        node = c
        *parents, leaf = key.split(".")
        for p in parents:
            node = node[p]
        node[leaf] = value
    return c


def _strip_time(m):
    return {k: v for k, v in m.items() if not k.startswith(_TIME_KEYS)}


def _host(tree):
    return jax.tree.map(lambda x: np.asarray(jax.device_get(x)), tree)


def _assert_bitwise(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert jax.tree.structure(a) == jax.tree.structure(b) and len(la) == len(lb) > 0
    for x, y in zip(la, lb):
        assert np.asarray(x).tobytes() == np.asarray(y).tobytes()


def _read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def straight_run(jax_cache, tmp_path_factory):
    """4 steps in one go (checkpoints at 2 and 4, validation at 2 and 4, TensorBoard on)."""
    from jaxrl_post.rl.trainer import RLTrainer

    workdir = tmp_path_factory.mktemp("straight")
    t = RLTrainer(
        _cfg(workdir, **{"trainer.logger": ("console", "jsonl", "tensorboard")}), console_write=lambda s: None
    )
    init = _host(t.state.actor.params)
    try:
        hist = t.fit()["history"]
        out = {
            "workdir": str(workdir),
            "history": hist,
            "init": init,
            "params": _host(t.state.actor.params),
            "opt_state": _host(t.state.actor.opt_state),
            "model_config": t.policy.model.config,
        }
    finally:
        t.close()
    return out


@pytest.mark.slow
def test_exact_resume_bitwise(straight_run, tmp_path):
    from jaxrl_post.rl.trainer import RLTrainer

    a = straight_run
    assert len(a["history"]) == 4
    assert ckpt.list_complete_steps(os.path.join(a["workdir"], "checkpoints")) == [2, 4]

    lines = []
    b1 = RLTrainer(_cfg(tmp_path), console_write=lines.append)
    try:
        h1 = b1.fit(max_steps=3)["history"]  # "preempted" after step 3; the last checkpoint is step 2
    finally:
        b1.close()
    assert b1.global_steps == 3

    b2 = RLTrainer(_cfg(tmp_path), console_write=lines.append)
    try:
        assert b2.global_steps == 2
        assert b2.resumed_from == os.path.join(str(tmp_path), "checkpoints", "global_step_2")
        assert any("resumed from" in s for s in lines)
        h2 = b2.fit()["history"]
        params, opt_state = _host(b2.state.actor.params), _host(b2.state.actor.opt_state)
        assert set(b2.compile_counts().values()) == {1}  # restored arrays keep the compiled signature
    finally:
        b2.close()

    assert [_strip_time(m) for m in h1[:2] + h2] == [_strip_time(m) for m in a["history"]]
    assert _strip_time(h1[2]) == _strip_time(h2[0])  # step 3 redone identically
    assert any(k.startswith("val-core/") for k in h2[-1])  # validation (test_freq=2) is part of it
    _assert_bitwise(params, a["params"])
    _assert_bitwise(opt_state, a["opt_state"])
    assert ckpt.list_complete_steps(os.path.join(tmp_path, "checkpoints")) == [2, 4]
    # the first run's step-3 line was dropped on resume (it is logged again): every step appears once
    steps_logged = [r["step"] for r in _read_jsonl(os.path.join(tmp_path, "metrics.jsonl")) if "critic/score/mean" in r]
    assert steps_logged == [1, 2, 3, 4]

    # already finished: auto-resume from step 4 and return at once
    b3 = RLTrainer(_cfg(tmp_path), console_write=lines.append)
    try:
        assert b3.global_steps == 4 and b3.fit()["history"] == []
    finally:
        b3.close()
    assert lines[-2:] == [
        f"resumed from step 4 ({os.path.join(str(tmp_path), 'checkpoints', 'global_step_4')})",
        "training already finished at step 4 (total_training_steps=4); to train further, raise "
        "--config.trainer.total_training_steps; to start over, pass --config.trainer.resume_mode=disable "
        "(the old run is moved aside)",
    ]


@pytest.mark.slow  # the `straight_run` fixture: a tiny run end to end (190 s on 2 shared, loaded cores)
def test_resume_modes(straight_run, tmp_path):
    from jaxrl_post.errors import ConfigError
    from jaxrl_post.rl.trainer import RLTrainer

    src = os.path.join(straight_run["workdir"], "checkpoints", "global_step_2")
    t = RLTrainer(
        _cfg(tmp_path, **{"trainer.resume_mode": "resume_path", "trainer.resume_from_path": src}),
        console_write=lambda s: None,
    )
    try:
        assert t.global_steps == 2 and t.resumed_from == src
        assert t.data.train_loader.get_state() == ckpt.Checkpointer(os.path.dirname(src)).read_host(2)["data_iter"]
    finally:
        t.close()
    # a fresh run in a used working dir (a copy of the straight run's): the earlier run's checkpoints and
    # metrics.jsonl are moved aside, never mixed with this run's
    fresh = tmp_path / "fresh"
    shutil.copytree(straight_run["workdir"], fresh)
    old_lines = (fresh / "metrics.jsonl").read_text()
    lines = []
    t = RLTrainer(_cfg(fresh, **{"trainer.resume_mode": "disable"}), console_write=lines.append)
    try:
        assert t.global_steps == 0 and t.resumed_from is None
        _assert_bitwise(_host(t.state.actor.params), straight_run["init"])
        t.fit(max_steps=2)
    finally:
        t.close()
    (ck_aside,) = [n for n in os.listdir(fresh) if n.startswith("checkpoints.")]
    (m_aside,) = [n for n in os.listdir(fresh) if n.startswith("metrics.") and n != "metrics.jsonl"]
    assert lines[0].startswith(
        f"{fresh / 'checkpoints'} holds checkpoints of an earlier run (steps [2, 4]) that this run does not "
        f"resume from; moved to {fresh / ck_aside} ("
    )
    assert lines[0].endswith(f" on disk; if you do not need them: rm -r {fresh / ck_aside})")
    assert lines[1] == (
        f"{fresh / 'metrics.jsonl'} of an earlier run (this run starts from scratch) moved to {fresh / m_aside}"
    )
    assert (fresh / m_aside).read_text() == old_lines
    assert ckpt.list_complete_steps(fresh / ck_aside) == [2, 4]
    assert ckpt.list_complete_steps(fresh / "checkpoints") == [2]  # this run's step 2, not the old one
    assert [r["step"] for r in _read_jsonl(fresh / "metrics.jsonl")] == [0, 1, 2]  # this run only
    with pytest.raises(ConfigError, match="trainer.resume_from_path"):
        RLTrainer(_cfg(tmp_path, **{"trainer.resume_mode": "resume_path"}))


@pytest.mark.slow
def test_sigkill_then_resume_matches_straight_run(straight_run, jax_cache, tmp_path):
    workdir = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "jaxrl_post.main",
        "--config=configs/grpo.py:tiny",
        f"--config.trainer.default_local_dir={workdir}",
        "--config.trainer.total_training_steps=8",
        "--config.trainer.save_freq=1",
        "--config.trainer.max_actor_ckpt_to_keep=10",  # step 4 is compared below
        "--config.trainer.val_before_train=False",
        "--config.trainer.val_at_end=False",
        "--config.trainer.resume_mode=auto",
    ]
    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        JAX_COMPILATION_CACHE_DIR=jax_cache,
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
        JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
    )
    root = os.path.join(workdir, "checkpoints")
    with open(tmp_path / "first.log", "w") as log:
        p = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.time() + 240
            while not ckpt.list_complete_steps(root) and time.time() < deadline and p.poll() is None:
                time.sleep(0.05)
            assert ckpt.list_complete_steps(root), (p.poll(), (tmp_path / "first.log").read_text()[-3000:])
        finally:
            os.kill(p.pid, signal.SIGKILL)
            p.wait()
    done_before = ckpt.list_complete_steps(root)
    assert 8 not in done_before  # killed mid-run
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    n = done_before[-1]
    assert f"resumed from step {n} of 8 ({os.path.join(root, f'global_step_{n}')})" in r.stdout
    # the killed run's run.lock (its pid is dead) is taken over with one line, and released at the end
    lock = os.path.join(workdir, "run.lock")
    assert f"{lock}: taking over the stale lock of a run that is no longer alive (pid {p.pid} on " in r.stdout
    assert not os.path.exists(lock)
    assert ckpt.list_complete_steps(root)[-1] == 8
    # metrics.jsonl: the lines the killed run logged after step n were dropped, so every step appears once
    steps_logged = [r["step"] for r in _read_jsonl(os.path.join(workdir, "metrics.jsonl")) if "critic/score/mean" in r]
    assert steps_logged == list(range(1, 9))
    # the first 4 steps of this killed-and-resumed 8-step run equal the straight 4-step run (constant lr)
    c = ckpt.Checkpointer(root)
    got = c.restore(4, like={"actor": {"params": straight_run["params"]}})
    _assert_bitwise(_host(got["actor"]["params"]), straight_run["params"])
    assert got["host"]["global_steps"] == 4 and got["host"]["reference"]["source"] == "initial_actor"


def test_nonfinite_updates_stop_the_run_and_keep_the_checkpoint(jax_cache, tmp_path):
    from jaxrl_post.engine.nonfinite import NonFiniteError
    from jaxrl_post.rl.trainer import RLTrainer

    # an entropy bonus at float32's edge (3e38 x an entropy of ~2 overflows) makes every actor loss non-finite (a NaN
    # reward no longer can: it is a reward error; an infinite coefficient is a config error)
    c = _cfg(
        tmp_path / "run",
        **{"actor.entropy_coeff": 3e38, "trainer.save_freq": 1, "trainer.max_consecutive_nonfinite": 3},
    )
    t = RLTrainer(c, console_write=lambda s: None)
    init = _host(t.state.actor.params)
    init_opt = _host(t.state.actor.opt_state)
    try:
        with pytest.raises(NonFiniteError, match=r"3 consecutive actor .*training step 2.*max_consecutive_nonfinite=3"):
            t.fit()
        _assert_bitwise(_host(t.state.actor.params), init)  # every update was skipped
        _assert_bitwise(_host(t.state.actor.opt_state), init_opt)
    finally:
        t.close()
    root = os.path.join(tmp_path, "run", "checkpoints")
    assert ckpt.list_complete_steps(root) == [1]  # step 1 saved, the failing step 2 not
    got = ckpt.Checkpointer(root).restore(1, like={"actor": {"params": init}})
    _assert_bitwise(_host(got["actor"]["params"]), init)
    assert got["host"]["nonfinite"]["actor"] == {"consecutive": 2, "total": 2}
    (line,) = [r for r in _read_jsonl(os.path.join(tmp_path, "run", "metrics.jsonl")) if "actor/pg_loss" in r]
    assert line["step"] == 1 and line["actor/update_skipped"] == 1.0 and line["actor/num_nonfinite_skipped"] == 2.0


@pytest.mark.slow  # a tiny trainer built and run (37 s on 2 shared, loaded cores)
def test_reward_errors_and_timeouts_are_counted_and_the_step_completes(jax_cache, tmp_path):
    from jaxrl_post.rl.trainer import RLTrainer

    reward = tmp_path / "flaky_reward.py"
    reward.write_text(
        "import time\n"
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "  if len(solution_str) % 3 == 0:\n"
        '    raise RuntimeError("bad row")\n'
        "  if len(solution_str) % 3 == 1:\n"
        "    time.sleep(30)\n"
        "  return 1.0\n"
    )
    c = _cfg(
        tmp_path / "run",
        **{
            "custom_reward_function.path": str(reward),
            "reward_model.num_workers": 2,
            "reward_model.timeout_s": 0.5,
            "reward_model.max_error_fraction": 1.0,  # about 2/3 of the calls fail here: counted, not fatal
            "trainer.total_training_steps": 1,
        },
    )
    t = RLTrainer(c, console_write=lambda s: None)
    try:
        t0 = time.time()
        (m,) = t.fit()["history"]
        assert time.time() - t0 < 60
    finally:
        t.close()
    n = c.data.train_batch_size * c.rollout.n
    assert 1 <= m["reward/num_timeouts"] < m["reward/num_errors"] < n  # some raised, some timed out, some ok
    assert m["critic/score/max"] == 1.0 and m["critic/score/min"] == 0.0  # failures score 0
    assert t.global_steps == 1 and "actor/pg_loss" in m


@pytest.mark.slow
def test_evaluate_checkpoint_and_sampled_validation(straight_run, tmp_path):
    evaluate = load_script("evaluate").evaluate
    a = straight_run
    # greedy n=1 on the step-4 checkpoint == the run's own validation at step 4
    m = evaluate(_cfg(tmp_path / "x"), a["workdir"], workdir=str(tmp_path / "e1"))
    val4 = {k: v for k, v in a["history"][3].items() if k.startswith("val-")}
    assert val4 and {k: m[k] for k in val4} == val4
    assert m["eval/checkpoint_step"] == 4.0
    assert not os.path.exists(tmp_path / "x")  # the run config's workdir is not touched
    # base model (no checkpoint) differs from the trained one
    base = evaluate(_cfg(tmp_path / "x"), None, workdir=str(tmp_path / "e0"))
    assert base["eval/checkpoint_step"] == -1.0
    # sampled n=4 on the step-2 checkpoint: best/worst/pass@k from the same responses
    m4 = evaluate(
        _cfg(
            tmp_path / "x",
            **{"rollout.val_kwargs.n": 4, "rollout.val_kwargs.do_sample": True, "rollout.val_kwargs.temperature": 1.0},
        ),
        os.path.join(a["workdir"], "checkpoints", "global_step_2"),
        workdir=str(tmp_path / "e4"),
    )
    ds = "reasoning_gym/basic_arithmetic"
    mean, best, worst = (
        m4[f"val-core/{ds}/reward/mean@4"],
        m4[f"val-core/{ds}/reward/best@4/mean"],
        m4[f"val-aux/{ds}/reward/worst@4/mean"],
    )
    assert worst <= mean <= best and worst < best
    for k in (f"val-core/{ds}/reward/pass@4", f"val-aux/{ds}/reward/best@2/mean", f"val-aux/{ds}/reward/std@4"):
        assert k in m4
    assert m4["eval/checkpoint_step"] == 2.0 and m4[f"val-aux/{ds}/num_samples"] == 4 * 16
    with open(tmp_path / "e4" / "metrics.jsonl") as f:
        assert f"val-core/{ds}/reward/mean@4" in json.loads(f.readline())


@pytest.mark.slow  # the `straight_run` fixture and a transformers load
def test_export_hf_loads_in_transformers(straight_run, tmp_path):
    import torch
    import transformers

    from jaxrl_post.models import init_model

    export_hf = load_script("export_hf")
    said = []
    out = export_hf.export(straight_run["workdir"], str(tmp_path / "hf"), say=said.append)
    names = sorted(os.listdir(out))
    assert said[0].startswith(f"exported step 4 of {straight_run['workdir']} (") and "parameters) to " in said[0]
    assert [line.split(" (")[0].strip() for line in said[1:]] == names and "model.safetensors" in names
    modes = {n: stat.S_IMODE(os.stat(os.path.join(out, n)).st_mode) for n in names}
    assert modes["model.safetensors"] == modes["config.json"], modes  # safetensors alone wrote 0600
    with pytest.raises(export_hf.ExportError, match="is not empty .* pass --overwrite"):
        export_hf.export(straight_run["workdir"], out)
    assert export_hf.main(["--checkpoint", straight_run["workdir"], "--out", out]) == 2
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(out)
    ids = tok("<|im_start|>user\n12+30=<|im_end|>\n", return_tensors="pt")["input_ids"]
    assert ids.shape[1] > 5 and int(ids.max()) < 101  # char tokenizer
    from flax import nnx

    model = init_model(straight_run["model_config"], seed=0)
    nnx.update(model, jax.tree.map(jax.numpy.asarray, straight_run["params"]))
    want = np.asarray(
        model(jax.numpy.asarray(ids.numpy(), jax.numpy.int32), jax.numpy.ones(ids.shape, jax.numpy.int32))
    )
    with torch.no_grad():
        got = hf(ids).logits.numpy()
    np.testing.assert_allclose(got, want, atol=2e-4, rtol=1e-4)


@pytest.mark.slow  # the `straight_run` fixture
def test_tensorboard_and_config_files_of_the_run(straight_run):
    w = straight_run["workdir"]
    assert os.path.exists(os.path.join(w, "config.json")) and os.path.exists(os.path.join(w, "config.yaml"))
    _read_events = load_test_module("engine/test_loggers")._read_events

    events = _read_events(os.path.join(w, "tensorboard"))
    assert sorted(s for s, tag, _ in events if tag == "critic/score/mean") == [1, 2, 3, 4]


# slow: two trainers plus the validation's own generate compile (~1-3 min on a shared 2-core CPU when cold)
@pytest.mark.slow
def test_resumed_run_keeps_the_original_val_before(jax_cache, tmp_path):
    """A resumed run does not validate before training again (its params are not the base model's): it
    reports the original run's step-0 validation, from the checkpoint's host JSON, or from metrics.jsonl for
    checkpoints that lack it."""
    from jaxrl_post.engine.run.run_files import first_validation
    from jaxrl_post.rl.trainer import RLTrainer, summarize

    over = {"trainer.val_before_train": True, "trainer.save_freq": 1, "trainer.test_freq": -1}
    over["trainer.total_training_steps"] = 2
    a = RLTrainer(_cfg(tmp_path, **over), console_write=lambda s: None)
    try:
        v0 = a.fit(max_steps=1)["val_before"]
    finally:
        a.close()
    v0 = {k: v for k, v in v0.items() if k.startswith("val-")}
    assert v0 and first_validation(str(tmp_path)) == v0  # what metrics.jsonl holds at step 0
    lines = []
    b = RLTrainer(_cfg(tmp_path, **over), console_write=lines.append)
    assert b.global_steps == 1 and b.val_before_metrics == v0  # from host['val_before']

    def no_validate():
        raise AssertionError("a resumed run validated before training")

    b.validate = no_validate
    try:
        res = b.fit()
    finally:
        b.close()
    assert res["val_before"] == v0 and json.loads(summarize(res))["val_before"] == v0
    assert "resumed at step 1: not validating before training again; val_before is the original run's " in "".join(
        lines
    )
    assert [r["step"] for r in _read_jsonl(tmp_path / "metrics.jsonl") if any(k.startswith("val-") for k in r)] == [0]
    # an older checkpoint without host['val_before']: the step-0 line of metrics.jsonl is used
    (tmp_path / "metrics.jsonl").write_text(
        '{"step": 0, "data/num_train_prompts": 64}\n'
        '{"step": 0, "val-core/x/reward/mean@1": 0.25, "timing_s/testing": 1.0}\n'
        '{"step": 1, "val-core/x/reward/mean@1": 0.75}\n'
    )
    assert first_validation(str(tmp_path)) == {"val-core/x/reward/mean@1": 0.25}
