"""Config checks of `rollout.tensor_model_parallel_size` (one `error:` line each, naming the key): a bad value, a tp
that does not divide the rollout's devices (colocated: all of them; split: `rollout.n_gpus_per_node`) or the model's
query / kv heads (saying which); and the configs it accepts, among them the paged engine colocated or split on
several devices as devices / tp data-parallel replicas of tp devices each."""

import pytest

from configs import grpo
from jaxrl_post.errors import ConfigError
from jaxrl_post.rl.config_check import validate_config

KEY = r"config\.rollout\.tensor_model_parallel_size"


def _cfg(tp, **rollout):
    c = grpo.get_config("tiny")  # 4 heads, 2 kv heads
    c.rollout.tensor_model_parallel_size = tp
    for k, v in rollout.items():
        setattr(c.rollout, k, v)
    return c


def test_accepted():
    assert grpo.get_config("tiny").rollout.tensor_model_parallel_size is None  # default: the training layout
    validate_config(_cfg(None), n_devices=4)
    validate_config(_cfg(2), n_devices=4)
    validate_config(_cfg(1), n_devices=1)
    validate_config(_cfg(2, name="paged"), n_devices=2)  # one engine over 'tensor' = all devices
    validate_config(_cfg(2, n_gpus_per_node=2, name="paged"), n_devices=4)  # split: tensor = the rollout devices
    validate_config(_cfg(2, name="paged"), n_devices=4)  # 2 data-parallel engine replicas of 2 devices
    validate_config(_cfg(1, name="paged"), n_devices=4)  # 4 one-device replicas
    validate_config(_cfg(1, n_gpus_per_node=2, name="paged"), n_devices=4)  # split: 2 one-device replicas


@pytest.mark.parametrize(
    "tp, n_devices, rollout, msg",
    [
        (0, 4, {}, KEY + r"=0: must be None or an int >= 1"),
        (3, 6, {}, KEY + r"=3: must divide the model's num_heads=4"),
        (2, 3, {}, KEY + r"=2: must divide the rollout's 3 devices$"),
        (4, 8, {}, KEY + r"=4: must divide the model's num_kv_heads=2 \(heads are split over 'tensor'\)"),
        (2, 6, dict(n_gpus_per_node=3), KEY + r"=2: must divide the rollout's 3 devices \(rollout\.n_gpus_per_node\)"),
    ],
)
def test_refused(tp, n_devices, rollout, msg):
    with pytest.raises(ConfigError, match=msg):
        validate_config(_cfg(tp, **rollout), n_devices=n_devices)


def test_a_loaded_models_heads_are_checked_when_built():
    from jaxrl_post.models import ModelConfig
    from jaxrl_post.rl.builders import check_rollout_heads

    mc = ModelConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_layers=1, num_heads=6, num_kv_heads=2)
    check_rollout_heads(_cfg(2), mc)
    with pytest.raises(ConfigError, match=KEY + r"=3: must divide the model's num_kv_heads=2"):
        check_rollout_heads(_cfg(3), mc)


def test_an_invalid_model_arch_is_one_config_line():
    """The heads check builds the preset's ModelConfig: `ModelConfig`'s own refusal (here `moe_capacity_factor` on
    a dense preset) is one line among the config's problems, as `builders.model_config_from` words it, not a
    ValueError."""
    c = grpo.get_config("tiny")
    c.rollout.tensor_model_parallel_size = 1
    c.model.arch.moe_capacity_factor = 1.0
    with pytest.raises(ConfigError) as e:
        validate_config(c, n_devices=1)
    assert str(e.value) == (
        "invalid config:\n  config.model.arch on config.model.preset='smollm2_135m': moe_capacity_factor=1.0: needs "
        "an MoE model and a value > 0 (None: dropless)"
    )
