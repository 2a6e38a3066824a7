"""The config sections of `rl/config_check.py`'s table: each reports its own key's problem with the message the
checks gave before they moved beside their features (the expected lines are written out by hand), says nothing
about a good config, and every key that `validate_config` checks has exactly one owning section."""

import pytest

from configs import dapo, grpo, grpo_tools, opd, ppo
from jaxrl_post.errors import Checker, ConfigError, DeviceCounts
from jaxrl_post.rl import config_check
from jaxrl_post.rl.config_check import SECTIONS, validate_config

SECTION = dict(SECTIONS)


def _set(c, key, value):
    node = c
    *parents, leaf = key.split(".")
    for p in parents:
        node = node[p]
    node[leaf] = value


_DAPO_METRICS = "['acc', 'score', 'seq_reward', 'seq_final_reward', 'overlong_reward', 'overlong']"

# section -> (config, {key: bad value}, the one line it reports)
BAD = {
    "data": (grpo, "tiny", {"data.max_prompt_length": 0}, "config.data.max_prompt_length=0: must be a positive int"),
    "rollout": (grpo, "tiny", {"rollout.top_k": 0}, "config.rollout.top_k=0: must be -1 (off) or > 0"),
    "actor": (grpo, "tiny", {"actor.ppo_epochs": 0}, "config.actor.ppo_epochs=0: must be a positive int"),
    "ref": (
        grpo,
        "tiny",
        {"ref.log_prob_micro_batch_size": 0},
        "config.ref.log_prob_micro_batch_size=0: must be a positive int",
    ),
    "trainer": (grpo, "tiny", {"trainer.save_freq": 0}, "config.trainer.save_freq=0: must be -1 (off) or > 0"),
    "trainer.mesh": (
        grpo,
        "tiny",
        {"trainer.mesh.tensor": 0},
        "config.trainer.mesh.tensor=0: must be -1 or a positive int",
    ),
    "critic": (ppo, "tiny", {"critic.cliprange_value": 0.0}, "config.critic.cliprange_value=0.0: must be > 0"),
    "batch_sizes": (
        grpo,
        "tiny",
        {"actor.ppo_mini_batch_size": 3},
        "config.actor.ppo_mini_batch_size=3: data.train_batch_size = 4 prompts per step is not divisible by "
        "actor.ppo_mini_batch_size = 3 prompts (as in verl, both count prompts; a mini-batch holds "
        "ppo_mini_batch_size * rollout.n responses)",
    ),
    "packing": (
        grpo,
        "tiny",
        {"model.seqs_per_packed_row": 0},
        "config.model.seqs_per_packed_row=0: must be a positive int",
    ),
    "model": (
        grpo,
        "tiny",
        {"model.param_dtype": "fp32"},
        "config.model.param_dtype='fp32': valid: float32, bfloat16, float16",
    ),
    "dynamic_bsz": (
        grpo,
        "tiny",
        {"rollout.log_prob_use_dynamic_bsz": True, "model.use_remove_padding": False},
        "config.rollout.log_prob_use_dynamic_bsz=True: dynamic batch size packs sequences: needs "
        "model.use_remove_padding=True",
    ),
    "algorithm": (grpo, "tiny", {"algorithm.gamma": 1.5}, "config.algorithm.gamma=1.5: must be in [0, 1]"),
    "reward_model": (grpo, "tiny", {"reward_model.timeout_s": 0.0}, "config.reward_model.timeout_s=0.0: must be > 0"),
    "algorithm.filter_groups": (
        dapo,
        "tiny",
        {"algorithm.filter_groups.metric": ""},
        f"config.algorithm.filter_groups.metric='': must name a per-response value, e.g. one of {_DAPO_METRICS}",
    ),
    "lora": (grpo, "tiny", {"model.lora_rank": -1}, "config.model.lora_rank=-1: must be an int >= 0 (0 = LoRA off)"),
    "rollout.multi_turn": (
        grpo_tools,
        "tiny",
        {"rollout.multi_turn.tool_timeout_s": 0.0},
        "config.rollout.multi_turn.tool_timeout_s=0.0: must be > 0",
    ),
    "async_training": (
        grpo,
        "async",
        {"async_training.partial_rollout_dispatches": 0},
        "config.async_training.partial_rollout_dispatches=0: must be an int >= 1",
    ),
    "placement": (grpo, "tiny", {"rollout.nnodes": 0}, "config.rollout.nnodes=0: must be an int >= 1"),
    "rollout.tensor_model_parallel_size": (
        grpo,
        "tiny",
        {"rollout.tensor_model_parallel_size": 0},
        "config.rollout.tensor_model_parallel_size=0: must be None or an int >= 1",
    ),
    "distillation": (
        opd,
        "tiny",
        {"distillation.distillation_loss.policy_loss_mode": "x"},
        "config.distillation.distillation_loss.policy_loss_mode='x': only 'vanilla' is supported (as verl)",
    ),
    "actor.router_replay": (
        grpo,
        "tiny",
        {"actor.router_replay.mode": "R1"},
        "config.actor.router_replay.mode='R1': valid: ('disabled', 'R2', 'R3')",
    ),
    "trainer.distributed": (
        grpo,
        "tiny",
        {"trainer.distributed.num_processes": 0},
        "config.trainer.distributed.num_processes must be >= 1, got 0",
    ),
    "trainer.distributed.process_local_rows": (
        grpo,
        "tiny",
        {"trainer.distributed.process_local_rows": True},
        "config.trainer.distributed.process_local_rows=True: not supported with config.model.use_remove_padding set "
        "as it is (turn one of them off; docs/multihost.md)",
    ),
}

GOOD = [(grpo, "tiny"), (grpo, "default"), (grpo, "async"), (ppo, "tiny"), (dapo, "tiny"), (opd, "tiny")]
GOOD += [(opd, "tiny_topk"), (grpo_tools, "tiny")]


def test_every_section_has_a_bad_case():
    assert sorted(BAD) == sorted(SECTION)


@pytest.mark.parametrize("name", [name for name, _ in SECTIONS])
def test_section_reports_its_own_key(name):
    mod, variant, keys, line = BAD[name]
    cfg = mod.get_config(variant)
    c = Checker(cfg, DeviceCounts(1))
    SECTION[name](c)
    assert c.errors == []  # the good config
    for key, value in keys.items():
        _set(cfg, key, value)
    c = Checker(cfg, DeviceCounts(1))
    SECTION[name](c)
    assert c.errors == [line]
    with pytest.raises(ConfigError) as e:  # and validate_config runs the section
        validate_config(cfg, n_devices=1)
    assert line in [s.strip() for s in str(e.value).splitlines()]


@pytest.mark.parametrize("mod,variant", GOOD, ids=[f"{m.__name__.split('.')[-1]}:{v}" for m, v in GOOD])
def test_sections_quiet_on_good_configs(mod, variant):
    for name, section in SECTIONS:
        c = Checker(mod.get_config(variant), DeviceCounts(1))
        section(c)
        assert c.errors == [], name


def _feature_configs():
    """Configs that turn every conditional part of the checks on (critic, DAPO, OPD, multi-turn, async + paged,
    LoRA, reward-model scoring, a judge, a remote service)."""
    out = [mod.get_config(v) for mod, v in GOOD] + [grpo.get_config("lora")]
    c = ppo.get_config("tiny")
    c.reward_model.enable = True
    c.reward_model.judge.path = "judge"
    out.append(c)
    c = grpo.get_config("tiny")
    c.reward_model.remote.url = "http://localhost:1"
    c.algorithm.use_kl_in_reward, c.algorithm.kl_ctrl.type = True, "adaptive"
    c.actor.use_dynamic_bsz = True
    out.append(c)
    return out


def test_every_checked_key_has_one_owner(monkeypatch):
    owners: dict[str, set[str]] = {}
    for cfg in _feature_configs():
        for name, section in SECTIONS:
            c = Checker(cfg, DeviceCounts(1))
            section(c)
            assert len(c.checked) == len(set(c.checked)), (name, c.checked)  # no key twice in one section
            for key in c.checked:
                owners.setdefault(key, set()).add(name)
    shared = {k: sorted(v) for k, v in owners.items() if len(v) > 1}
    assert shared == {}

    # validate_config checks exactly the keys of its sections: every key it checks on the default GRPO config has
    # its one owner above
    seen = []

    class Recording(Checker):
        def __init__(self, cfg, devices=None):
            super().__init__(cfg, devices)
            seen.append(self)

    monkeypatch.setattr(config_check, "Checker", Recording)
    validate_config(grpo.get_config(), n_devices=1)
    (c,) = seen
    assert len(c.checked) > 80 and len(c.checked) == len(set(c.checked))
    assert all(len(owners[k]) == 1 for k in c.checked), [k for k in c.checked if k not in owners]
