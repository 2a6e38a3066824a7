"""Multi-host: the same tiny GRPO run on 2 processes x 4 fake CPU devices (jax.distributed, coordinator on
localhost, launched through the CLI with the `trainer.distributed.*` keys) as on 1 process x 8 devices and
1 process x 1 device; save on 2 processes, resume on 1 process with another mesh shape.

All runs are subprocesses (fake device counts must be set before jax starts). One module fixture runs them
once; the tests compare their outputs.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys

import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOL = 1e-5
# metrics that measure time or throughput differ between runs by nature
_NOT_COMPARED = ("timing_s/", "timing_per_token_ms/", "perf/")
# tiny GRPO, on-policy without KL (fewer programs to compile: the suite runs on 2 cores)
_OVERRIDES = {
    "trainer.val_before_train": False,
    "trainer.val_at_end": False,
    "trainer.total_training_steps": 2,
    "actor.use_kl_loss": False,
    "actor.ppo_mini_batch_size": 4,  # prompts: the whole step -> exactly on-policy
    "actor.ppo_micro_batch_size": 8,
}

_SCRIPT = r"""
import json, os, re, sys
sys.path.insert(0, os.getcwd())
args = json.loads(sys.argv[1])
from jaxrl_post import distributed
distributed.initialize(**args.get("dist", {}))  # before any other JAX call
import jax, numpy as np
from configs import grpo, ppo
from jaxrl_post import sharding
from jaxrl_post.distributed import to_host
from jaxrl_post.trainer import checkpoint as ckpt
from jaxrl_post.trainer.trainer import RLTrainer

seen = []  # whether the model's activation constraints saw an ambient mesh (trace time)
_constrain = sharding.constrain
def spy(x, names):
    m = jax.sharding.get_abstract_mesh()
    seen.append(not (m is None or m.empty))
    return _constrain(x, names)
sharding.constrain = spy

c = {"grpo": grpo, "ppo": ppo}[args.get("algo", "grpo")].get_config("tiny")
for k, v in args["overrides"].items():
    node = c
    *head, last = k.split(".")
    for h in head:
        node = node[h]
    node[last] = v
c.trainer.default_local_dir = args["workdir"]
c.trainer.mesh.data, c.trainer.mesh.fsdp, c.trainer.mesh.tensor = args["mesh"]
if args.get("resume"):
    c.trainer.resume_mode, c.trainer.resume_from_path = "resume_path", args["resume"]
t = RLTrainer(c)
flat = lambda tree: {jax.tree_util.keystr(p): to_host(x) for p, x in jax.tree_util.tree_leaves_with_path(tree)}
out = {"devices": jax.device_count(), "processes": jax.process_count()}
if args.get("resume"):  # restored params vs the checkpoint's arrays read back without any mesh
    raw = ckpt.Checkpointer(os.path.dirname(args["resume"]), read_only=True).restore_raw("actor.params", 1)
    raw = {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(raw)}
    norm = lambda k: re.sub(r"\['?value'?\]|\.value|'", "", k)
    got = {norm(k): v for k, v in flat(t.actor_params).items()}
    raw = {norm(k): v for k, v in raw.items()}
    out["restored_keys_match"] = sorted(raw) == sorted(got)
    out["restored_bitwise"] = all(np.array_equal(raw[k], got[k]) for k in raw) and len(raw) > 0
    out["global_steps_after_restore"] = t.global_steps
if args.get("shard_stats"):  # bytes of params + optimizer state held by one device vs the whole
    leaves = jax.tree_util.tree_leaves_with_path((t.actor_params, t.actor_opt_state))
    arrays = {jax.tree_util.keystr(p): x for p, x in leaves if hasattr(x, "addressable_shards") and x.ndim >= 1}
    dev = jax.devices()[0]
    local = lambda x: sum(s.data.nbytes for s in x.addressable_shards if s.device == dev)
    out["bytes_total"] = sum(x.nbytes for x in arrays.values())
    out["bytes_device0"] = sum(local(x) for x in arrays.values())
    out["fractions"] = {k: x.nbytes / local(x) for k, x in arrays.items()}
res = t.fit()
out["history"] = res["history"]
out["constrain_calls"], out["constrain_with_mesh"] = len(seen), sum(seen)
params = flat(t.actor_params)
t.close()
if jax.process_index() == 0:
    np.savez(args["out"] + ".npz", **params)
    json.dump(out, open(args["out"] + ".json", "w"))
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _env(n_devices: int) -> dict:
    flags = f"--xla_force_host_platform_device_count={n_devices} --xla_backend_optimization_level=0"
    return dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=flags, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")


def _start_script(tmp, name, n_devices, mesh, overrides=_OVERRIDES, **extra):
    args = dict(overrides=overrides, workdir=str(tmp / name), mesh=mesh, out=str(tmp / name) + ".out", **extra)
    cmd = [sys.executable, str(tmp / "run.py"), json.dumps(args)]
    return subprocess.Popen(
        cmd, cwd=REPO, env=_env(n_devices), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _finish_script(tmp, name, proc):
    _, err = proc.communicate(timeout=900)
    assert proc.returncode == 0, err[-4000:]
    out = json.loads((tmp / f"{name}.out.json").read_text())
    out["params"] = dict(np.load(tmp / f"{name}.out.npz"))
    return out


def _start_cli_two_processes(tmp):
    """`python -m jaxrl_post.main` on 2 processes x 4 devices, checkpoint every step."""
    port, workdir = _free_port(), tmp / "cli2"
    base = [sys.executable, "-m", "jaxrl_post.main", "--config=configs/grpo.py:tiny"]
    base += [f"--config.{k}={v}" for k, v in _OVERRIDES.items()]
    base += [
        f"--config.trainer.default_local_dir={workdir}",
        "--config.trainer.save_freq=1",
        "--config.trainer.mesh.fsdp=4",
        "--config.trainer.mesh.tensor=2",
        f"--config.trainer.distributed.coordinator_address=localhost:{port}",
        "--config.trainer.distributed.num_processes=2",
    ]
    pipe = dict(cwd=REPO, env=_env(4), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return [subprocess.Popen(base + [f"--config.trainer.distributed.process_id={i}"], **pipe) for i in range(2)]


def _finish_cli(tmp, procs):
    import jax

    from jaxrl_post.trainer import checkpoint as ckpt

    outs = [p.communicate(timeout=900) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-4000:]
    workdir = tmp / "cli2"
    lines = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    history = [line for line in lines if "critic/score/mean" in line]
    raw = ckpt.Checkpointer(ckpt.checkpoint_dir(workdir), read_only=True).restore_raw("actor.params", 2)
    params = {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(raw)}
    return {"history": history, "params": params, "stdout": [o for o, _ in outs], "workdir": workdir}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("multihost")
    (tmp / "run.py").write_text(_SCRIPT)
    # started together: the 2-process run waits on its collectives, the others use that time
    cli = _start_cli_two_processes(tmp)
    one8 = _start_script(tmp, "one8", 8, [1, 4, 2], shard_stats=True)
    one1 = _start_script(tmp, "one1", 1, [1, 1, 1])
    out = {"cli2": _finish_cli(tmp, cli)}
    resume = str(out["cli2"]["workdir"] / "checkpoints" / "global_step_1")
    resumed = _start_script(tmp, "resumed", 4, [2, 2, 1], resume=resume)
    out["one8"] = _finish_script(tmp, "one8", one8)
    out["one1"] = _finish_script(tmp, "one1", one1)
    out["resumed"] = _finish_script(tmp, "resumed", resumed)
    return out


def _norm(key: str) -> str:
    return re.sub(r"\['?value'?\]|\.value|'", "", key)


def _param_diff(a: dict, b: dict) -> float:
    a, b = {_norm(k): v for k, v in a.items()}, {_norm(k): v for k, v in b.items()}
    assert sorted(a) == sorted(b) and a
    d = max(float(np.max(np.abs(a[k].astype(np.float64) - b[k]))) for k in a)
    print(f"max |param diff| = {d:.3g}")  # shown with -s
    return d


def _metric_diff(h1: list, h2: list) -> float:
    assert len(h1) == len(h2) == 2
    worst = 0.0
    for m1, m2 in zip(h1, h2):
        keys = {k for k in m1 if not k.startswith(_NOT_COMPARED) and k != "step"}
        assert keys and keys <= set(m2), sorted(keys - set(m2))
        worst = max(worst, max(abs(float(m1[k]) - float(m2[k])) for k in keys))
    print(f"max |metric diff| = {worst:.3g}")  # shown with -s
    return worst


def test_two_processes_equal_one_process(runs):
    cli2, one8, one1 = runs["cli2"], runs["one8"], runs["one1"]
    assert one8["devices"] == 8 and one1["devices"] == 1
    assert _metric_diff(cli2["history"], one8["history"]) <= TOL
    assert _metric_diff(cli2["history"], one1["history"]) <= TOL
    assert _param_diff(cli2["params"], one8["params"]) <= TOL
    assert _param_diff(cli2["params"], one1["params"]) <= TOL
    assert _param_diff(one8["params"], one1["params"]) > 0  # really different programs, not one cached result
    # process 0 alone prints the step lines (and writes metrics.jsonl, read above)
    assert "step 2 | score=" in cli2["stdout"][0] and "step 2 | score=" not in cli2["stdout"][1]


def test_resume_on_one_process_with_another_mesh(runs):
    res, cli2, one8 = runs["resumed"], runs["cli2"], runs["one8"]
    assert res["devices"] == 4 and res["processes"] == 1
    assert res["global_steps_after_restore"] == 1
    assert res["restored_keys_match"] and res["restored_bitwise"]
    # the continued run (step 2) equals the straight runs
    assert len(res["history"]) == 1
    assert _metric_diff(cli2["history"][:1] + res["history"], cli2["history"]) <= TOL
    assert _param_diff(res["params"], cli2["params"]) <= TOL
    assert _param_diff(res["params"], one8["params"]) <= TOL


def test_fsdp_shards_params_and_optimizer_state_and_constraints_apply(runs):
    one8, one1 = runs["one8"], runs["one1"]
    # params + optimizer state: every leaf is split 8 ways (fsdp=4 x tensor=2) except the norm scales
    fractions = one8["fractions"]
    replicated = {k for k, f in fractions.items() if f == 1.0}
    assert replicated and all("norm" in k for k in replicated), replicated
    assert {f for f in fractions.values() if f != 1.0} == {8.0}
    assert any("opt_state" in k or "mu" in k for k in fractions if k not in replicated)
    assert one8["bytes_device0"] < one8["bytes_total"] / 8 * 1.05  # 1/N per device, up to the norm scales
    # the decoder's activation constraints were traced under the mesh (not silently skipped)
    assert one8["constrain_calls"] > 0 and one8["constrain_with_mesh"] == one8["constrain_calls"]
    assert one1["constrain_with_mesh"] == 0  # one device: no mesh, nothing to constrain


# validation after the last step too: held-out batches are placed from the global batch on every process
_PPO = {"trainer.val_before_train": False, "trainer.val_at_end": True, "trainer.total_training_steps": 2}


def test_ppo_two_processes_equal_one_process(tmp_path):
    """Tiny PPO (critic, GAE, KL in reward, old/ref log-probs, 2 shuffled actor and critic mini-batches)."""
    (tmp_path / "run.py").write_text(_SCRIPT)
    port = _free_port()
    two = [
        _start_script(
            tmp_path,
            "ppo2",
            4,
            [1, 4, 2],
            overrides=_PPO,
            algo="ppo",
            dist=dict(coordinator_address=f"localhost:{port}", num_processes=2, process_id=i),
        )
        for i in range(2)
    ]
    one = _start_script(tmp_path, "ppo1", 1, [1, 1, 1], overrides=_PPO, algo="ppo")
    for p in two[1:]:
        _, err = p.communicate(timeout=900)
        assert p.returncode == 0, err[-4000:]
    ppo2, ppo1 = _finish_script(tmp_path, "ppo2", two[0]), _finish_script(tmp_path, "ppo1", one)
    assert ppo2["processes"] == 2 and ppo2["devices"] == 8 and ppo1["devices"] == 1
    assert "critic/vf_loss" in ppo2["history"][0] and "actor/reward_kl_penalty" in ppo2["history"][0]
    assert any(k.startswith("val-core/") for k in ppo2["history"][1])  # compared below with the rest
    assert _metric_diff(ppo2["history"], ppo1["history"]) <= TOL
    assert _param_diff(ppo2["params"], ppo1["params"]) <= TOL
