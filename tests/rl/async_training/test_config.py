"""`async_training.*` / `rollout.n_gpus_per_node` config checks: one ConfigError line per bad key, before anything
is built; the defaults are the synchronous loop."""

import pytest

from configs import grpo
from jaxrl_post.errors import ConfigError
from jaxrl_post.rl.async_training.settings import AsyncSettings
from jaxrl_post.rl.config_check import validate_config


def _cfg(**kw):
    c = grpo.get_config("tiny")
    c.async_training.mode = "fully_async"
    for k, v in kw.items():
        section, key = k.split("__")
        setattr(getattr(c, section), key, v)
    return c


def test_defaults_are_synchronous_and_valid():
    c = grpo.get_config("tiny")
    assert c.async_training.mode == "sync" and c.rollout.n_gpus_per_node == 0
    validate_config(c, n_devices=1)
    validate_config(grpo.get_config("async"), n_devices=1)


@pytest.mark.parametrize(
    "kw, line",
    [
        ({"async_training__mode": "overlap"}, "config.async_training.mode='overlap': valid: ['sync', 'one_step_off'"),
        ({"async_training__staleness_threshold": -1}, "config.async_training.staleness_threshold=-1: must be an int"),
        (
            {"async_training__trigger_parameter_sync_step": 3, "async_training__staleness_threshold": 1},
            "config.async_training.staleness_threshold=1: must be >= trigger_parameter_sync_step - 1",
        ),
        ({"async_training__require_batches": 3}, "config.async_training.require_batches=3: must be an int >= 1 divid"),
        (
            {"async_training__partial_rollout": True, "async_training__staleness_threshold": 1},
            "needs rollout.name='paged'",
        ),
        (
            {
                "async_training__partial_rollout": True,
                "async_training__staleness_threshold": 0,
                "rollout__name": "paged",
            },
            "(+ 1 with partial_rollout) = 1",
        ),
        ({"rollout__n_gpus_per_node": 4}, "config.rollout.n_gpus_per_node=4: must be < the run's 1 devices"),
        ({"rollout__n_gpus_per_node": -1}, "config.rollout.n_gpus_per_node=-1: must be an int >= 0 (0 = colocated)"),
    ],
)
def test_bad_async_keys_are_one_line_each(kw, line):
    with pytest.raises(ConfigError) as e:
        validate_config(_cfg(**kw), n_devices=1)
    msg = str(e.value)
    assert line in msg, msg
    assert msg.count("\n  ") == 1, msg  # exactly that key


def test_partial_rollout_with_multi_turn_is_one_line():
    c = _cfg(async_training__partial_rollout=True, async_training__staleness_threshold=1, rollout__name="paged")
    validate_config(c, n_devices=1)
    c.rollout.multi_turn.enable = True  # the paged engine runs the agent loop, which stops only between calls
    with pytest.raises(ConfigError) as e:
        validate_config(c, n_devices=1)
    msg = str(e.value)
    assert "config.async_training.partial_rollout=True: is not supported with rollout.multi_turn.enable" in msg, msg
    assert msg.count("\n  ") == 1, msg


def test_filter_groups_with_async_validates_and_reaches_the_settings():
    c = _cfg()
    c.algorithm.filter_groups.enable = True
    c.algorithm.filter_groups.metric = "acc"
    c.algorithm.filter_groups.max_num_gen_batches = 3
    validate_config(c, n_devices=1)
    s = AsyncSettings.from_config(c)
    assert (s.filter_metric, s.max_num_gen_batches) == ("acc", 3)
    c.algorithm.filter_groups.enable = False
    assert AsyncSettings.from_config(c).filter_metric is None


def test_settings_of_each_mode():
    one = AsyncSettings.from_config(_cfg(async_training__mode="one_step_off", async_training__staleness_threshold=5))
    assert (one.staleness_threshold, one.trigger_parameter_sync_step, one.ahead_chunks) == (1, 1, 1)
    full = AsyncSettings.from_config(
        _cfg(async_training__staleness_threshold=3, async_training__trigger_parameter_sync_step=2)
    )
    # groups sampled up to k - 1 = 1 step before a publication: 3 - 1 = 2 steps ahead, in batches of 4 prompts
    assert full.ahead_chunks == 2 and full.chunk_prompts == 4
    assert [full.publishes_after(t) for t in range(1, 5)] == [False, True, False, True]


@pytest.mark.parametrize(
    "kw, n_devices, line",
    [
        (
            {"rollout__n_gpus_per_node": 4},
            4,
            "config.rollout.n_gpus_per_node=4: must be < the run's 4 devices: the rest form the training mesh; on a "
            "CPU, XLA_FLAGS=--xla_force_host_platform_device_count=5 (set before the run) gives more",
        ),
        (
            {"rollout__n_gpus_per_node": 4, "trainer__mesh": {"data": 1, "fsdp": 8, "tensor": 1}},
            8,
            "config.trainer.mesh=",  # the training set of 4 devices cannot hold an 8-device mesh
        ),
        ({"rollout__n_gpus_per_node": 2, "rollout__nnodes": 2}, 4, "config.rollout.nnodes=2: must be 1"),
        ({"rollout__n_gpus_per_node": 2, "rollout__name": "paged"}, 4, "it needs rollout.n_gpus_per_node=1, not 2"),
    ],
)
def test_bad_split_placement_is_one_line_each(kw, n_devices, line):
    c = grpo.get_config("tiny")
    for k, v in kw.items():
        section, key = k.split("__")
        if isinstance(v, dict):
            getattr(c, section)[key].update(v)
        else:
            setattr(getattr(c, section), key, v)
    with pytest.raises(ConfigError) as e:
        validate_config(c, n_devices=n_devices)
    msg = str(e.value)
    assert line in msg, msg
    assert msg.count("\n  ") == 1, msg  # exactly that key


def test_split_placement_checks_the_mesh_on_the_training_devices():
    c = grpo.get_config("tiny")
    c.rollout.n_gpus_per_node = 4
    c.trainer.mesh.fsdp, c.trainer.mesh.tensor = 2, 2  # the 4 training devices; 8 would not fit it colocated
    validate_config(c, n_devices=8)
    with pytest.raises(ConfigError, match="data\\*fsdp\\*expert\\*tensor = 4 but 8 devices"):
        c.rollout.n_gpus_per_node = 0
        validate_config(c, n_devices=8)
    c.rollout.n_gpus_per_node, c.rollout.name = 1, "paged"  # the paged engine on the rollout's one device
    c.trainer.mesh.fsdp, c.trainer.mesh.tensor = -1, 1
    validate_config(c, n_devices=2)
