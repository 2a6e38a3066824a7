"""Checkpointer: round trip, retention, atomicity (tmp dirs, SIGKILL mid-save), disk full, resume modes,
sharded restore on 8 fake devices."""

import functools
import json
import os
import signal
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxrl_post.engine.run import checkpoint as ckpt
from jaxrl_post.engine.run.checkpoint import Checkpointer, CheckpointError
from tests.cheap_compile import CHEAP_COMPILE_FLAGS
from tests.script_loader import load_script

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class _Tiny(nnx.Module):
    def __init__(self, rngs):
        self.a = nnx.Linear(4, 3, rngs=rngs)
        self.b = nnx.Linear(3, 2, rngs=rngs)


@functools.lru_cache(maxsize=1)
def _abstract_train_state():
    """Shapes/dtypes of (nnx params, optax AdamW state): traced only, nothing compiled (fast)."""

    def make():
        params = nnx.state(_Tiny(nnx.Rngs(0)), nnx.Param)
        tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
        return params, tx.init(params)

    return jax.eval_shape(make)


def _state(seed=0, critic=False):
    """A trainer-shaped state with distinct deterministic values per seed (host arrays -> device)."""
    rng = np.random.default_rng(seed)

    def fill(s):
        if jnp.issubdtype(s.dtype, jnp.floating):
            return jnp.asarray(rng.standard_normal(s.shape).astype(s.dtype))
        return jnp.asarray(np.full(s.shape, seed + 3, s.dtype))

    params, opt = jax.tree.map(fill, _abstract_train_state())
    return {
        "actor": {"params": params, "opt_state": opt},
        "critic": {"params": jax.tree.map(fill, _abstract_train_state()[0])} if critic else None,
        "rng": jnp.asarray(np.array([seed, 7 + seed], np.uint32)),
        "host": {"global_steps": 3, "kl_ctrl": {"value": 0.001}, "data_iter": {"next_index": 5}},
    }


def _leaves_equal(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert jax.tree.structure(a) == jax.tree.structure(b)
    assert len(la) == len(lb) > 0
    for x, y in zip(la, lb):
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and x.shape == y.shape
        assert x.tobytes() == y.tobytes()  # bitwise


def _run_py(code, env=None, timeout=240):
    e = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO)
    e.update(env or {})
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], env=e, capture_output=True, text=True, timeout=timeout
    )


def test_roundtrip_bitwise_async_and_donation_safe(tmp_path):
    state = _state(critic=True)
    want = jax.tree.map(lambda x: np.array(x), {k: v for k, v in state.items() if k != "host"})
    c = Checkpointer(ckpt.checkpoint_dir(tmp_path), max_to_keep=3)
    assert c.latest_step() is None
    assert c.save(2, state)
    # the caller donates its buffers to the next update right after `save` returns (async write)
    donate = jax.jit(lambda t: jax.tree.map(lambda x: x * 0 + 1, t), donate_argnums=0)
    _ = donate({k: v for k, v in state.items() if k != "host"})
    c.wait_until_finished()
    assert c.all_steps() == [2]
    assert os.path.isdir(os.path.join(tmp_path, "checkpoints", "global_step_2", "actor.params"))

    like = _state(seed=1, critic=True)  # same structure, other values
    got = Checkpointer(ckpt.checkpoint_dir(tmp_path)).restore(like={k: like[k] for k in ("actor", "critic", "rng")})
    for k in ("actor", "critic", "rng"):
        _leaves_equal(got[k], want[k])
    assert isinstance(got["actor"]["params"], nnx.State)
    assert got["host"]["global_steps"] == 3 and got["host"]["data_iter"] == {"next_index": 5}
    assert got["host"]["items"] == ["actor.opt_state", "actor.params", "critic.params", "rng"]
    assert got["host"]["step"] == 2
    # one part alone (what export/evaluate do): no optimizer state is read
    part = Checkpointer(ckpt.checkpoint_dir(tmp_path)).restore(like={"actor": {"params": like["actor"]["params"]}})
    assert set(part) == {"actor", "host"} and set(part["actor"]) == {"params"}
    _leaves_equal(part["actor"]["params"], want["actor"]["params"])
    raw = Checkpointer(ckpt.checkpoint_dir(tmp_path)).restore_raw("critic.params")
    for x, y in zip(jax.tree.leaves(raw), jax.tree.leaves(want["critic"]["params"]), strict=True):
        np.testing.assert_array_equal(np.asarray(x), y)
    key = jax.random.wrap_key_data(jnp.asarray(got["rng"]))  # what the trainer does with it
    assert (np.asarray(jax.random.key_data(key)) == [0, 7]).all()
    c.close()


def test_max_to_keep_absent_items_and_resume_modes(tmp_path):
    root = ckpt.checkpoint_dir(tmp_path)
    c = Checkpointer(root, max_to_keep=2)
    for step in (1, 2, 3, 4):
        s = _state()
        s["host"] = dict(s["host"], global_steps=step)
        c.save(step, s)
    c.wait_until_finished()
    assert c.all_steps() == [3, 4]
    assert sorted(os.listdir(root)) == ["global_step_3", "global_step_4"]
    assert c.read_host()["global_steps"] == 4 and c.read_host(3)["global_steps"] == 3
    # the critic item was None: not written, and asking for it names it
    with pytest.raises(CheckpointError, match=r"no item\(s\) \['critic.params'\]"):
        c.restore(like={"critic": _state(critic=True)["critic"]})
    with pytest.raises(CheckpointError, match="step 1 "):
        c.restore(1, like={"rng": _state()["rng"]})
    c.close()

    assert ckpt.find_resume_checkpoint("disable", tmp_path) is None
    assert ckpt.find_resume_checkpoint("auto", tmp_path) == (root, 4)
    assert ckpt.find_resume_checkpoint("auto", tmp_path / "fresh") is None
    assert ckpt.find_resume_checkpoint("resume_path", tmp_path, os.path.join(root, "global_step_3")) == (root, 3)
    assert ckpt.find_resume_checkpoint("resume_path", tmp_path, root) == (root, 4)
    assert ckpt.find_resume_checkpoint("resume_path", tmp_path, str(tmp_path)) == (root, 4)
    with pytest.raises(CheckpointError, match="global_step_1"):
        ckpt.find_resume_checkpoint("resume_path", tmp_path, os.path.join(root, "global_step_1"))
    with pytest.raises(ValueError, match="resume_from_path"):
        ckpt.find_resume_checkpoint("resume_path", tmp_path, None)
    with pytest.raises(ValueError, match="'auto', 'disable', 'resume_path'"):
        ckpt.find_resume_checkpoint("latest", tmp_path)


def test_unfinalized_tmp_dir_is_never_resumed(tmp_path):
    root = ckpt.checkpoint_dir(tmp_path)
    c = Checkpointer(root, async_save=False)
    c.save(2, _state())
    c.close()
    # what a crash mid-save leaves behind: orbax's tmp dir with partial items (no rename happened)
    tmp = os.path.join(root, "global_step_5.orbax-checkpoint-tmp")
    os.makedirs(os.path.join(tmp, "actor"))
    with open(os.path.join(tmp, "actor", "partial"), "wb") as f:
        f.write(b"\0" * 100)
    assert ckpt.list_complete_steps(root) == [2]
    assert ckpt.find_resume_checkpoint("auto", tmp_path) == (root, 2)
    with pytest.raises(CheckpointError, match="not a complete checkpoint|does not exist|no complete"):
        ckpt.find_resume_checkpoint("resume_path", tmp_path, tmp)
    c2 = Checkpointer(root)  # opening the directory for writing cleans the left-over up (before its 1st save)
    assert c2.latest_step() == 2
    c2.save(3, _state())
    c2.wait_until_finished()
    assert not os.path.exists(tmp)
    assert c2.all_steps() == [2, 3]
    c2.close()


def test_sigkill_mid_save_leaves_previous_checkpoint(tmp_path):
    root = ckpt.checkpoint_dir(tmp_path)
    code = f"""
  import asyncio, os, sys, time
  sys.path.insert(0, {os.path.join(REPO, "tests", "engine")!r})
  import orbax.checkpoint as ocp
  import jax.numpy as jnp
  from test_checkpoint import _state
  from jaxrl_post.engine.run.checkpoint import Checkpointer
  c = Checkpointer({root!r})
  c.save(1, _state()); c.wait_until_finished()
  # hold the background commit (the atomic rename) so the kill lands mid-save, deterministically
  from orbax.checkpoint._src.path import atomicity
  async def held(self):
    print('FINALIZING', self.get(), flush=True)
    await asyncio.sleep(120)
  atomicity.AtomicRenameTemporaryPath.finalize = held
  s = _state(); s['actor']['big'] = jnp.ones((256, 1024)); s['host']['global_steps'] = 2
  c.save(2, s)
  time.sleep(120)
  """
    e = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO)
    p = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=e,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        line = p.stdout.readline()
        assert line.startswith("FINALIZING"), line
        assert os.path.isdir(os.path.join(root, "global_step_2.orbax-checkpoint-tmp"))
    finally:
        os.kill(p.pid, signal.SIGKILL)
        p.wait()
    assert ckpt.list_complete_steps(root) == [1]
    assert ckpt.find_resume_checkpoint("auto", tmp_path) == (root, 1)
    c = Checkpointer(root)
    got = c.restore(like={"actor": _state()["actor"]})
    _leaves_equal(got["actor"], _state()["actor"])
    assert got["host"]["global_steps"] == 3
    c.close()


def test_disk_full_during_async_save(tmp_path):
    """A real write failure (RLIMIT_FSIZE -> EFBIG, as on a full disk) in the background write."""
    root = ckpt.checkpoint_dir(tmp_path)
    code = f"""
  import json, resource, signal, sys
  sys.path.insert(0, {os.path.join(REPO, "tests", "engine")!r})
  import jax.numpy as jnp
  from test_checkpoint import _state
  from jaxrl_post.engine.run.checkpoint import Checkpointer, CheckpointError
  c = Checkpointer({root!r}, max_to_keep=1)
  c.save(1, _state()); c.wait_until_finished()
  signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
  resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))
  s = _state(); s['actor']['big'] = jnp.arange(200000, dtype=jnp.float32)
  out = {{}}
  try:
    c.save(2, s)
    c.wait_until_finished()
    out['error'] = None
  except CheckpointError as e:
    out['error'] = str(e)
  out['steps'] = c.all_steps()
  print('RESULT' + json.dumps(out))
  """
    r = _run_py(code)
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT")]
    assert line, r.stdout + r.stderr[-3000:]
    out = json.loads(line[0][len("RESULT") :])
    assert out["error"] is not None
    assert root in out["error"] and "global_step_1 is intact" in out["error"], out["error"]
    assert out["steps"] == [1]
    assert ckpt.list_complete_steps(root) == [1]
    c = Checkpointer(root)
    _leaves_equal(c.restore(like={"actor": _state()["actor"]})["actor"], _state()["actor"])
    c.close()


def test_unwritable_dir_and_failed_save_keep_previous(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("not a dir")
    with pytest.raises(CheckpointError, match="exists and is not a directory"):
        Checkpointer(blocker)
    c = Checkpointer(blocker / "checkpoints")
    with pytest.raises(CheckpointError, match=str(blocker / "checkpoints")):
        c.save(1, _state())

    root = ckpt.checkpoint_dir(tmp_path / "run")
    c = Checkpointer(root, max_to_keep=1, async_save=False)
    c.save(1, _state())
    import orbax.checkpoint as ocp

    def enospc(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ocp.CheckpointManager, "save", enospc)
    with pytest.raises(CheckpointError, match=r"No space left.*global_step_1 is intact"):
        c.save(2, _state())
    monkeypatch.undo()
    assert c.all_steps() == [1]
    if os.geteuid() != 0:  # root ignores permission bits
        os.chmod(root, 0o555)
        try:
            with pytest.raises(CheckpointError, match=root):
                c.save(3, _state())
        finally:
            os.chmod(root, 0o755)
    c.close()


def test_host_must_be_json(tmp_path):
    c = Checkpointer(tmp_path / "c")
    s = _state()
    s["host"]["bad"] = object()
    with pytest.raises(ValueError, match="JSON"):
        c.save(1, s)
    with pytest.raises(ValueError, match="'host'"):
        c.save(1, {"actor": s["actor"]})


def test_sharded_restore_8_devices(tmp_path):
    """Saved sharded over 8 devices on one mesh, restored into another sharding (each leaf as asked)."""
    code = f"""
  import json
  import jax, jax.numpy as jnp, numpy as np
  from jax.sharding import NamedSharding, PartitionSpec as P
  from jaxrl_post.engine.run.checkpoint import Checkpointer, abstract_like
  assert jax.device_count() == 8
  m1 = jax.make_mesh((8,), ('fsdp',))
  m2 = jax.make_mesh((2, 4), ('data', 'fsdp'))
  x = jnp.arange(16 * 6, dtype=jnp.float32).reshape(16, 6)
  st = {{'w': jax.device_put(x, NamedSharding(m1, P('fsdp', None))),
         'b': jax.device_put(jnp.arange(8, dtype=jnp.bfloat16), NamedSharding(m1, P()))}}
  c = Checkpointer({str(tmp_path / "c")!r})
  c.save(1, {{'actor': st, 'host': {{}}}}); c.wait_until_finished()
  tgt = {{'w': jax.ShapeDtypeStruct((16, 6), jnp.float32, sharding=NamedSharding(m2, P('fsdp', 'data'))),
          'b': jax.ShapeDtypeStruct((8,), jnp.bfloat16, sharding=NamedSharding(m2, P('data')))}}
  got = c.restore(like={{'actor': tgt}})['actor']
  print('RESULT' + json.dumps({{
      'w_spec': list(got['w'].sharding.spec), 'b_spec': list(got['b'].sharding.spec),
      'w_mesh': dict(got['w'].sharding.mesh.shape), 'b_dtype': str(got['b'].dtype),
      'w_shard_shape': list(got['w'].addressable_shards[0].data.shape),
      'w_ok': bool((np.asarray(got['w']) == np.asarray(x)).all()),
      'b_ok': bool((np.asarray(got['b'], np.float32) == np.arange(8)).all())}}))
  c.close()
  """
    r = _run_py(code, env={"XLA_FLAGS": "--xla_force_host_platform_device_count=8 " + CHEAP_COMPILE_FLAGS})
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT")]
    assert line, r.stdout + r.stderr[-3000:]
    out = json.loads(line[0][len("RESULT") :])
    assert out["w_ok"] and out["b_ok"]
    assert out["w_mesh"] == {"data": 2, "fsdp": 4}
    assert out["w_spec"] == ["fsdp", "data"] and out["b_spec"] == ["data"]
    assert out["w_shard_shape"] == [4, 3] and out["b_dtype"] == "bfloat16"


def test_model_metadata_roundtrips_every_preset():
    from jaxrl_post.models import PRESETS

    for name, cfg in PRESETS.items():
        meta = json.loads(json.dumps(ckpt.model_metadata(cfg, "tok")))  # through JSON, as in host state
        back = ckpt.model_config_from_metadata(meta)
        assert back == cfg and hash(back) == hash(cfg), name
        assert meta["tokenizer"] == "tok"


def test_script_checkpoint_errors_say_what_to_pass(tmp_path, capsys):
    """export_hf / evaluate on a directory without checkpoints: the message names --checkpoint (the flag the
    user passed, not trainer.resume_from_path) and what to pass; evaluate fails before building a model."""
    rc = load_script("export_hf").main(["--checkpoint", str(tmp_path), "--out", str(tmp_path / "hf")])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith(f"error: --checkpoint={tmp_path}: no complete global_step_<N> checkpoint in ")
    assert "e.g. --checkpoint=runs/grpo" in err and "resume_from_path" not in err
    assert not (tmp_path / "hf").exists()

    from configs import grpo

    with pytest.raises(CheckpointError, match=r"--checkpoint=\S*nope does not exist; pass a run directory"):
        load_script("evaluate").evaluate(grpo.get_config("tiny"), str(tmp_path / "nope"), workdir=str(tmp_path / "e"))
    assert not (tmp_path / "e").exists()  # nothing built


def test_export_quantization_on_another_family_is_one_error_line(tmp_path, capsys):
    """`export_hf --quantization=mxfp4` on a dense (non-GPT-OSS) checkpoint: exit 2, one line naming the family and
    what is supported (tests/models/test_mxfp4.py exports a GPT-OSS one)."""
    ckpt = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures", "ckpt_grpo_tiny_before_regroup")
    rc = load_script("export_hf").main(["--checkpoint", ckpt, "--out", str(tmp_path / "hf"), "--quantization=mxfp4"])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error: export quantization 'mxfp4' on ") and "only 'mxfp4' on GPT-OSS" in err
    assert len(err.strip().splitlines()) == 1


def test_checkpoints_are_on_by_default():
    from configs import grpo

    c = grpo.get_config()
    assert (c.trainer.save_freq, c.trainer.max_actor_ckpt_to_keep, c.trainer.resume_mode) == (10, 2, "auto")
    assert c.trainer.total_training_steps == 30  # -> checkpoints at steps 20 and 30 stay on disk
