"""Failures are loud at start-up: no --config, bad data rows and unknown data sources before the model
loads, train == val files, logger syntax, start-up log noise; and validation shows a progress bar."""

import json
import logging
import os
import subprocess
import sys
import textwrap

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from configs import grpo
from jaxrl_post.data.sources import MalformedRowError, load_rows
from jaxrl_post.errors import ConfigError
from jaxrl_post.rl.config_check import validate_config


def _row(i, data_source="openai/gsm8k"):
    return {
        "data_source": data_source,
        "prompt": [{"role": "user", "content": f"What is {i} + 1?"}],
        "reward_model": {"style": "rule", "ground_truth": str(i + 1)},
    }


def _write(path, lines):
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return str(path)


def _unloadable_model_config(tmp_path, train, val=None):
    """Tiny config whose model cannot load: any error about the data proves the data was checked first."""
    c = grpo.get_config("tiny")
    c.trainer.default_local_dir = str(tmp_path / "run")
    c.model.random_init = False
    c.model.path = str(tmp_path / "no_such_model")
    c.data.train_files = train
    c.data.val_files = val
    c.custom_reward_function.path = None
    return c


# ----------------------------------------------------------------------------------------- main
def test_main_without_config_prints_usage():
    for extra in ([], ["--config.trainer.seed=3"]):
        proc = subprocess.run(
            [sys.executable, "-m", "jaxrl_post.main", *extra], cwd=REPO, capture_output=True, text=True, timeout=120
        )
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert proc.stderr.splitlines() == [
            "usage: python -m jaxrl_post.main --config=configs/grpo.py[:variant] [--config.key=value ...]",
            "error: --config is required",
        ]
    from jaxrl_post.config import has_config_flag

    assert has_config_flag(["p", "--config=configs/grpo.py"]) and has_config_flag(["p", "--config", "x.py"])
    assert has_config_flag(["p", "--helpfull"]) and not has_config_flag(["p", "--config.a=1", "--configx=2"])


# ----------------------------------------------------------------------------------------- data before model
def test_malformed_row_reported_before_model_load(tmp_path):
    from jaxrl_post.rl.trainer import RLTrainer

    bad = {**_row(2), "reward_model": {"style": "rule"}}
    train = _write(tmp_path / "train.jsonl", [_row(0), _row(1), bad, _row(3)])
    with pytest.raises(MalformedRowError) as e:
        RLTrainer(_unloadable_model_config(tmp_path, train))
    assert str(e.value) == (
        f"{train}, row 2 (line 3): malformed row: missing 'reward_model.ground_truth'. Fix the row, or skip and "
        "count malformed rows with skip_malformed=True (--config.data.skip_malformed=True)."
    )
    # with data.skip_malformed the row is skipped and counted in the data stats (logged at step 0)
    from jaxrl_post.rl.data_rows import load_data_rows

    c = _unloadable_model_config(tmp_path, train)
    c.data.skip_malformed = True
    data = load_data_rows(c)
    assert len(data.train) == 3 and data.stats["data/num_skipped_malformed"] == 1
    assert data.train.where == [f"{train}, row {i} (line {i + 1})" for i in (0, 1, 3)]
    # the pipeline names a row's file and row too (an overlong prompt, truncation='error')
    from jaxrl_post.data.pipeline import make_dataloader
    from jaxrl_post.models.char_tokenizer import build_char_tokenizer

    rows = load_rows(_write(tmp_path / "long.jsonl", [_row(0), {**_row(1), "prompt": "x" * 300}]))
    with pytest.raises(MalformedRowError, match=r"long\.jsonl, row 1 \(line 2\) \(data_source='openai/gsm8k'\) has"):
        make_dataloader(
            rows, build_char_tokenizer(), batch_size=1, max_prompt_length=100, filter_overlong_prompts=False
        )


def test_unknown_data_source_reported_before_model_load(tmp_path):
    from jaxrl_post.rl.trainer import RLTrainer

    train = _write(tmp_path / "train.jsonl", [_row(0), _row(1, "my/dataset"), _row(2)])
    with pytest.raises(ConfigError) as e:
        RLTrainer(_unloadable_model_config(tmp_path, train))
    msg = str(e.value)
    assert msg.startswith(f"config.data.train_files={train!r}: No reward function for data_source='my/dataset'.")
    assert "Known data sources: ['openai/gsm8k', 'gsm8k', 'lighteval/MATH'" in msg and "reasoning_gym/<task>" in msg
    assert "custom_reward_function.path" in msg


def test_identical_train_and_val_files(tmp_path, caplog):
    from jaxrl_post.rl.data_rows import load_data_rows

    f = _write(tmp_path / "data.jsonl", [_row(i) for i in range(4)])
    c = _unloadable_model_config(tmp_path, f, f)
    with pytest.raises(ConfigError) as e:  # validation on: a "held-out" set of training prompts is refused
        load_data_rows(c)
    msg = str(e.value)
    assert f"config.data.val_files={f!r}: all 4 validation prompts also occur in config.data.train_files" in msg
    assert "memorisation" in msg and "trainer.val_before_train=False, trainer.val_at_end=False" in msg
    c.trainer.val_before_train = False
    with pytest.raises(ConfigError):  # still on at the end
        load_data_rows(c)
    c.trainer.val_at_end = False
    c.trainer.test_freq = 2
    with pytest.raises(ConfigError):  # still on every 2 steps
        load_data_rows(c)
    c.trainer.test_freq = -1  # validation off: allowed, the set is dropped with a warning
    with caplog.at_level(logging.WARNING):
        data = load_data_rows(c)
    assert data.val is None and len(data.train) == 4 and data.stats["data/val_dropped_seen_in_train"] == 4
    assert "validation is off, so the validation set is dropped" in caplog.text


# ----------------------------------------------------------------------------------------- loggers, noise
def test_logger_syntax():
    from jaxrl_post.engine.run.tracking import Tracking, parse_logger_names

    for value in (
        "console,tensorboard",
        ("console,tensorboard",),
        ("console", "tensorboard"),
        "[console, tensorboard]",
    ):
        assert parse_logger_names(value) == ("console", "tensorboard"), value
    assert parse_logger_names("") == () and parse_logger_names(("jsonl",)) == ("jsonl",)
    c = grpo.get_config("tiny")
    c.trainer.logger = ("console,tensorboard",)  # what --config.trainer.logger=console,tensorboard gives
    validate_config(c, n_devices=1)
    c.trainer.logger = ("console,tensorbord",)
    with pytest.raises(ConfigError) as e:
        validate_config(c, n_devices=1)
    want = (
        "config.trainer.logger=('console,tensorbord',): unknown logger(s) ['tensorbord']; valid names: console, jsonl, "
        "tensorboard, wandb (jsonl is always on); syntax: --config.trainer.logger=console,tensorboard or "
        "--config.trainer.logger=\"('console','tensorboard')\""
    )
    assert want in str(e.value)
    with pytest.raises(ValueError, match=r"trainer\.logger: unknown logger\(s\) \['x'\]; valid names"):
        Tracking("/nonexistent/never/created", ("console", "x"))


def test_main_startup_has_no_backend_probe_noise():
    """JAX_PLATFORMS unset: jax probes for a TPU (INFO 'Unable to initialize backend') before the config
    error; that line stays off the console, the error does not."""
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    cmd = [sys.executable, "-m", "jaxrl_post.main", "--config=configs/grpo.py:tiny", "--config.rollout.top_p=0.0"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr == "error: invalid config:\n  config.rollout.top_p=0.0: must be in (0, 1]\n"


def test_startup_noise_filtered_but_warnings_kept():
    from jaxrl_post.runtime.log_noise import quiet_startup_noise

    quiet_startup_noise()
    quiet_startup_noise()  # idempotent

    def passes(name, level, msg):
        logger = logging.getLogger(name)
        return all(f.filter(logging.LogRecord(name, level, "x.py", 1, msg, (), None)) for f in logger.filters)

    xb = "jax._src.xla_bridge"
    assert not passes(xb, logging.INFO, "Unable to initialize backend 'tpu': INTERNAL: Failed to open libtpu.so")
    assert passes(xb, logging.WARNING, "Unable to initialize backend 'cuda': something real")
    assert passes(xb, logging.INFO, "other jax info")
    assert not passes("tensorboardX.summary", logging.INFO, "Summary name a@1 is illegal; using a_1 instead.")
    assert passes("tensorboardX.summary", logging.ERROR, "Summary name x: real error")
    mpl = "matplotlib.font_manager"
    assert not passes(mpl, logging.WARNING, "Matplotlib is building the font cache; this may take a moment.")
    assert passes(mpl, logging.WARNING, "findfont: Font family 'x' not found.")


# ----------------------------------------------------------------------------------------- tiny trainer
REWARD_SRC = textwrap.dedent(
    """
    import os

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        if os.environ.get("JAXRL_TEST_REWARD_RAISES"):
            raise RuntimeError("reward backend unavailable")
        return float(len(solution_str) % 3 == 0)
    """
)


def test_validation_progress_bar_and_failing_reward_stops_the_run(tmp_path, capsys, monkeypatch):
    from jaxrl_post.rewards import RewardFunctionError
    from jaxrl_post.rl.trainer import RLTrainer

    reward = tmp_path / "flaky_reward.py"
    reward.write_text(REWARD_SRC)
    c = grpo.get_config("tiny")
    c.trainer.default_local_dir = str(tmp_path / "run")
    c.trainer.progress_bar = True
    c.custom_reward_function.path = str(reward)
    trainer = RLTrainer(c, console_write=lambda line: None)
    try:
        capsys.readouterr()
        metrics = trainer.validate()
        err = capsys.readouterr().err
        assert metrics["val-aux/reasoning_gym/basic_arithmetic/num_samples"] == 16
        for shown in ("validation:   0%", "0/16 [", "16/16 [", "prompt/s"):
            assert shown in err, err
        # a reward function that raises on every call stops the run, loudly (train_step scores with the
        # same RewardManager.compute; validating again reuses the compiled generate)
        monkeypatch.setenv("JAXRL_TEST_REWARD_RAISES", "1")
        with pytest.raises(RewardFunctionError) as e:
            trainer.validate()
        msg = str(e.value)
        assert f"reward function 'compute_score' from {reward} (custom_reward_function) failed on 16 of 16" in msg
        assert "data_source='reasoning_gym/basic_arithmetic'" in msg and "reward backend unavailable" in msg
    finally:
        trainer.close()
