"""A new user's mistakes give one ConfigError naming the config key (main prints it as one `error:` line):
empty data, unknown reasoning-gym task, every prompt too long, too few prompts for a batch, a broken
custom reward file, an unwritable working directory."""

import os
import re
import sys

import pytest

from tests.script_loader import load_script

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from jaxrl_post.trainer import builders
from jaxrl_post.trainer.char_tokenizer import build_char_tokenizer
from jaxrl_post.trainer.config_check import ConfigError
from tests.test_loud_startup import _row, _unloadable_model_config, _write


def _loaders(c):
    data = builders.load_data_rows(c)
    return builders.build_dataloaders(c, data, build_char_tokenizer(), 0)


def test_empty_train_file(tmp_path):
    f = _write(tmp_path / "train.jsonl", [])
    with pytest.raises(ConfigError) as e:
        builders.load_data_rows(_unloadable_model_config(tmp_path, f))
    assert str(e.value) == (
        f"config.data.train_files={f!r}: the data has no rows (an empty file?); "
        "point data.train_files at a file with prompt rows"
    )


def test_unknown_reasoning_gym_task(tmp_path):
    c = _unloadable_model_config(tmp_path, "reasoning_gym:basic_arithmetc")
    with pytest.raises(ConfigError) as e:
        builders.load_data_rows(c)
    msg = str(e.value)
    assert msg.startswith(
        "config.data.train_files='reasoning_gym:basic_arithmetc': reasoning-gym has no task 'basic_arithmetc'; "
        "did you mean ['basic_arithmetic'"
    )
    assert "valid tasks (" in msg and "'ab'" in msg


def test_all_prompts_too_long(tmp_path):
    c = _unloadable_model_config(tmp_path, _write(tmp_path / "t.jsonl", [_row(i) for i in range(4)]))
    c.data.max_prompt_length = 5
    c.data.train_batch_size = 2
    with pytest.raises(ConfigError) as e:
        _loaders(c)
    msg = str(e.value)
    assert msg.startswith("config.data.max_prompt_length=5: all 4 prompts of config.data.train_files=")
    assert "(longest " in msg and "median " in msg and "set --config.data.max_prompt_length=" in msg


def test_train_batch_size_larger_than_data(tmp_path):
    f = _write(tmp_path / "t.jsonl", [_row(i) for i in range(3)])
    c = _unloadable_model_config(tmp_path, f)
    c.data.train_batch_size = 100
    with pytest.raises(ConfigError) as e:
        _loaders(c)
    assert str(e.value) == (
        f"config.data.train_batch_size=100: only 3 prompts of config.data.train_files={f!r} are left, fewer than "
        "one batch; set --config.data.train_batch_size=3 or less, or use more data"
    )


def test_custom_reward_file_errors_name_the_key(tmp_path):
    from jaxrl_post.trainer.trainer import RLTrainer

    c = _unloadable_model_config(tmp_path, _write(tmp_path / "t.jsonl", [_row(i) for i in range(4)]))
    bad = tmp_path / "bad.py"
    bad.write_text("def compute_score(a, b, c, d=None):\n    return 1.0 +\n")
    c.custom_reward_function.path = str(bad)
    with pytest.raises(ConfigError) as e:  # before the (unloadable) model
        RLTrainer(c)
    msg = str(e.value)
    assert msg.startswith(f"config.custom_reward_function.path={str(bad)!r}: error while importing custom reward file")
    assert "SyntaxError" in msg and "bad.py, line 2" in msg
    bad.write_text("def score(a, b, c, d=None):\n    return 1.0\n")
    c.custom_reward_function.name = "compute_scor"
    with pytest.raises(ConfigError) as e:
        RLTrainer(c)
    assert str(e.value) == (
        f"config.custom_reward_function.name='compute_scor': reward function 'compute_scor' not found in {bad}; "
        "callables defined there: ['score']"
    )


def test_custom_reward_file_is_imported_once(tmp_path):
    """The pre-flight check loads the user's reward file; the reward manager reuses that function, so code the
    file runs at import (opening files, loading a verifier) runs once."""
    c = _unloadable_model_config(tmp_path, _write(tmp_path / "t.jsonl", [_row(i) for i in range(4)]))
    log = tmp_path / "imports.log"
    reward = tmp_path / "reward.py"
    reward.write_text(
        f"with open({str(log)!r}, 'a') as f:\n    f.write('imported\\n')\n\n"
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 1.0\n"
    )
    c.custom_reward_function.path = str(reward)
    c.reward_model.num_workers = 0
    data = builders.load_data_rows(c)
    manager = builders.build_reward_manager(c, build_char_tokenizer(), data.custom_reward_fn)
    try:
        assert manager.compute_score("d", "x", "y") == 1.0
    finally:
        manager.close()
    assert log.read_text().splitlines() == ["imported"]


def test_workdir_under_a_file_or_read_only(tmp_path, monkeypatch):
    from jaxrl_post.trainer.trainer import RLTrainer

    c = _unloadable_model_config(tmp_path, _write(tmp_path / "t.jsonl", [_row(i) for i in range(4)]))
    (tmp_path / "file").write_text("x")
    c.trainer.default_local_dir = str(tmp_path / "file" / "run")
    with pytest.raises(ConfigError) as e:  # before the (unloadable) model
        RLTrainer(c)
    assert str(e.value) == (
        f"config.trainer.default_local_dir={c.trainer.default_local_dir!r}: the run's working directory is under "
        f"{tmp_path / 'file'}, which is a file, not a directory; choose another path"
    )
    # a read-only directory: root (CI) may write into it anyway, so os.access answers as for a normal user
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o555)
    real_access = os.access
    fake = lambda p, mode, **kw: False if os.path.abspath(p) == str(ro) else real_access(p, mode, **kw)
    monkeypatch.setattr(os, "access", fake)
    c.trainer.default_local_dir = str(ro / "run")
    with pytest.raises(ConfigError) as e:
        RLTrainer(c)
    assert str(e.value) == (
        f"config.trainer.default_local_dir={c.trainer.default_local_dir!r}: the run's working directory ({ro}, "
        "where it would be created) is not writable; choose a writable path "
        "(--config.trainer.default_local_dir=runs/my_run)"
    )
    assert not (ro / "run").exists()


def test_failed_start_leaves_no_empty_workdir(tmp_path):
    from jaxrl_post.data.sources import MalformedRowError
    from jaxrl_post.trainer.trainer import RLTrainer

    run = tmp_path / "run"
    c = _unloadable_model_config(tmp_path, _write(tmp_path / "t.jsonl", [_row(0), _row(1, "my/dataset")]))
    with pytest.raises(ConfigError):  # unknown data_source
        RLTrainer(c)
    c.data.train_files = _write(tmp_path / "m.jsonl", [{"prompt": "x"}])
    with pytest.raises(MalformedRowError):
        RLTrainer(c)
    c.data.train_files = _write(tmp_path / "ok.jsonl", [_row(i) for i in range(4)])
    with pytest.raises(ConfigError, match="no_such_model"):  # the model does not exist
        RLTrainer(c)
    assert not run.exists()


def test_evaluate_removes_its_temporary_workdir(tmp_path, monkeypatch):
    import tempfile

    from jaxrl_post.trainer.checkpoint import CheckpointError

    evaluate = load_script("evaluate")
    temp = tmp_path / "temp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    f = _write(tmp_path / "t.jsonl", [_row(i) for i in range(4)])
    c = _unloadable_model_config(tmp_path, f, _write(tmp_path / "v.jsonl", [_row(i) for i in range(4, 8)]))
    with pytest.raises(CheckpointError):  # before the trainer
        evaluate.evaluate(c, str(tmp_path / "no_such_run"))
    with pytest.raises(ConfigError, match="no_such_model"):  # inside the trainer, in the temp workdir
        evaluate.evaluate(c)
    assert os.listdir(temp) == []


# ----------------------------------------------------------------------------------------- one-line errors
def _main(*args, timeout=300):
    import subprocess
    import time

    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "jaxrl_post.main", *args],
        cwd=REPO,
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return proc, time.monotonic() - t0


def test_unknown_config_variant_lists_the_valid_ones(tmp_path):
    from jaxrl_post.main import ConfigFileError, check_override_keys

    with pytest.raises(ConfigFileError, match=r"^--config=configs/dapo\.py:tinyy: configs/dapo\.py: unknown variant"):
        check_override_keys(["prog", "--config=configs/dapo.py:tinyy"])
    proc, secs = _main("--config=configs/grpo.py:lroa")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [
        "error: --config=configs/grpo.py:lroa: configs/grpo.py: unknown variant 'lroa'; "
        "valid: ['default', 'gsm8k', 'lora', 'tiny']"
    ]
    assert secs < 60


@pytest.mark.slow
def test_missing_model_path_is_one_error_before_any_load(tmp_path, monkeypatch):
    from jaxrl_post.trainer.trainer import RLTrainer

    def no_load(*a, **k):
        raise AssertionError("the model loader was called")

    monkeypatch.setattr(builders, "build_actor_and_tokenizer", no_load)
    monkeypatch.setattr(builders, "build_mesh", no_load)
    c = _unloadable_model_config(tmp_path, _write(tmp_path / "t.jsonl", [_row(i) for i in range(4)]))
    with pytest.raises(ConfigError) as e:
        RLTrainer(c)
    assert str(e.value) == f"config.model.path={c.model.path!r}: no such file or directory: {c.model.path}"
    (tmp_path / "notgguf.bin").write_text("x")
    c.model.path = str(tmp_path / "notgguf.bin")
    with pytest.raises(ConfigError, match=r"notgguf\.bin is a file but not a \.gguf"):
        RLTrainer(c)
    # the main job: one `error:` line, exit 2, within seconds
    proc, secs = _main(
        "--config=configs/grpo.py:tiny",
        "--config.model.random_init=False",
        f"--config.model.path={tmp_path / 'no_such_model'}",
        f"--config.trainer.default_local_dir={tmp_path / 'run'}",
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [
        f"error: config.model.path={str(tmp_path / 'no_such_model')!r}: no such file or directory: "
        f"{tmp_path / 'no_such_model'}"
    ]
    assert secs < 60 and not (tmp_path / "run").exists()


def test_reward_model_export_as_the_policy_is_one_error_before_any_load(tmp_path, monkeypatch):
    """An exported reward model (*ForSequenceClassification: score head, no LM head) given where a generating
    model is needed: one ConfigError naming the key before any load, and the loader itself says the same."""
    from flax import nnx

    from jaxrl_post.models import get_preset, hf_io, load_pretrained
    from jaxrl_post.models.reward_model import RewardModel
    from jaxrl_post.trainer.trainer import RLTrainer

    mcfg = get_preset("smollm2_135m").replace(
        num_layers=1, hidden_size=32, intermediate_size=64, num_heads=2, num_kv_heads=1, head_dim=16, vocab_size=64
    )
    rm_dir = tmp_path / "rm_export"
    rm = RewardModel(mcfg, rngs=nnx.Rngs(0), dtype="float32", param_dtype="float32")
    hf_io.save_reward_model(rm, None, str(rm_dir), pad_token_id=0)
    with pytest.raises(ValueError, match=r"is a reward model \(config.json architectures \['LlamaForSequenceClass"):
        load_pretrained(str(rm_dir))

    def no_load(*a, **k):
        raise AssertionError("the model loader was called")

    monkeypatch.setattr(builders, "build_actor_and_tokenizer", no_load)
    monkeypatch.setattr(builders, "build_mesh", no_load)
    c = _unloadable_model_config(tmp_path, _write(tmp_path / "t.jsonl", [_row(i) for i in range(4)]))
    c.model.path = str(rm_dir)
    with pytest.raises(
        ConfigError, match=r"^config\.model\.path=.*rm_export.* is a reward model .*reward_model\.model\.path"
    ):
        RLTrainer(c)
    # the reward-model trainer may start from an exported reward model: its pre-flight accepts the directory
    import ml_collections

    from jaxrl_post.trainer import preflight

    rm_cfg = ml_collections.ConfigDict({"trainer_type": "reward_model", "model": {"random_init": False}})
    rm_cfg.model.path = str(rm_dir)
    preflight.check_model_path(rm_cfg)
    rm_cfg.trainer_type = "sft"
    with pytest.raises(ConfigError, match="is a reward model"):
        preflight.check_model_path(rm_cfg)
    # nor is it a teacher to distil from
    from configs import opd
    from jaxrl_post.trainer.roles.teacher import check_teacher_path

    oc = opd.get_config("smollm2")
    oc.distillation.teacher_models.teacher_model.model_path = str(rm_dir)
    with pytest.raises(
        ConfigError, match=r"^config\.distillation\.teacher_models\.teacher_model\.model_path=.* is a reward"
    ):
        check_teacher_path(oc)


def test_workdir_on_a_file_system_that_cannot_hold_it(tmp_path):
    from jaxrl_post.trainer.preflight import check_workdir

    c = _unloadable_model_config(tmp_path, "unused")
    c.trainer.default_local_dir = "/proc/jaxrl_post_run"
    with pytest.raises(ConfigError) as e:  # root may "write" /proc per os.access; creating a directory fails
        check_workdir(c)
    assert str(e.value) == (
        "config.trainer.default_local_dir='/proc/jaxrl_post_run': the file system at /proc cannot hold the run's "
        "working directory (creating a directory there failed: No such file or directory); choose a path on a "
        "normal disk (--config.trainer.default_local_dir=runs/my_run)"
    ) or "is not writable" in str(e.value)
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".jaxrl_post_probe_")]
    c.trainer.default_local_dir = str(tmp_path / "ok")
    check_workdir(c)  # a normal directory passes and keeps no probe
    assert os.listdir(tmp_path) == []


def test_reward_function_error_is_printed_first_and_plainly(tmp_path, monkeypatch, capsys):
    """main(): a RewardFunctionError from fit() -> `error: <message>` as the first stderr line, then the reward
    function's own traceback (its file and line, not the trainer's frames), exit 2, trainer closed."""
    from jaxrl_post import main as main_mod
    from jaxrl_post.rewards import RewardManager, load_custom_reward_fn
    from jaxrl_post.trainer import trainer as trainer_mod
    from tests.test_reward_failures import RAISING_SRC, CharTokenizer, _batch

    path = tmp_path / "my_reward.py"
    path.write_text(RAISING_SRC)
    mgr = RewardManager(load_custom_reward_fn(str(path)), CharTokenizer(), num_workers=0, timeout_s=5.0)
    closed = []

    class FakeTrainer:  # fit() scores a batch with the user's failing reward function, as train_step does
        global_steps, resumed_from = 1, None

        def __init__(self, cfg):
            pass

        def fit(self, stop=None):
            return mgr.compute(_batch(["badA", "badB"]))

        def close(self):
            closed.append(True)

    from configs import grpo

    monkeypatch.setattr(trainer_mod, "RLTrainer", FakeTrainer)
    monkeypatch.setattr(main_mod, "_CONFIG", type("F", (), {"value": grpo.get_config("tiny")})())
    monkeypatch.setattr(main_mod, "_STOP", None)
    with pytest.raises(SystemExit) as e:
        main_mod.main([])
    assert e.value.code == 2 and closed == [True]
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith(
        f"error: reward function 'compute_score' from {path} (custom_reward_function) failed on 2 of 2 responses"
    )
    assert err[0].endswith("ValueError: cannot parse 'badA'")
    assert err[1] == "the reward function's traceback:"
    tb = "\n".join(err[2:])
    assert f'File "{path}", line 4, in compute_score' in tb and f'File "{path}", line 8, in helper' in tb
    assert err[-1] == "ValueError: cannot parse 'badA'" and "jaxrl_post" not in tb
    mgr.close()


def test_config_none_override_means_none_not_the_string():
    """`--config.KEY=None` (as the docs write it) sets Python None; absl alone would set the string 'None'."""
    from configs import grpo
    from jaxrl_post.main import apply_none_overrides, none_override_keys

    argv = ["main", "--config=configs/grpo.py:tiny", "--config.data.val_files=None", "--config.rollout.n=4"]
    keys = none_override_keys(argv)
    assert keys == ["data.val_files"]
    c = grpo.get_config("tiny")
    c.lock()
    c.data.val_files = "None"  # what absl's parser leaves
    apply_none_overrides(c, keys)
    assert c.data.val_files is None


def test_corrupt_model_files_are_named(tmp_path):
    """A corrupt or truncated config.json, model.safetensors or .gguf: the pre-flight check names model.path, the
    file and what is wrong (main prints it as one `error:` line before anything is built); the loader says the
    same as a ValueError instead of json's / safetensors' / gguf's messages, which name no file."""
    import shutil

    import gguf
    import ml_collections
    import numpy as np
    from flax import nnx

    from jaxrl_post.models import get_preset, hf_io, load_pretrained
    from jaxrl_post.models.decoder import Transformer
    from jaxrl_post.trainer.preflight import check_model_path

    mcfg = get_preset("smollm2_135m").replace(
        num_layers=1, hidden_size=32, intermediate_size=64, num_heads=2, num_kv_heads=1, head_dim=16, vocab_size=64
    )
    good = tmp_path / "good"
    hf_io.save_pretrained(Transformer(mcfg, rngs=nnx.Rngs(0)), None, str(good))
    w = gguf.GGUFWriter(str(tmp_path / "good.gguf"), "llama")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    gguf_bytes = (tmp_path / "good.gguf").read_bytes()

    def hf_variant(name, file, data):
        shutil.copytree(good, tmp_path / name)
        (tmp_path / name / file).write_bytes(data)
        return tmp_path / name, tmp_path / name / file

    st = (good / "model.safetensors").read_bytes()
    cases = [
        (*hf_variant("cfg_cut", "config.json", (good / "config.json").read_bytes()[:20]), "not valid JSON (Expecting"),
        (*hf_variant("st_cut", "model.safetensors", st[: len(st) // 2]), "incomplete metadata, file not fully covered"),
        (*hf_variant("st_junk", "model.safetensors", b"\xff" * 100), "header too large"),
    ]
    for name, data, what in [
        ("magic.gguf", b"XXXX" + gguf_bytes[4:], "it starts with b'XXXX', not b'GGUF'"),
        ("cut.gguf", gguf_bytes[:-100], "the GGUF file is corrupt or truncated (188 bytes"),
    ]:
        (tmp_path / name).write_bytes(data)
        cases.append((tmp_path / name, tmp_path / name, what))
    for path, file, what in cases:
        c = ml_collections.ConfigDict({"trainer_type": "rl", "model": {"random_init": False, "path": str(path)}})
        with pytest.raises(ConfigError) as e:
            check_model_path(c)
        assert str(e.value).startswith(f"config.model.path={str(path)!r}: {file}: "), str(e.value)
        assert what in str(e.value) and "\n" not in str(e.value)
        with pytest.raises(ValueError, match=f"^{file}: .*{re.escape(what)}"):
            load_pretrained(str(path))
    c = ml_collections.ConfigDict({"trainer_type": "rl", "model": {"random_init": False, "path": str(good)}})
    check_model_path(c)  # the intact checkpoint passes


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


def test_failures_during_training_are_one_line(tmp_path, monkeypatch, capsys):
    """main() when fit() fails in a way the user can act on: a reward function returning NaN, a tool failing on
    most calls, a full disk (ENOSPC). Each is one `error:` line on stderr and exit 2, the trainer closed; the
    full disk names the file and the last intact checkpoint, removes the partial save and puts the traceback in
    <run>/error.log."""
    import errno

    import jax.numpy as jnp

    from configs import grpo
    from jaxrl_post import main as main_mod
    from jaxrl_post.rewards import RewardManager
    from jaxrl_post.rollout.tools import ToolErrorBudget
    from jaxrl_post.trainer import trainer as trainer_mod
    from jaxrl_post.trainer.checkpoint import Checkpointer
    from tests.test_reward_failures import CharTokenizer, _batch

    run_dir = tmp_path / "run"
    ckpt = Checkpointer(str(run_dir / "checkpoints"), max_to_keep=None)
    ckpt.save(1, {"host": {}, "actor": {"w": jnp.ones((4,))}})
    ckpt.wait_until_finished()
    nan_mgr = RewardManager(lambda *a: float("nan"), CharTokenizer(), num_workers=0)

    def tool_failure():
        budget = ToolErrorBudget(0.5)
        for _ in range(7):
            budget.add("error", "tool 'lookup': Error: KeyError: 'x'\n(more text)")
        budget.check()

    def disk_full():
        (run_dir / "checkpoints" / "global_step_2.orbax-checkpoint-tmp").mkdir()  # a partial save
        raise OSError(errno.ENOSPC, "No space left on device", str(run_dir / "metrics.jsonl"))

    c = grpo.get_config("tiny")
    c.trainer.default_local_dir = str(run_dir)
    monkeypatch.setattr(main_mod, "_CONFIG", type("F", (), {"value": c})())
    monkeypatch.setattr(main_mod, "_STOP", None)
    for fail, expected in [
        (
            lambda: nan_mgr.compute(_batch(["a", "b"])),
            "error: reward function test_failures_during_training_are_one_line.<locals>.<lambda> failed on 2 of 2 "
            "responses (100%, 0 timeouts; limit reward_model.max_error_fraction=0.5). First failure, row 0 "
            "(data_source='my/source'), in process: ValueError: reward nan is not a finite number",
        ),
        (
            tool_failure,
            "error: 7 of 7 tool calls failed in this step (0 timeouts; limit rollout.multi_turn.max_error_fraction=0.5)"
            ". First failure: tool 'lookup': Error: KeyError: 'x' (more text)",
        ),
        (
            disk_full,
            f"error: writing {run_dir / 'metrics.jsonl'} failed: no space left on device; the last complete "
            f"checkpoint {run_dir / 'checkpoints' / 'global_step_1'} is intact. Free disk space, then rerun the "
            f"command to resume (traceback: {run_dir / 'error.log'})",
        ),
    ]:
        closed = []

        class FakeTrainer:  # fit() fails as the real one would, from inside the step
            global_steps, resumed_from, checkpointer = 1, None, ckpt

            def __init__(self, cfg):
                pass

            def fit(self, stop=None, fail=fail):
                return fail()

            def close(self, closed=closed):
                closed.append(True)

        monkeypatch.setattr(trainer_mod, "RLTrainer", FakeTrainer)
        with pytest.raises(SystemExit) as e:
            main_mod.main([])
        assert e.value.code == 2 and closed == [True]
        assert capsys.readouterr().err.splitlines() == [expected]
    log = (run_dir / "error.log").read_text()
    assert "Traceback (most recent call last)" in log and "in disk_full" in log and "No space left" in log
    assert os.listdir(run_dir / "checkpoints") == ["global_step_1"]
    ckpt.close()
