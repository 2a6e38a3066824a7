"""`rollout/config_checks.check_rollout`: validation's sampling keys (`rollout.val_kwargs.*`) are checked as the
training rollout's are, when validation samples (a negative temperature used to reach `SamplingParams` at the
first validation, after the compiles, as a traceback; a top_p of 5 silently meant no top-p)."""

import pytest

from configs import grpo
from jaxrl_post.errors import Checker, DeviceCounts
from jaxrl_post.rollout.config_checks import check_rollout


def _errors(**val_kwargs):
    cfg = grpo.get_config("tiny")
    for key, value in val_kwargs.items():
        cfg.rollout.val_kwargs[key] = value
    c = Checker(cfg, DeviceCounts(1))
    check_rollout(c)
    return c.errors


@pytest.mark.parametrize(
    "key, value, line",
    [
        (
            "temperature",
            -1.0,
            "config.rollout.val_kwargs.temperature=-1.0: must be > 0 when rollout.val_kwargs.do_sample",
        ),
        (
            "temperature",
            0.0,
            "config.rollout.val_kwargs.temperature=0.0: must be > 0 when rollout.val_kwargs.do_sample",
        ),
        ("top_p", 5.0, "config.rollout.val_kwargs.top_p=5.0: must be in (0, 1]"),
        ("top_k", 0, "config.rollout.val_kwargs.top_k=0: must be -1 (off) or > 0"),
    ],
)
def test_sampled_validation_keys_are_checked(key, value, line):
    good = {"do_sample": True, "temperature": 1.0, "top_p": 1.0, "top_k": -1}
    assert _errors(**good) == []
    assert _errors(**{**good, key: value}) == [line]


def test_greedy_validation_reads_no_sampling_key():
    # the defaults: do_sample False, temperature 0.0 (greedy); a top_p there is never read
    assert _errors(do_sample=False, temperature=0.0, top_p=5.0) == []
