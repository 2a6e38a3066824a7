"""`--config.KEY=None` for the keys the config makes optional, and values of the wrong type answered by our own
one-line error (not absl's FATAL)."""

import pytest

from tests.test_user_errors import _main


def test_config_overrides_none_for_optional_keys_and_wrong_types_named():
    """`--config.KEY=None` sets None for the keys the config makes optional (an int `_opt_int(2)`, a float
    FieldReference, a string), through absl's own parse; a value of the wrong type, or None for a key that is
    not optional, is our one line naming the key and the type it takes (absl stops with a FATAL line)."""
    from absl import flags
    from ml_collections import config_flags

    from configs import grpo
    from jaxrl_post.main import OverrideValueError, apply_none_overrides, split_override_values

    cfg = grpo.get_config("tiny")
    argv = [
        "main",
        "--config=configs/grpo.py:tiny",
        "--config.trainer.max_actor_ckpt_to_keep=None",
        "--config.actor.clip_ratio_low=0.1",
        "--config.actor.clip_ratio_low=None",  # the last override of a key wins
        "--config.data.val_files=None",
        "--config.data.max_val_samples=None",
        "--config.data.max_val_samples=7",
        "--config.rollout.n",
        "8",
    ]
    rest, keys = split_override_values(argv, cfg)
    assert keys == ["trainer.max_actor_ckpt_to_keep", "actor.clip_ratio_low", "data.val_files"]
    assert rest == argv[:2] + ["--config.actor.clip_ratio_low=0.1", "--config.data.max_val_samples=7"] + [
        "--config.rollout.n=8"
    ]
    fv = flags.FlagValues()
    holder = config_flags.DEFINE_config_file("config", None, "", flag_values=fv, lock_config=True, sys_argv=rest)
    fv(rest)
    c = holder.value
    apply_none_overrides(c, keys)
    assert c.trainer.max_actor_ckpt_to_keep is None and c.actor.clip_ratio_low is None and c.data.val_files is None
    assert c.data.max_val_samples == 7 and c.rollout.n == 8
    for bad, msg in [
        ("--config.rollout.n=four", "config.rollout.n='four': expected an int (e.g. 4)"),
        ("--config.actor.optim.lr=1e-3x", "config.actor.optim.lr='1e-3x': expected a number (e.g. 0.001)"),
        ("--config.trainer.val_before_train=maybe", "config.trainer.val_before_train='maybe': expected True or False"),
        ("--config.rollout.n=None", "config.rollout.n=None: this key takes an int and cannot be None (e.g. 4)"),
    ]:
        with pytest.raises(OverrideValueError) as e:
            split_override_values(["main", "--config=configs/grpo.py:tiny", bad], cfg)
        assert str(e.value).startswith(msg), str(e.value)
    proc, secs = _main("--config=configs/grpo.py:tiny", "--config.rollout.n=four")
    assert proc.returncode == 2 and secs < 60
    assert proc.stderr.strip().splitlines() == ["error: config.rollout.n='four': expected an int (e.g. 4)"]
