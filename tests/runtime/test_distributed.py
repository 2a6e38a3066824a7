"""jaxrl_post.runtime.distributed on one process: config keys, cluster auto-detection, data shares, the gather
helper's single-process path. The 2-process runs are in test_multihost.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from jaxrl_post.runtime import distributed
from tests.data.test_data import make_dataloader, make_rows, tiny_tokenizer

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_SLURM = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID")


@pytest.fixture
def no_cluster(monkeypatch):
    for k in _SLURM + ("OMPI_MCA_orte_hnp_uri", "TPU_WORKER_HOSTNAMES", "TPU_SKIP_MDS_QUERY"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("TPU_SKIP_MDS_QUERY", "1")  # never ask a metadata server from a test


def test_no_keys_and_no_cluster_is_a_single_process_run(no_cluster):
    import jax

    assert distributed.detect_cluster() is None
    assert distributed.initialize() is False
    assert distributed.initialize(num_processes=1) is False
    assert not jax.distributed.is_initialized() and jax.process_count() == 1
    assert distributed.is_main()


def test_slurm_is_detected(no_cluster, monkeypatch):
    for k, v in zip(_SLURM, ("7", "node[1-2]", "2", "0", "0")):
        monkeypatch.setenv(k, v)
    assert distributed.detect_cluster() == "SlurmCluster"
    distributed.check_keys(None, None, None)  # all None: auto-detected, nothing to check
    distributed.check_keys(None, 2, None)  # a partial set is fine when the cluster fills the rest


@pytest.mark.parametrize(
    "keys, words",
    [
        (("localhost:1234", 2, None), ["together", "process_id=None"]),
        (("localhost:1234", 2, 2), ["process_id=2", "< num_processes=2"]),
        (("localhost", 2, 0), ["'host:port'", "'localhost'"]),
        ((None, 0, None), ["num_processes must be >= 1"]),
        ((None, None, -1), ["process_id must be >= 0"]),
    ],
)
def test_bad_keys_are_named(no_cluster, keys, words):
    with pytest.raises(distributed.DistributedConfigError) as e:
        distributed.initialize(*keys)
    for w in words:
        assert w in str(e.value)


def test_config_check_names_the_distributed_keys(no_cluster):
    from configs import grpo
    from jaxrl_post.errors import ConfigError
    from jaxrl_post.rl.config_check import validate_config

    c = grpo.get_config("tiny")
    c.trainer.distributed.num_processes = 2
    c.trainer.distributed.process_id = 3
    with pytest.raises(ConfigError) as e:
        validate_config(c, n_devices=1)
    assert "config.trainer.distributed" in str(e.value) and "process_id=3" in str(e.value)


def test_cli_refuses_a_partial_key_set_before_starting_jax(no_cluster, tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    cmd = [sys.executable, "-m", "jaxrl_post.main", "--config=configs/grpo.py:tiny"]
    cmd += ["--config.trainer.distributed.num_processes=2", f"--config.trainer.default_local_dir={tmp_path}"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "config.trainer.distributed" in proc.stderr and "together" in proc.stderr


def test_process_shares_rebuild_the_global_batch_across_resume():
    """Two 'processes' (loader shares [0, 2) and [2, 4)) give exactly the global batches, resumed too."""
    tok = tiny_tokenizer()
    rows = make_rows([(i * 7) % 5 + 1 for i in range(23)])
    kw = dict(batch_size=4, max_prompt_length=10, seed=11, num_epochs=None)
    full = make_dataloader(rows, tok, **kw)
    shares = [make_dataloader(rows, tok, **kw) for _ in range(2)]
    shares[0].shard(0, 2)
    shares[1].shard(2, 4)
    for _ in range(3):
        next(full), [next(s) for s in shares]
    state = json.loads(json.dumps(shares[0].get_state()))
    assert state == full.get_state()  # the position is global: the same on every process
    resumed = [make_dataloader(rows, tok, **kw) for _ in range(2)]
    for r, (lo, hi) in zip(resumed, ((0, 2), (2, 4))):
        r.shard(lo, hi)
        r.set_state(state)
    for _ in range(4):  # crosses the epoch boundary (5 batches per epoch)
        want, parts = next(full), [next(r) for r in resumed]
        assert [len(p) for p in parts] == [2, 2]
        np.testing.assert_array_equal(
            np.concatenate([p.batch["input_ids"] for p in parts]), np.asarray(want.batch["input_ids"])
        )
        for key in ("uid", "index", "ground_truth"):
            assert list(np.concatenate([p.non_tensor_batch[key] for p in parts])) == list(want.non_tensor_batch[key])
    with pytest.raises(ValueError, match="not inside a batch of 4"):
        full.shard(2, 5)


def test_single_process_helpers_are_identities():
    import jax

    from jaxrl_post.runtime.sharding import make_mesh

    mesh = make_mesh(1, -1, 1)
    assert distributed.local_rows(mesh, 8) == slice(0, 8)
    tree = {"a": np.arange(4), "o": np.array(["x", "y"], object)}
    assert distributed.gather_rows(tree) is tree
    x = jax.numpy.arange(6.0)
    np.testing.assert_array_equal(distributed.to_host(x), np.arange(6.0))
    np.testing.assert_array_equal(
        distributed.local_part(distributed.global_from_local(np.arange(4.0), mesh)), [0, 1, 2, 3]
    )


def test_reward_failure_is_raised_on_every_process_path():
    from jaxrl_post.rewards.manager import RewardFunctionError
    from jaxrl_post.rl.dynamic_sampling import score_everywhere

    class Fails:
        def compute(self, data):
            raise RewardFunctionError("boom")

    class Ok:
        def compute(self, data):
            return "scored"

    for local in (False, True):  # one process: the flag gather is an identity
        assert score_everywhere(Ok(), None, local) == "scored"
        with pytest.raises(RewardFunctionError, match="boom"):
            score_everywhere(Fails(), None, local)
