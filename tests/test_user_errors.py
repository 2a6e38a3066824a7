"""A new user's mistakes give one ConfigError naming the config key (main prints it as one `error:` line):
empty data, unknown reasoning-gym task, every prompt too long, too few prompts for a batch, a broken
custom reward file, an unwritable working directory."""

import os
import sys

import pytest

from tests.script_loader import load_script

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from jaxrl_post.errors import ConfigError
from jaxrl_post.models.char_tokenizer import build_char_tokenizer
from jaxrl_post.rl import builders, data_rows, reward_builders
from tests.test_loud_startup import _row, _unloadable_model_config, _write


def _loaders(c):
    data = data_rows.load_data_rows(c)
    return data_rows.build_dataloaders(c, data, build_char_tokenizer(), 0)


def test_empty_train_file(tmp_path):
    f = _write(tmp_path / "train.jsonl", [])
    with pytest.raises(ConfigError) as e:
        data_rows.load_data_rows(_unloadable_model_config(tmp_path, f))
    assert str(e.value) == (
        f"config.data.train_files={f!r}: the data has no rows (an empty file?); "
        "point data.train_files at a file with prompt rows"
    )


def test_unknown_reasoning_gym_task(tmp_path):
    c = _unloadable_model_config(tmp_path, "reasoning_gym:basic_arithmetc")
    with pytest.raises(ConfigError) as e:
        data_rows.load_data_rows(c)
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
    from jaxrl_post.rl.trainer import RLTrainer

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
    data = data_rows.load_data_rows(c)
    manager = reward_builders.build_reward_manager(c, build_char_tokenizer(), data.custom_reward_fn)
    try:
        assert manager.compute_score("d", "x", "y") == 1.0
    finally:
        manager.close()
    assert log.read_text().splitlines() == ["imported"]


def test_workdir_under_a_file_or_read_only(tmp_path, monkeypatch):
    from jaxrl_post.rl.trainer import RLTrainer

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
    from jaxrl_post.rl.trainer import RLTrainer

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

    from jaxrl_post.engine.run.checkpoint import CheckpointError

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
    from jaxrl_post.config import ConfigFileError, check_override_keys

    with pytest.raises(ConfigFileError, match=r"^--config=configs/dapo\.py:tinyy: configs/dapo\.py: unknown variant"):
        check_override_keys(["prog", "--config=configs/dapo.py:tinyy"])
    proc, secs = _main("--config=configs/grpo.py:lroa")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [
        "error: --config=configs/grpo.py:lroa: configs/grpo.py: unknown variant 'lroa'; "
        "valid: ['async', 'default', 'gpt_oss_tiny', 'gsm8k', 'lora', 'mixtral_tiny', 'moe_tiny', 'qwen2_moe_tiny', "
        "'tiny']"
    ]
    assert secs < 60


@pytest.mark.slow
def test_missing_model_path_is_one_error_before_any_load(tmp_path, monkeypatch):
    from jaxrl_post.rl.trainer import RLTrainer

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
    from jaxrl_post.rl.trainer import RLTrainer

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

    from jaxrl_post.rl import preflight

    rm_cfg = ml_collections.ConfigDict({"trainer_type": "reward_model", "model": {"random_init": False}})
    rm_cfg.model.path = str(rm_dir)
    preflight.check_model_path(rm_cfg)
    rm_cfg.trainer_type = "sft"
    with pytest.raises(ConfigError, match="is a reward model"):
        preflight.check_model_path(rm_cfg)
    # nor is it a teacher to distil from
    from configs import opd
    from jaxrl_post.rl.roles.teacher import check_teacher_path

    oc = opd.get_config("smollm2")
    oc.distillation.teacher_models.teacher_model.model_path = str(rm_dir)
    with pytest.raises(
        ConfigError, match=r"^config\.distillation\.teacher_models\.teacher_model\.model_path=.* is a reward"
    ):
        check_teacher_path(oc)


def test_workdir_on_a_file_system_that_cannot_hold_it(tmp_path):
    from jaxrl_post.rl.preflight import check_workdir

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
    from jaxrl_post.rl import trainer as trainer_mod
    from tests.rewards.test_reward_failures import RAISING_SRC, CharTokenizer, _batch

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
    from jaxrl_post.config import apply_none_overrides, none_override_keys

    argv = ["main", "--config=configs/grpo.py:tiny", "--config.data.val_files=None", "--config.rollout.n=4"]
    keys = none_override_keys(argv)
    assert keys == ["data.val_files"]
    c = grpo.get_config("tiny")
    c.lock()
    c.data.val_files = "None"  # what absl's parser leaves
    apply_none_overrides(c, keys)
    assert c.data.val_files is None
