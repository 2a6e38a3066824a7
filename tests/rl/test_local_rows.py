"""`trainer.distributed.process_local_rows` (rl/local_rows.py): the settings it refuses, one line each, and that a
single-process run never takes its path (the 2-process runs: tests/e2e/test_multihost.py)."""

from __future__ import annotations

import numpy as np
import pytest

from configs import grpo
from jaxrl_post.errors import ConfigError
from jaxrl_post.rl import local_rows
from jaxrl_post.rl.config_check import validate_config


def _cfg(**over):
    c = grpo.get_config("tiny")
    c.trainer.distributed.process_local_rows = True
    c.model.use_remove_padding = False
    for k, v in over.items():
        node = c
        *head, last = k.split(".")
        for h in head:
            node = node[h]
        node[last] = v
    return c


def test_padded_grpo_is_accepted_and_one_process_keeps_the_gathered_path():
    c = _cfg()
    validate_config(c)
    assert local_rows.requested(c) and not local_rows.enabled(c)  # one process: nothing changes


@pytest.mark.parametrize(
    "key, value",
    [
        ("model.use_remove_padding", True),
        ("algorithm.filter_groups.enable", True),
        ("trainer.rollout_data_dir", "/tmp/x"),
        ("algorithm.rollout_correction.rollout_is", "token"),
    ],
)
def test_unsupported_settings_are_named(key, value):
    with pytest.raises(ConfigError) as e:
        validate_config(_cfg(**{key: value}))
    lines = [line for line in str(e.value).splitlines() if "process_local_rows" in line]
    assert len(lines) == 1 and f"config.{key}" in lines[0]


def test_off_by_default_and_no_errors_when_off():
    c = grpo.get_config("tiny")
    assert c.trainer.distributed.process_local_rows is False
    assert local_rows.config_errors(c) == []


def test_group_index_is_per_process_and_keeps_groups():
    uids = np.asarray(["b", "a", "b", "c", "a"], dtype=object)
    idx = local_rows.group_index(uids, 5)
    assert idx.dtype == np.int32 and list(idx) == [1, 0, 1, 2, 0]  # process 0: no offset
