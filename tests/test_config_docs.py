"""docs/config.md is generated from configs/base.py (scripts/gen_config_docs.py): up to date, every key has a
meaning, verl-named keys map to existing keys, and the parser reads inline, multi-line, block and helper
comments."""

import os
import sys

import pytest

from tests.script_loader import load_script

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from configs import base

gen = load_script("gen_config_docs")


def _leaves(cfg, prefix=""):
    out = []
    for k, v in cfg.items():
        out += _leaves(v, f"{prefix}{k}.") if hasattr(v, "items") else [f"{prefix}{k}"]
    return out


def test_docs_config_md_is_up_to_date():
    with open(gen.DOC_PATH, encoding="utf-8") as f:
        current = f.read()
    assert current == gen.render(), "docs/config.md is stale: regenerate it with `python scripts/gen_config_docs.py`"


def test_every_key_has_a_meaning_and_a_row():
    rows, _ = gen.collect()
    assert gen.missing_meanings(rows) == [], "add an inline `# meaning` comment to these keys in configs/base.py"
    keys = [r.key for r in rows if not r.key.endswith(".*")]
    assert sorted(keys) == sorted(_leaves(base.get_base_config()))
    assert len(keys) == len(set(keys))


def test_verl_keys_exist_and_map_to_verl_names():
    leaves = set(_leaves(base.get_base_config()))
    assert set(base.VERL_KEYS) <= leaves, set(base.VERL_KEYS) - leaves
    assert base.verl_key("actor.ppo_mini_batch_size") == "actor_rollout_ref.actor.ppo_mini_batch_size"
    assert base.verl_key("rollout.val_kwargs.n") == "actor_rollout_ref.rollout.val_kwargs.n"
    assert base.verl_key("critic.ppo_mini_batch_size") == "critic.ppo_mini_batch_size"
    assert base.verl_key("algorithm.kl_ctrl.horizon") == "algorithm.kl_ctrl.horizon"
    assert base.verl_key("trainer.mesh.fsdp") is None  # ours


def test_rows_carry_defaults_sections_verl_names_and_comments():
    rows = {r.key: r for r in gen.collect()[0]}
    r = rows["actor.ppo_mini_batch_size"]
    assert (r.default, r.section, r.verl) == ("4", "actor", "actor_rollout_ref.actor.ppo_mini_batch_size")
    assert r.meaning.startswith("prompts per optimizer step, global")
    # a comment inside a parenthesised multi-line statement
    assert rows["actor.loss_agg_mode"].meaning.startswith("token-mean | seq-mean-token-sum")
    # keys built by a helper (`_optim`) take the helper's comments, the section of the assignment
    assert rows["actor.optim.lr"].meaning == rows["critic.optim.lr"].meaning == "peak learning rate (AdamW)"
    assert rows["critic.optim.eps"].section.startswith("critic") and rows["critic.optim.eps"].verl is None
    # optional fields show their type; tuples render as Python literals
    assert rows["model.tokenizer_path"].default == "None (str)"
    assert rows["trainer.logger"].default == '("console", "jsonl")'
    # the comment block directly above a statement follows its inline comment
    assert rows["data.train_files"].meaning.startswith("training prompts. Data specs (")
    text = gen.render()
    assert "| `actor.use_kl_loss` | `False` | `actor_rollout_ref.actor.use_kl_loss` |" in text
    assert "KL(actor \\|\\| ref)" in text  # pipes escaped inside table cells


def test_generator_handles_new_keys_and_names_uncommented_ones(tmp_path):
    with open(gen.BASE_PY, encoding="utf-8") as f:
        src = f.read()
    anchor = "    c.reward_model.timeout_s = 10.0"
    assert anchor in src
    src = src.replace(
        anchor,
        "    c.reward_model.example_new_key = 0.25  # an example key added by this test\n"
        "    c.reward_model.undocumented = 3\n" + anchor,
    )
    path = tmp_path / "base.py"
    path.write_text(src)
    rows = {r.key: r for r in gen.collect(str(path))[0]}
    new = rows["reward_model.example_new_key"]
    assert (new.default, new.section, new.verl) == ("0.25", "rewards", None)
    assert new.meaning == "an example key added by this test"
    assert gen.missing_meanings(list(rows.values())) == ["reward_model.undocumented"]
    with pytest.raises(ValueError, match=r"reward_model\.undocumented"):
        gen.render(str(path))
