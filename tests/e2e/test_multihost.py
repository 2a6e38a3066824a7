"""Multi-host: tiny GRPO and tiny PPO on 2 processes x 4 fake CPU devices (jax.distributed, coordinator on
localhost) equal the same runs on 1 process x 8 devices and 1 process x 1 device (metrics, validation
included, and final params); save on 2 processes, resume on 1 process with another mesh shape.

Launches (all subprocesses: fake device counts must be set before jax starts), started together so that a
process waiting on its collectives leaves the cores to the others:
- GRPO through the CLI, `python -m jaxrl_post.main` x 2 with the `trainer.distributed.*` keys on the default mesh
  (fsdp = -1: pure data parallel over the processes, as docs/multihost.md runs it; checkpoint every step);
- PPO through a script, 2 processes, mesh fsdp 4 x tensor 2; the same 2 processes then run the process-local rows
  jobs (`trainer.distributed.process_local_rows`, padded layout): GRPO (and the same GRPO gathered, for the bytes),
  REINFORCE++ and PPO with one mini-batch (their 1-process references run in the 1-device process);
- one 8-device process: GRPO 1x8 on mesh (1, 8, 1) (the default mesh; FSDP shard checks), PPO 1x8 on (1, 4, 2), the
  resume of the CLI run's step-1 checkpoint (saved on 2 processes with mesh (1, 8, 1)) on (1, 4, 2);
- one 1-device process: GRPO 1x1, PPO 1x1, and the process-local jobs' references (padded GRPO, REINFORCE++, PPO).
The single-process launches use a persistent compilation cache of their own (a later trainer's programs equal to
an earlier one's are loaded, not recompiled; the numbers do not depend on it). The 2-process launches inherit the
session's (tests/conftest.py), which jax writes from process 0 only: a program both processes compile at the same
moment is compiled by both (a half-written entry read by process 1 is a warning and a compile, jax 0.10.2);
`jax_share_binary_between_hosts` was tried: process 1 waited forever for a binary (CPU).

Validation (after the last step) runs on a held-out set of 17 prompts in batches of 16 (the second batch is
1 prompt + 15 padding rows: process 0 holds that prompt, process 1 only padding). The toy reward function
logs every call per process, so the tests see which process scored which row.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from jaxrl_post.algos.rollout_corr import compute_rollout_probs_diff_metrics
from tests.cheap_compile import CHEAP_COMPILE_FLAGS
from tests.e2e.mismatch_probe import probe_rows

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOL = 1e-5  # metrics
# Parameters after two AdamW steps at the tiny configs' lr 1e-3: Adam scales each entry's step to about lr,
# so an entry whose gradient is within roundoff of zero moves by a visibly different fraction of lr when
# the gradient is summed in another order (2 processes vs 1, 8 devices vs 1). Seen: < 1e-5 on AVX-512
# machines, 1.5e-5 on an AVX2-only AMD EPYC. A dropped or doubled gradient reduction moves params by ~lr.
PARAM_TOL = 5e-5
# metrics that measure time or throughput differ between runs by nature
_NOT_COMPARED = ("timing_s/", "timing_per_token_ms/", "perf/")
VAL_SIZE, VAL_BATCH = 17, 16  # 17 held-out prompts: batches of 16 and 1 (+ 15 padding rows)
TRAIN_SEED = 7  # data.reasoning_gym.seed: rows with another seed in their extra_info are held-out rows
_VAL = {
    "trainer.val_before_train": False,
    # sampled (the toy reward of greedy answers is 0), with the training rollout's program (same shapes)
    "rollout.val_kwargs.do_sample": True,
    "rollout.val_kwargs.temperature": 1.0,
    "trainer.val_at_end": True,
    "data.reasoning_gym.val_size": VAL_SIZE,
    "data.val_batch_size": VAL_BATCH,
    "data.reasoning_gym.seed": TRAIN_SEED,
    "trainer.total_training_steps": 2,
}
# tiny GRPO, on-policy without KL (fewer programs to compile: the suite runs on 2 cores)
_GRPO = dict(_VAL, **{"actor.use_kl_loss": False, "actor.ppo_mini_batch_size": 4, "actor.ppo_micro_batch_size": 8})
# tiny PPO: critic, GAE, KL in reward, old/ref log-probs, 2 shuffled actor and critic mini-batches
_PPO = dict(_VAL)
# process-local rows (rl/local_rows.py): the padded layout, no validation (its gather is unchanged); GRPO with 2
# epochs of one mini-batch and the KL loss (the old and reference log-prob forwards on process-local rows) and
# REINFORCE++ (whitened over the whole batch: a batch statistic across processes)
_PADDED = dict(_GRPO, **{"model.use_remove_padding": False, "trainer.val_at_end": False})
_FWD = {"actor.ppo_epochs": 2, "actor.use_kl_loss": True}
_PADDED_FWD = dict(_PADDED, **_FWD)
_LOCAL = dict(_PADDED, **{"trainer.distributed.process_local_rows": True})
_RPP = {"algorithm.adv_estimator": "reinforce_plus_plus"}
# an MoE actor (configs/grpo.py:moe_tiny) replaying the rollout's routes (R3): `routed_experts` stay process-local
_R3 = {"actor.router_replay.mode": "R3"}
# PPO with one actor and one critic mini-batch: critic values and update, GAE whitened over the batch, KL in reward
_PPO_LOCAL = dict(_PPO, **{"model.use_remove_padding": False, "trainer.val_at_end": False})
_PPO_LOCAL.update({"actor.ppo_mini_batch_size": 4, "critic.ppo_mini_batch_size": 4})
# Whitening divides every advantage by a batch std summed in another order (across processes, vs one process);
# Adam turns that roundoff on near-zero gradients into param differences up to ~5e-5 (seen 5.1e-5), still 20x
# below the ~lr (1e-3) of a wrong statistic. The metrics keep TOL.
WHITENED_PARAM_TOL = 1e-4

# the tiny configs' toy reward, logging `seed index score` of every call to <$MH_REWARD_LOG>.<process index>
_REWARD = r"""
import os
from configs.tiny_reward import compute_score as _score

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    import jax
    s = _score(data_source, solution_str, ground_truth, extra_info)
    with open(f"{os.environ['MH_REWARD_LOG']}.{jax.process_index()}", "a") as f:
        f.write(f"{extra_info['config']['seed']} {extra_info['index']} {s!r}\n")
    return s
"""

_SCRIPT = r"""
import json, os, re, sys, time
sys.path.insert(0, os.getcwd())
args = json.loads(sys.argv[1])
from jaxrl_post.runtime import distributed
distributed.initialize(**args.get("dist", {}))  # before any other JAX call
import jax, numpy as np
from configs import grpo, ppo
from jaxrl_post.runtime import sharding
from jaxrl_post.runtime.distributed import to_host
from jaxrl_post.engine.run import checkpoint as ckpt
from jaxrl_post.rl.trainer import RLTrainer
from tests.e2e.mismatch_probe import probe_rows

seen = []  # whether the model's activation constraints saw an ambient mesh (trace time)
_constrain = sharding.constrain
def spy(x, names):
    m = jax.sharding.get_abstract_mesh()
    seen.append(not (m is None or m.empty))
    return _constrain(x, names)
sharding.constrain = spy
flat = lambda tree: {jax.tree_util.keystr(p): to_host(x) for p, x in jax.tree_util.tree_leaves_with_path(tree)}

def run(job):
    seen.clear()
    os.environ["MH_REWARD_LOG"] = job["workdir"] + ".reward"
    c = {"grpo": grpo, "ppo": ppo}[job["algo"]].get_config(job.get("variant", "tiny"))
    for k, v in job["overrides"].items():
        node = c
        *head, last = k.split(".")
        for h in head:
            node = node[h]
        node[last] = v
    c.trainer.default_local_dir = job["workdir"]
    c.trainer.mesh.data, c.trainer.mesh.fsdp, c.trainer.mesh.tensor = job["mesh"]
    if job.get("resume"):
        while not os.path.exists(job["wait_for"]):  # the checkpoint's run has finished
            time.sleep(0.2)
        c.trainer.resume_mode, c.trainer.resume_from_path = "resume_path", job["resume"]
    t = RLTrainer(c)
    out = {"devices": jax.device_count(), "processes": jax.process_count()}
    if job.get("resume"):  # restored params vs the checkpoint's arrays read back without any mesh
        raw = ckpt.Checkpointer(os.path.dirname(job["resume"]), read_only=True).restore_raw("actor.params", 1)
        raw = {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(raw)}
        norm = lambda k: re.sub(r"\['?value'?\]|\.value|'", "", k)
        got = {norm(k): v for k, v in flat(t.state.actor.params).items()}
        raw = {norm(k): v for k, v in raw.items()}
        out["restored_keys_match"] = sorted(raw) == sorted(got)
        out["restored_bitwise"] = all(np.array_equal(raw[k], got[k]) for k in raw) and len(raw) > 0
        out["global_steps_after_restore"] = t.global_steps
    if job.get("shard_stats"):  # bytes of params + optimizer state held by one device vs the whole
        leaves = jax.tree_util.tree_leaves_with_path((t.state.actor.params, t.state.actor.opt_state))
        arrays = {jax.tree_util.keystr(p): x for p, x in leaves if hasattr(x, "addressable_shards") and x.ndim >= 1}
        dev = jax.devices()[0]
        local = lambda x: sum(s.data.nbytes for s in x.addressable_shards if s.device == dev)
        out["bytes_total"] = sum(x.nbytes for x in arrays.values())
        out["bytes_device0"] = sum(local(x) for x in arrays.values())
        out["fractions"] = {k: x.nbytes / local(x) for k, x in arrays.items()}
    res = t.fit()
    out["history"] = res["history"]
    if job.get("mismatch_probe"):  # the MoE mismatch metrics on process-local rows, against the test's reference
        from jaxrl_post.rl import updates
        b, mask = probe_rows(jax.process_index())
        out["mismatch_probe"] = updates.moe_mismatch_metrics(t.policy, t.geometry, b, mask, local=True)
    out["constrain_calls"], out["constrain_with_mesh"] = len(seen), sum(seen)
    params = flat(t.state.actor.params)
    t.close()
    if jax.process_index() == 0:
        np.savez(job["out"] + ".npz", **params)
        json.dump(out, open(job["out"] + ".json", "w"))

for job in args["jobs"]:
    run(job)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _env(n_devices: int, cache: str | None = None) -> dict:
    # the cheapest compiles (the suite runs on 2 cores); every run uses the same flags
    flags = f"--xla_force_host_platform_device_count={n_devices} {CHEAP_COMPILE_FLAGS}"
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=flags, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    if cache:  # one process running several trainers: programs equal to an earlier trainer's are not recompiled
        env.update(
            JAX_COMPILATION_CACHE_DIR=cache,
            JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
            JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
        )
    return env


def _job(tmp, name, algo, mesh, overrides, **extra) -> dict:
    over = dict(overrides, **{"custom_reward_function.path": str(tmp / "reward.py")})
    return dict(name=name, algo=algo, overrides=over, workdir=str(tmp / name), mesh=mesh, out=str(tmp / name), **extra)


def _start_script(tmp, n_devices, jobs, dist=None):
    args = dict(jobs=jobs, **({"dist": dist} if dist else {}))
    cmd = [sys.executable, str(tmp / "run.py"), json.dumps(args)]
    pipe = dict(stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    cache = None if dist else str(tmp / f"jax_cache_{jobs[0]['name']}")
    return subprocess.Popen(cmd, cwd=REPO, env=_env(n_devices, cache), **pipe)


def _wait(procs, timeout: float = 900.0) -> list[str]:
    """Wait for all (draining their pipes); a process that fails, or the timeout, kills the others, which
    would otherwise wait for their peer in a collective forever."""
    deadline, outs = time.monotonic() + timeout, [None] * len(procs)
    while any(o is None for o in outs):
        for i, p in enumerate(procs):
            if outs[i] is None:
                try:  # a timed-out communicate keeps what it read; calling it again loses nothing
                    outs[i] = p.communicate(timeout=0.5)
                except subprocess.TimeoutExpired:
                    pass
        failed = any(o is not None and p.returncode != 0 for p, o in zip(procs, outs))
        if failed or time.monotonic() > deadline:
            for p in procs:
                p.kill()
            outs = [o if o is not None else p.communicate() for p, o in zip(procs, outs)]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, f"exit {p.returncode} (negative: killed, a peer failed or timeout)\n{err[-4000:]}"
    return [o for o, _ in outs]


def _reward_log(tmp, name) -> dict[int, list[tuple[int, int, float]]]:
    """{process index: [(seed, index, score) of every reward call, in call order]}"""
    out = {}
    for i in range(2):
        path = tmp / f"{name}.reward.{i}"
        if path.exists():
            rows = [line.split() for line in path.read_text().splitlines()]
            out[i] = [(int(s), int(j), float(v)) for s, j, v in rows]
    return out


def _load(tmp, name) -> dict:
    out = json.loads((tmp / f"{name}.json").read_text())
    out["params"] = dict(np.load(tmp / f"{name}.npz"))
    out["rewards"] = _reward_log(tmp, name)
    return out


def _cli_command(tmp, port):
    """`python -m jaxrl_post.main` for 2 processes x 4 devices, tiny GRPO, the default mesh (data*fsdp = 8: each
    process holds 2 prompts and 2 filler rows of the 8-prompt batch bucket), checkpoint every step."""
    base = [sys.executable, "-m", "jaxrl_post.main", "--config=configs/grpo.py:tiny"]
    base += [f"--config.{k}={v}" for k, v in _GRPO.items()]
    base += [
        f"--config.custom_reward_function.path={tmp / 'reward.py'}",
        f"--config.trainer.default_local_dir={tmp / 'cli2'}",
        "--config.trainer.save_freq=1",
        f"--config.trainer.distributed.coordinator_address=localhost:{port}",
        "--config.trainer.distributed.num_processes=2",
    ]
    return [base + [f"--config.trainer.distributed.process_id={i}"] for i in range(2)]


def _load_cli(tmp, stdout) -> dict:
    import jax

    from jaxrl_post.engine.run import checkpoint as ckpt

    workdir = tmp / "cli2"
    lines = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    history = [line for line in lines if "critic/score/mean" in line]
    raw = ckpt.Checkpointer(ckpt.checkpoint_dir(workdir), read_only=True).restore_raw("actor.params", 2)
    params = {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(raw)}
    return {"history": history, "params": params, "stdout": stdout, "rewards": _reward_log(tmp, "cli2")}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("multihost")
    (tmp / "run.py").write_text(_SCRIPT)
    (tmp / "reward.py").write_text(_REWARD)
    port, ppo_port = _free_port(), _free_port()
    env = dict(_env(4), MH_REWARD_LOG=str(tmp / "cli2.reward"))
    pipe = dict(cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    cli = [subprocess.Popen(cmd, **pipe) for cmd in _cli_command(tmp, port)]
    dist = lambda i: dict(coordinator_address=f"localhost:{ppo_port}", num_processes=2, process_id=i)
    jobs2 = [
        _job(tmp, "ppo2", "ppo", [1, 4, 2], _PPO),
        _job(tmp, "local2", "grpo", [1, 8, 1], dict(_LOCAL, **_FWD)),
        _job(tmp, "gathered2", "grpo", [1, 8, 1], _PADDED_FWD),
        _job(tmp, "rpp_local2", "grpo", [1, 8, 1], dict(_LOCAL, **_RPP)),
        _job(tmp, "ppo_local2", "ppo", [1, 4, 2], dict(_PPO_LOCAL, **{"trainer.distributed.process_local_rows": True})),
        _job(
            tmp, "moe_local2", "grpo", [1, 8, 1], dict(_LOCAL, **_FWD, **_R3), variant="moe_tiny", mismatch_probe=True
        ),
    ]
    ppo2 = [_start_script(tmp, 4, jobs2, dist(i)) for i in range(2)]
    resume = dict(resume=str(tmp / "cli2" / "checkpoints" / "global_step_1"), wait_for=str(tmp / "cli2.done"))
    one8 = _start_script(
        tmp,
        8,
        [
            _job(tmp, "grpo8", "grpo", [1, 8, 1], _GRPO, shard_stats=True),
            _job(tmp, "ppo8", "ppo", [1, 4, 2], _PPO),
            _job(tmp, "resumed", "grpo", [1, 4, 2], _GRPO, **resume),
        ],
    )
    one1 = [_job(tmp, "grpo1", "grpo", [1, 1, 1], _GRPO), _job(tmp, "ppo1", "ppo", [1, 1, 1], _PPO)]
    one1 += [
        _job(tmp, "padded1", "grpo", [1, 1, 1], _PADDED_FWD),
        _job(tmp, "rpp1", "grpo", [1, 1, 1], dict(_PADDED, **_RPP)),
        _job(tmp, "ppo_padded1", "ppo", [1, 1, 1], _PPO_LOCAL),
        _job(tmp, "moe_padded1", "grpo", [1, 1, 1], dict(_PADDED_FWD, **_R3), variant="moe_tiny"),
    ]
    one1 = _start_script(tmp, 1, one1)
    out = {"cli2": _load_cli(tmp, _wait(cli))}
    (tmp / "cli2.done").write_text("")
    _wait(ppo2 + [one8, one1])
    for name in (
        "ppo2",
        "grpo8",
        "ppo8",
        "resumed",
        "grpo1",
        "ppo1",
        "local2",
        "gathered2",
        "rpp_local2",
        "ppo_local2",
        "moe_local2",
    ):
        out[name] = _load(tmp, name)
    for name in ("padded1", "rpp1", "ppo_padded1", "moe_padded1"):
        out[name] = _load(tmp, name)
    return out


def _norm(key: str) -> str:
    return re.sub(r"\['?value'?\]|\.value|'", "", key)


def _param_diff(a: dict, b: dict) -> float:
    a, b = {_norm(k): v for k, v in a.items()}, {_norm(k): v for k, v in b.items()}
    assert sorted(a) == sorted(b) and a
    d = max(float(np.max(np.abs(a[k].astype(np.float64) - b[k]))) for k in a)
    print(f"max |param diff| = {d:.3g}")  # shown with -s
    return d


def _metric_diff(h1: list, h2: list, prefix: str = "") -> float:
    assert len(h1) == len(h2)
    worst = 0.0
    for m1, m2 in zip(h1, h2):
        keys = {k for k in m1 if k.startswith(prefix) and not k.startswith(_NOT_COMPARED) and k != "step"}
        assert keys and keys <= set(m2), sorted(keys - set(m2))
        worst = max(worst, max(abs(float(m1[k]) - float(m2[k])) for k in keys))
    print(f"max |{prefix or 'metric'} diff| = {worst:.3g}")  # shown with -s
    return worst


@pytest.mark.parametrize("algo", ["grpo", "ppo"])
@pytest.mark.slow
def test_two_processes_equal_one_process(runs, algo):
    """2 processes x 4 devices == 1 x 8 == 1 x 1: every metric of both steps (validation included), params."""
    two = runs["cli2" if algo == "grpo" else "ppo2"]
    one8, one1 = runs[f"{algo}8"], runs[f"{algo}1"]
    assert one8["devices"] == 8 and one1["devices"] == 1
    if algo == "ppo":
        assert two["processes"] == 2 and two["devices"] == 8
        assert "critic/vf_loss" in two["history"][0] and "actor/reward_kl_penalty" in two["history"][0]
    assert len(two["history"]) == 2 and any(k.startswith("val-core/") for k in two["history"][1])
    for ref in (one8, one1):
        assert _metric_diff(two["history"], ref["history"]) <= TOL
        assert _param_diff(two["params"], ref["params"]) <= PARAM_TOL
    assert _param_diff(one8["params"], one1["params"]) > 0  # really different programs, not one cached result


@pytest.mark.slow  # the module fixture `runs`: multi-process/8-device tiny runs (560 s on 2 shared, loaded cores)
def test_cli_process_0_alone_prints(runs):
    stdout = runs["cli2"]["stdout"]  # process 0 alone prints the step lines (and writes metrics.jsonl)
    assert "step 2 | score=" in stdout[0] and "step 2 | score=" not in stdout[1]


@pytest.mark.parametrize("algo", ["grpo", "ppo"])
@pytest.mark.slow  # the `runs` fixture (multi-process tiny runs)
def test_validation_is_process_local(runs, algo):
    """Each process generated and scored only its rows of each held-out batch (padding rows never), and the
    gathered validation metrics equal the 1-process ones and the mean of the logged scores."""
    two, one1 = runs["cli2" if algo == "grpo" else "ppo2"], runs[f"{algo}1"]
    val = lambda calls: [(s, i, v) for s, i, v in calls if s != TRAIN_SEED]
    single = val(one1["rewards"][0])  # 1 process: every held-out row once, in row order
    assert len(single) == VAL_SIZE and len({(s, i) for s, i, _ in single}) == VAL_SIZE
    rows = [(s, i) for s, i, _ in single]
    # rows [0, 8) of batch 1 and the one real row of batch 2 on process 0; rows [8, 16) on process 1
    assert sorted((s, i) for s, i, _ in val(two["rewards"][0])) == sorted(rows[:8] + rows[16:])
    assert sorted((s, i) for s, i, _ in val(two["rewards"][1])) == sorted(rows[8:16])
    # training rows: each process scored its half of the 4 x 4 responses of each of the 2 steps
    assert [len(calls) - len(val(calls)) for calls in (two["rewards"][0], two["rewards"][1])] == [16, 16]
    m2, m1 = two["history"][1], one1["history"][1]
    ds = "reasoning_gym/basic_arithmetic"
    assert m2[f"val-aux/{ds}/num_samples"] == VAL_SIZE  # padding rows not counted
    mean = np.mean([v for calls in two["rewards"].values() for _, _, v in val(calls)])
    assert abs(m2[f"val-core/{ds}/reward/mean@1"] - mean) <= 1e-6
    assert _metric_diff([m2], [m1], prefix="val-") <= TOL


@pytest.mark.slow  # the `runs` fixture (multi-process tiny runs)
def test_resume_on_one_process_with_another_mesh(runs):
    res, cli2, grpo8 = runs["resumed"], runs["cli2"], runs["grpo8"]
    assert res["devices"] == 8 and res["processes"] == 1
    assert res["global_steps_after_restore"] == 1
    assert res["restored_keys_match"] and res["restored_bitwise"]
    # the continued run (step 2, validation included) equals the straight runs
    assert len(res["history"]) == 1
    assert _metric_diff(cli2["history"][:1] + res["history"], cli2["history"]) <= TOL
    assert _param_diff(res["params"], cli2["params"]) <= PARAM_TOL
    assert _param_diff(res["params"], grpo8["params"]) <= PARAM_TOL


@pytest.mark.slow  # the `runs` fixture (multi-process tiny runs)
def test_fsdp_shards_params_and_optimizer_state_and_constraints_apply(runs):
    one8, one1 = runs["grpo8"], runs["grpo1"]
    # params + optimizer state: every leaf is split 8 ways (fsdp=8) except the norm scales
    fractions = one8["fractions"]
    replicated = {k for k, f in fractions.items() if f == 1.0}
    assert replicated and all("norm" in k for k in replicated), replicated
    assert {f for f in fractions.values() if f != 1.0} == {8.0}
    assert any("opt_state" in k or "mu" in k for k in fractions if k not in replicated)
    assert one8["bytes_device0"] < one8["bytes_total"] / 8 * 1.05  # 1/N per device, up to the norm scales
    # the decoder's activation constraints were traced under the mesh (not silently skipped)
    assert one8["constrain_calls"] > 0 and one8["constrain_with_mesh"] == one8["constrain_calls"]
    assert one1["constrain_with_mesh"] == 0  # one device: no mesh, nothing to constrain


@pytest.mark.slow  # the `runs` fixture (multi-process tiny runs)
@pytest.mark.parametrize(
    "local, ref",
    [
        ("local2", "gathered2"),
        ("local2", "padded1"),
        ("rpp_local2", "rpp1"),
        ("ppo_local2", "ppo_padded1"),
        ("moe_local2", "moe_padded1"),
    ],
)
def test_process_local_rows_equal_the_gathered_run(runs, local, ref):
    """`trainer.distributed.process_local_rows` on 2 processes: every metric of both steps equals the gathered
    2-process run and the 1-process run (GRPO: group statistics, old and reference log-prob forwards on local rows;
    REINFORCE++ and PPO's GAE: whitened over the whole batch, a statistic across processes; PPO: the critic's
    values, update and `vf_explained_var`; an MoE actor replaying the rollout's routes, which stay on the process
    that generated them, and its mismatch metrics reduced across processes), params too; each host received far
    fewer bytes per step."""
    two, other = runs[local], runs[ref]
    assert two["processes"] == 2 and len(two["history"]) == 2
    if local == "moe_local2":
        # The router statistics are per micro-batch: a max / min over experts of a micro-batch's loads, the aux loss
        # a product of its means. Process-local rows put other rows together in a micro-batch (each process's block
        # of the global mini-batch), so these differ like any statistic of another batch split (seen <= 2.7e-3).
        # Everything else, the replay's mismatch metrics included, is held to TOL; the other process's routes
        # (16 responses x 104 tokens x 2 layers x top-2, uint8) would be 6,656 bytes received per step.
        assert all("training/rollout_probs_diff_max" in m for m in two["history"])
        # those metrics are ~0 under float32 replay, so the whole batch's cannot be told from one process's here:
        # the probe (mismatch_probe.py) ran them on distinct rows per process, against both processes' rows
        rows = [probe_rows(i) for i in range(2)]
        cat = lambda k: np.concatenate([r[0][k] for r in rows])
        want = compute_rollout_probs_diff_metrics(
            cat("old_log_probs"), cat("rollout_log_probs"), np.concatenate([r[1] for r in rows])
        )
        got = two["mismatch_probe"]
        assert sorted(got) == sorted(want)
        np.testing.assert_allclose([got[k] for k in sorted(want)], [float(want[k]) for k in sorted(want)], rtol=1e-5)
        assert max(m["perf/host_gather_bytes"] for m in two["history"]) < 16 * 104 * 2 * 2
        router = [{k: v for k, v in m.items() if k.startswith("actor/moe/")} for m in two["history"]]
        router_ref = [{k: v for k, v in m.items() if k.startswith("actor/moe/")} for m in other["history"]]
        assert router[0] and _metric_diff(router, router_ref) <= 5e-3
        strip = lambda h: [{k: v for k, v in m.items() if not k.startswith("actor/moe/")} for m in h]
        two, other = dict(two, history=strip(two["history"])), dict(other, history=strip(other["history"]))
    assert _metric_diff(two["history"], other["history"]) <= TOL
    whitened = local in ("rpp_local2", "ppo_local2")
    assert _param_diff(two["params"], other["params"]) <= (WHITENED_PARAM_TOL if whitened else PARAM_TOL)
    got = [m["perf/host_gather_bytes"] for m in two["history"]]
    if ref == "gathered2":
        full = [m["perf/host_gather_bytes"] for m in other["history"]]
        print(f"perf/host_gather_bytes per step: process-local {got}, gathered {full}")  # shown with -s
        # gathered: the other process's 16 responses of T = 56 + 48 tokens (several int32 / float32 fields)
        assert min(full) > 16 * 104 * 4 * 3 and max(got) * 20 < min(full)
    else:
        assert "perf/host_gather_bytes" not in other["history"][0]  # one process: the metric is not logged
