"""`rl/builders.py` and start-up checks: a user's `model.arch` that makes no valid model is one ConfigError naming the
key; a `model.path` that `random_init` ignores is warned about; an unknown tool is one plain line."""

import os

import pytest

from jaxrl_post.api import load_config
from jaxrl_post.errors import ConfigError
from jaxrl_post.rl.builders import model_config_from

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _tiny(variant: str, overrides: dict):
    return load_config(os.path.join(REPO, "configs", f"grpo.py:{variant}"), overrides)


def test_moe_capacity_factor_on_a_dense_model_is_a_config_error():
    c = _tiny("tiny", {"model.arch.moe_capacity_factor": 1.0})
    with pytest.raises(ConfigError) as e:
        model_config_from(c)
    assert str(e.value) == (
        "config.model.arch on config.model.preset='smollm2_135m': moe_capacity_factor=1.0: needs an MoE model "
        "and a value > 0 (None: dropless)"
    )


def test_more_experts_per_token_than_experts_is_a_config_error():
    c = _tiny("moe_tiny", {"model.arch.num_experts_per_tok": 5})
    expected = r"^config\.model\.arch on config\.model\.preset='qwen3_30b_a3b': "
    expected += r"MoE config: need 1 <= num_experts_per_tok \(5\) <= num_experts \(4\)"
    with pytest.raises(ConfigError, match=expected):
        model_config_from(c)


def test_a_valid_arch_still_builds():
    mc = model_config_from(_tiny("moe_tiny", {"model.arch.moe_capacity_factor": 1.25}))
    assert (mc.num_experts, mc.num_experts_per_tok, mc.moe_capacity_factor) == (4, 2, 1.25)


def test_a_model_path_that_random_init_ignores_is_warned_about(caplog):
    """`model.path` set by the user while `model.random_init` builds random weights: a warning names both keys;
    the base config's own path (every tiny config keeps it) says nothing."""
    from jaxrl_post.errors import Checker
    from jaxrl_post.models.config_checks import DEFAULT_MODEL_PATH, check_model

    assert load_config(os.path.join(REPO, "configs", "grpo.py"), {}).model.path == DEFAULT_MODEL_PATH
    with caplog.at_level("WARNING"):
        check_model(Checker(_tiny("tiny", {})))
    assert "is ignored" not in caplog.text
    with caplog.at_level("WARNING"):
        check_model(Checker(_tiny("tiny", {"model.path": "/data/my_model"})))
    assert "config.model.path='/data/my_model' is ignored: config.model.random_init=True" in caplog.text


def test_an_unknown_tool_is_one_line_without_an_exception_name():
    from jaxrl_post.rl.reward_builders import build_agent_loop

    c = load_config(os.path.join(REPO, "configs", "grpo.py"), {})
    c.rollout.multi_turn.enable, c.rollout.multi_turn.tools = True, "calculater"
    with pytest.raises(ConfigError) as e:
        build_agent_loop(c, None, None)
    assert str(e.value).startswith("config.rollout.multi_turn.tools='calculater': unknown tool 'calculater'")
