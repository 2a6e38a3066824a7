"""`algos/config_checks.check_algorithm`: every `actor.policy_loss.*` hyper-parameter must be a finite number (a
nan `clip_cov_lb` or an inf `ppo_kl_coef` used to pass, the loss then NaN for the whole run)."""

import pytest

from configs import grpo
from jaxrl_post.algos.config_checks import check_algorithm
from jaxrl_post.errors import Checker, DeviceCounts


@pytest.mark.parametrize("key", ["clip_cov_lb", "ppo_kl_coef"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), "1.0"])
def test_policy_loss_hyper_parameters_are_finite_numbers(key, bad):
    cfg = grpo.get_config("tiny")
    c = Checker(cfg, DeviceCounts(1))
    check_algorithm(c)
    assert c.errors == []
    with cfg.actor.policy_loss.ignore_type():
        cfg.actor.policy_loss[key] = bad
    c = Checker(cfg, DeviceCounts(1))
    check_algorithm(c)
    assert c.errors == [
        f"config.actor.policy_loss.{key}={bad!r}: must be a finite number (a policy-loss hyper-parameter)"
    ]
