"""Optimizer-state host offload (`actor.fsdp_config.optimizer_offload`, `critic.fsdp_config.optimizer_offload`)
and the hybrid ICI x DCN mesh (`trainer.mesh.dcn_data` / `dcn_fsdp`), on CPU.

Offload: XLA:CPU has a 'pinned_host' memory space, so the offloaded update runs here. A tiny PPO run (actor and
critic) with the flags on must give bitwise the same params, optimizer state and metrics as with them off, keep
every optimizer leaf in 'pinned_host' between steps, and restore a checkpoint into host memory. The update's
lowering for TPU and CUDA (no device needed) carries the host memory kind on the optimizer arguments / results.

Mesh: CPU devices have no `slice_index`, so the multi-slice layout is checked on fake device objects with the
attributes `jax.experimental.mesh_utils` reads.
"""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from jaxrl_post.runtime.sharding import HOST_MEMORY, init_opt_state, make_mesh
from tests.cheap_compile import CHEAP_COMPILE_FLAGS

_TIME_KEYS = ("timing_s/", "timing_per_token_ms/", "perf/time_per_step", "perf/throughput", "perf/mfu/")


def _kinds(tree):
    return {x.sharding.memory_kind for x in jax.tree.leaves(tree)}


def _host(tree):
    return [np.asarray(jax.device_get(x)) for x in jax.tree.leaves(tree)]


def _assert_bitwise(a, b):
    assert len(a) == len(b) > 0
    for x, y in zip(a, b):
        assert x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes()


# ------------------------------------------------------------------------------------------------ offload
def _toy():
    import optax

    tx = optax.adamw(1e-2, weight_decay=0.1)
    params = {"w": jnp.arange(12.0).reshape(3, 4) / 7.0, "b": jnp.ones(4)}
    grads = {"w": jnp.full((3, 4), 0.3), "b": jnp.linspace(-1.0, 1.0, 4)}

    def update(p, s, g):
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s, {"n": optax.tree.norm(u)}

    return tx, params, grads, update


def test_offloaded_toy_update_matches_and_stays_on_host():
    from jaxrl_post.engine.placement import Placement

    tx, params, grads, update = _toy()
    placement = Placement(make_mesh(devices=jax.devices()[:1]), n_devices=1)
    # reference: plain optax, no jit_update, no offload
    p_ref, s_ref = params, tx.init(params)
    for _ in range(2):
        p_ref, s_ref, _ = jax.jit(update)(p_ref, s_ref, grads)

    p = placement.commit(jax.tree.map(jnp.copy, params))
    s = placement.commit(init_opt_state(tx, p, None, offload=True))
    assert _kinds(s) == {HOST_MEMORY}
    fn = placement.jit_update(update, p, s)
    for _ in range(2):
        p, s, _ = fn(p, s, grads)
        assert _kinds(s) == {HOST_MEMORY} and _kinds(p) == {"device"}
    assert fn._cache_size() == 1
    _assert_bitwise(_host(p), _host(p_ref))
    _assert_bitwise(_host(s), _host(s_ref))


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_offloaded_update_lowers_with_host_memory_kind(platform):
    """The lowering for an accelerator (no device needed): every optimizer-state argument and result is in
    'pinned_host', the params in device memory, and the state is moved to the device inside the update."""
    from jaxrl_post.engine.placement import Placement

    tx, params, grads, update = _toy()
    placement = Placement(make_mesh(devices=jax.devices()[:1]), n_devices=1)
    p = placement.commit(params)
    s = placement.commit(init_opt_state(tx, p, None, offload=True))
    n_opt = len(jax.tree.leaves(s))  # count, mu (2), nu (2)
    text = placement.jit_update(update, p, s).trace(p, s, grads).lower(lowering_platforms=(platform,)).as_text()
    main = next(line for line in text.splitlines() if "func.func public @main" in line)
    args, results = main.split(") -> (")
    assert args.count('mhlo.memory_kind = "pinned_host"') == n_opt
    assert args.count('mhlo.memory_kind = "device"') == len(jax.tree.leaves(p))
    assert results.count('mhlo.memory_kind = "pinned_host"') == n_opt
    placements = [line for line in text.splitlines() if "annotate_device_placement" in line]
    # in: each optimizer leaf moved to the device; out: the new state to host, the params (explicit kind) to device
    assert sum('_xla_buffer_placement = "device"' in line for line in placements) == n_opt + len(jax.tree.leaves(p))
    assert sum('_xla_buffer_placement = "pinned_host"' in line for line in placements) == n_opt
    # without offload: no host memory anywhere
    s2 = placement.commit(init_opt_state(tx, p, None))
    plain = placement.jit_update(update, p, s2).trace(p, s2, grads).lower(lowering_platforms=(platform,)).as_text()
    assert "pinned_host" not in plain and "annotate_device_placement" not in plain


_MESH_SCRIPT = """
import json, jax, jax.numpy as jnp, numpy as np, optax
from jaxrl_post.runtime.sharding import init_opt_state, make_mesh, shard_params
from jaxrl_post.engine.placement import Placement
from jax.sharding import NamedSharding, PartitionSpec as P

mesh = make_mesh(data=1, fsdp=2, tensor=2)
tx = optax.adamw(1e-2, weight_decay=0.1)
w = NamedSharding(mesh, P("fsdp", "tensor"))
def update(p, s, g):
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s, {}
def run(offload):
    placement = Placement(mesh)
    p = placement.commit({"w": jax.device_put(jnp.arange(32.0).reshape(4, 8) / 9.0, w)})
    s = placement.commit(init_opt_state(tx, p, mesh, offload=offload))
    g = {"w": jax.device_put(jnp.full((4, 8), 0.25), w)}
    fn = placement.jit_update(update, p, s)
    for _ in range(2):
        p, s, _ = fn(p, s, g)
    leaves = jax.tree.leaves(s)
    return {
        "kinds": sorted({x.sharding.memory_kind for x in leaves}),
        "specs": [str(x.sharding.spec) for x in leaves],
        "bytes": [np.asarray(x).tobytes().hex() for x in jax.tree.leaves((p, s))],
        "compiles": fn._cache_size(),
    }
res = {"on": run(True), "off": run(False)}

# the trainer's packed actor update (scripts/hlo_check.py's tiny model), offloaded, lowered for TPU / CUDA
import importlib.util, re
spec = importlib.util.spec_from_file_location("hlo_check", "scripts/hlo_check.py")
hc = importlib.util.module_from_spec(spec)
spec.loader.exec_module(hc)
from jaxrl_post.models import init_model
from jaxrl_post.engine import packed_steps, packing, steps
from jaxrl_post.rl import ppo_update
placement = Placement(mesh)
graphdef, params, rest = steps.split_model(init_model(hc.TINY, seed=0, mesh=mesh))
params = placement.commit(params)
tx = steps.make_optimizer(steps.OptimConfig(lr=1e-6))
opt = placement.commit(init_opt_state(tx, params, mesh, offload=True))
rows, row_len = packing.micro_geometry(micro_batch_size=hc.MICRO, use_dynamic_bsz=False, max_token_len_per_gpu=None,
    seq_len=hc.P_LEN + hc.R_LEN, seqs_per_row=1, dp=2, n_seqs=hc.M)
pspec = packing.make_pack_spec(hc.M, rows, hc.P_LEN, hc.R_LEN, row_len=row_len)
batch = placement.put_packed(placement.pack(hc.fake_batch(np.random.default_rng(0)), pspec))
update = ppo_update.make_actor_update(packed_steps.PACKED, graphdef, rest, tx, ppo_update.ActorLossConfig())
upd = placement.jit_update(update, params, opt)
res["n_opt"], res["n_params"] = len(jax.tree.leaves(opt)), len(jax.tree.leaves(params))
for plat in ("tpu", "cuda"):
    with jax.set_mesh(mesh):
        text = upd.trace(params, opt, batch).lower(lowering_platforms=(plat,)).as_text()
    main = next(line for line in text.splitlines() if "func.func public @main" in line)
    args, results = main.split(") -> (", 1)
    host = 'memory_kind = "pinned_host"'
    to_device = r'annotate_device_placement.*_xla_buffer_placement = "device"'
    res[plat] = {"args_host": args.count(host), "results_host": results.count(host),
                 "to_device": len(re.findall(to_device, text))}
print("RESULT " + json.dumps(res))
"""


def test_offload_on_a_sharded_mesh_keeps_specs_and_numbers():
    """4 fake CPU devices, (data 1, fsdp 2, tensor 2): the offloaded moments keep their param's spec and the
    numbers; the trainer's packed actor update lowers for TPU / CUDA with the state in host memory."""
    import json
    import subprocess

    env = dict(
        os.environ,
        XLA_FLAGS="--xla_force_host_platform_device_count=4 " + CHEAP_COMPILE_FLAGS,
        JAX_PLATFORMS="cpu",
        PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
    )
    proc = subprocess.run([sys.executable, "-c", _MESH_SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    res = json.loads(lines[-1][len("RESULT ") :])
    assert res["on"]["kinds"] == [HOST_MEMORY] and res["off"]["kinds"] == ["device"]
    assert res["on"]["specs"] == res["off"]["specs"] == ["P()"] + ["P('fsdp', 'tensor')"] * 2
    assert res["on"]["bytes"] == res["off"]["bytes"]
    assert res["on"]["compiles"] == res["off"]["compiles"] == 1
    # the trainer's packed actor update lowered for TPU / CUDA: the whole optimizer state in host memory on the
    # way in and out, each leaf moved to the device inside (the params' outputs carry a device placement too)
    n_opt, n_params = res["n_opt"], res["n_params"]
    assert n_opt >= 2 * n_params  # mu, nu (+ step counts)
    for plat in ("tpu", "cuda"):
        assert res[plat] == {"args_host": n_opt, "results_host": n_opt, "to_device": n_opt + n_params}, plat


def _ppo_cfg(workdir, offload: bool):
    from configs import ppo

    c = ppo.get_config("tiny")
    c.trainer.default_local_dir = str(workdir)
    c.trainer.total_training_steps = 2
    c.trainer.save_freq = 2
    c.trainer.val_before_train = False
    c.trainer.val_at_end = False
    c.trainer.progress_bar = False
    c.trainer.async_save = False
    c.actor.fsdp_config.optimizer_offload = offload
    c.critic.fsdp_config.optimizer_offload = offload
    return c


def _ppo_run(workdir, offload: bool) -> dict:
    from jaxrl_post.rl.trainer import RLTrainer

    t = RLTrainer(_ppo_cfg(workdir, offload), console_write=lambda s: None)
    try:
        kinds = [(_kinds(t.state.actor.opt_state), _kinds(t.state.critic.opt_state))]
        hist = t.fit(max_steps=1)["history"]
        kinds.append((_kinds(t.state.actor.opt_state), _kinds(t.state.critic.opt_state)))
        hist += t.fit()["history"]
        kinds.append((_kinds(t.state.actor.opt_state), _kinds(t.state.critic.opt_state)))
        return {
            "history": [{k: v for k, v in m.items() if not k.startswith(_TIME_KEYS)} for m in hist],
            "kinds": kinds,
            "param_kinds": _kinds(t.state.actor.params) | _kinds(t.state.critic.params),
            "arrays": {
                "actor.params": _host(t.state.actor.params),
                "actor.opt_state": _host(t.state.actor.opt_state),
                "critic.params": _host(t.state.critic.params),
                "critic.opt_state": _host(t.state.critic.opt_state),
            },
            "compiles": t.compile_counts(),
        }
    finally:
        t.close()


@pytest.mark.slow  # two 2-step tiny PPO runs and a restore: ~50 s on 2 shared cores
def test_tiny_ppo_with_optimizer_offload_is_bitwise_equal_and_resumes(tmp_path):
    from jaxrl_post.rl.trainer import RLTrainer

    off = _ppo_run(tmp_path / "off", offload=False)
    on = _ppo_run(tmp_path / "on", offload=True)
    assert len(on["history"]) == 2 and on["history"] == off["history"]
    for k in off["arrays"]:
        _assert_bitwise(on["arrays"][k], off["arrays"][k])
    assert on["kinds"] == [({HOST_MEMORY}, {HOST_MEMORY})] * 3  # at init, between the steps, after
    assert off["kinds"] == [({"device"}, {"device"})] * 3
    assert on["param_kinds"] == {"device"}
    assert set(on["compiles"].values()) == {1}  # the host-resident state keeps one compiled update

    # restore (orbax reads into the live shardings): the saved state comes back in host memory, bit for bit
    t = RLTrainer(_ppo_cfg(tmp_path / "on", offload=True), console_write=lambda s: None)
    try:
        assert t.global_steps == 2
        assert _kinds(t.state.actor.opt_state) == _kinds(t.state.critic.opt_state) == {HOST_MEMORY}
        _assert_bitwise(_host(t.state.actor.opt_state), on["arrays"]["actor.opt_state"])
        _assert_bitwise(_host(t.state.critic.opt_state), on["arrays"]["critic.opt_state"])
        _assert_bitwise(_host(t.state.actor.params), on["arrays"]["actor.params"])
    finally:
        t.close()


# ------------------------------------------------------------------------------------------------ mesh
class FakeDevice:
    """What `mesh_utils.create_hybrid_device_mesh` / `create_device_mesh` read from a device."""

    def __init__(self, id, process_index, slice_index=None, coords=(0, 0, 0), platform="tpu", kind="TPU v4"):
        self.id, self.process_index, self.coords = id, process_index, coords
        self.platform, self.device_kind, self.core_on_chip = platform, kind, 0
        if slice_index is not None:
            self.slice_index = slice_index

    def __repr__(self):
        return f"FakeDevice({self.id})"


def _tpu_slices(n_slices, chips=(2, 2, 1)):
    """`n_slices` TPU v4 slices of `chips` (x, y, z) each, two hosts per slice, listed in a shuffled order."""
    per = int(np.prod(chips))
    devs = [
        FakeDevice(s * per + i, s * 2 + i * 2 // per, s, tuple(int(v) for v in c))
        for s in range(n_slices)
        for i, c in enumerate(np.ndindex(*chips))
    ]
    return [devs[i] for i in np.random.default_rng(0).permutation(len(devs))]


def _attr(array, name):
    return np.vectorize(lambda d: getattr(d, name))(array)


@pytest.mark.parametrize(
    "ici, dcn",
    [((1, 4, 1), (2, 1, 1)), ((2, 2, 1), (1, 2, 1)), ((1, 2, 2), (2, 1, 1)), ((1, 4, 1), (2, 2, 1))],
)
def test_hybrid_mesh_puts_each_slice_in_a_contiguous_block(ici, dcn):
    from jaxrl_post.runtime.sharding import hybrid_device_array

    n_slices = int(np.prod(dcn))
    devs = _tpu_slices(n_slices)
    arr = hybrid_device_array(ici, dcn, devs)
    assert arr.shape == tuple(i * d for i, d in zip(ici, dcn))
    assert sorted(d.id for d in arr.flat) == list(range(len(devs)))  # every device once
    sl = _attr(arr, "slice_index")
    # block (a, b) of the [dcn_data, dcn_fsdp] grid is one slice; slice k sits at grid position k (row-major)
    for k, (a, b) in enumerate(np.ndindex(dcn[0], dcn[1])):
        block = sl[a * ici[0] : (a + 1) * ici[0], b * ici[1] : (b + 1) * ici[1], :]
        assert block.shape == tuple(ici) and (block == k).all()


def test_hybrid_mesh_granules_by_process_without_slice_index():
    """GPU-like devices (no `slice_index`): one process = one slice; inside a slice the devices by id."""
    from jaxrl_post.runtime.sharding import hybrid_device_array, slice_groups

    devs = [FakeDevice(i, i // 4, platform="gpu", kind="NVIDIA H200") for i in (5, 0, 7, 2, 6, 1, 4, 3)]
    attr, groups = slice_groups(devs)
    assert attr == "process_index" and sorted(groups) == [0, 1]
    arr = hybrid_device_array((1, 4, 1), (2, 1, 1), devs)
    assert _attr(arr, "id")[..., 0].tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_hybrid_mesh_errors():
    from jaxrl_post.runtime.sharding import hybrid_device_array

    with pytest.raises(ValueError, match=r"dcn_data\*dcn_fsdp = 4 slices, but the 8 devices form 2 group\(s\)"):
        hybrid_device_array((1, 2, 1), (2, 2, 1), _tpu_slices(2))
    uneven = _tpu_slices(2)[:7]
    with pytest.raises(ValueError, match=r"each slice must hold"):
        hybrid_device_array((1, 4, 1), (2, 1, 1), uneven)


def test_make_mesh_dcn_on_cpu():
    """One CPU process is one slice: dcn factors of 1 give today's mesh, a factor > 1 a clear error."""
    from configs import grpo
    from jaxrl_post.errors import ConfigError
    from jaxrl_post.rl import builders

    n = jax.device_count()
    plain = make_mesh(devices=jax.devices())
    same = make_mesh(devices=jax.devices(), dcn_data=1, dcn_fsdp=1)
    assert same.devices.tolist() == plain.devices.tolist() and same.shape == plain.shape
    one_process = [FakeDevice(i, 0, platform="cpu", kind="cpu") for i in range(2 * n)]
    with pytest.raises(ValueError, match=rf"dcn_data\*dcn_fsdp = 2 slices, but the {2 * n} devices form 1 group"):
        make_mesh(devices=one_process, dcn_fsdp=2)
    c = grpo.get_config("tiny")
    c.trainer.mesh.dcn_data = 2
    with pytest.raises(ConfigError, match=r"config.trainer.mesh: .*(slices|group)"):
        builders.build_mesh(c)


def test_validate_config_mesh_with_dcn():
    from configs import grpo
    from jaxrl_post.errors import ConfigError
    from jaxrl_post.rl.config_check import data_parallel_size, validate_config

    c = grpo.get_config("tiny")
    c.data.train_batch_size, c.actor.ppo_mini_batch_size = 8, 8
    c.actor.ppo_micro_batch_size = c.rollout.log_prob_micro_batch_size = c.ref.log_prob_micro_batch_size = 32
    c.trainer.mesh.dcn_data = 2
    validate_config(c, n_devices=8)  # 2 slices x fsdp=-1 (4 per slice)
    assert data_parallel_size(c, 8) == 8
    c.trainer.mesh.tensor = 2
    assert data_parallel_size(c, 8) == 4  # 2 slices x (fsdp 2 x tensor 2)
    c.trainer.mesh.tensor, c.trainer.mesh.fsdp = 1, 2
    want = r"data\*fsdp\*expert\*tensor = 2 x dcn_data\*dcn_fsdp = 2 slices but 8 devices"
    with pytest.raises(ConfigError, match=want):
        validate_config(c, n_devices=8)
    c.trainer.mesh.fsdp, c.trainer.mesh.dcn_data = -1, 3
    with pytest.raises(ConfigError, match=r"8 devices are not divisible by dcn_data\*dcn_fsdp = 3 slices"):
        validate_config(c, n_devices=8)
    c.trainer.mesh.dcn_data = 0
    with pytest.raises(ConfigError, match=r"trainer.mesh.dcn_data=0: must be a positive int"):
        validate_config(c, n_devices=8)
    c.trainer.mesh.dcn_data, c.trainer.mesh.expert = 1, 2
    assert data_parallel_size(c, 8) == 8  # the expert axis is a batch axis: fsdp 4 x expert 2
    c.trainer.mesh.tensor = 2
    assert data_parallel_size(c, 8) == 4  # fsdp 2 x expert 2 (x tensor 2)
    c.trainer.mesh.expert = 0
    with pytest.raises(ConfigError, match=r"trainer.mesh.expert=0: must be -1 or a positive int"):
        validate_config(c, n_devices=8)
