"""TensorBoard / W&B backends and the saved run config."""

import glob
import json
import os
import struct
import sys
import types

import ml_collections as mlc
import pytest
import yaml

from jaxrl_post.engine.run import loggers, run_files


def _read_events(logdir):
    """Scalars from tensorboard event files (TFRecord framing parsed by hand; tensorboardX protos)."""
    from tensorboardX.proto import event_pb2

    out = []
    for path in sorted(glob.glob(os.path.join(logdir, "events.out.tfevents.*"))):
        with open(path, "rb") as f:
            data = f.read()
        i = 0
        while i < len(data):
            (n,) = struct.unpack("<Q", data[i : i + 8])
            ev = event_pb2.Event.FromString(data[i + 12 : i + 12 + n])
            i += 12 + n + 4
            for v in ev.summary.value:
                out.append((ev.step, v.tag, v.simple_value))
    return out


def test_tensorboard_writes_scalars(tmp_path):
    tb = loggers.TensorBoardLogger(str(tmp_path))
    tb.log({"critic/score/mean": 0.5, "timing_s/gen": 1.25, "note": "text", "none": None}, step=1)
    tb.log({"critic/score/mean": 0.75}, step=2)
    tb.close()
    got = _read_events(os.path.join(tmp_path, "tensorboard"))
    assert sorted(got) == [(1, "critic/score/mean", 0.5), (1, "timing_s/gen", 1.25), (2, "critic/score/mean", 0.75)]


def test_wandb_missing_or_unconfigured_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import fails like an absent package
    with pytest.raises(ImportError, match="pip install wandb"):
        loggers.WandbLogger(str(tmp_path))

    calls = []
    fake = types.ModuleType("wandb")

    class _Run:
        def log(self, m, step):
            calls.append(("log", m, step))

        def finish(self):
            calls.append(("finish",))

    def init(**kw):
        calls.append(("init", kw))
        return _Run()

    fake.init = init
    monkeypatch.setitem(sys.modules, "wandb", fake)
    for k in ("WANDB_API_KEY", "WANDB_MODE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no_netrc"))
    with pytest.raises(RuntimeError, match="wandb login"):
        loggers.WandbLogger(str(tmp_path))
    monkeypatch.setenv("WANDB_MODE", "offline")
    w = loggers.WandbLogger(str(tmp_path), project="p", experiment="e", config={"a": 1})
    w.log({"x": 1, "s": "skip"}, step=3)
    w.close()
    assert calls == [
        ("init", {"project": "p", "name": "e", "dir": str(tmp_path), "config": {"a": 1}}),
        ("log", {"x": 1.0}, 3),
        ("finish",),
    ]


def test_save_run_config_json_and_yaml(tmp_path):
    c = mlc.ConfigDict()
    c.trainer = mlc.ConfigDict({"logger": ("console", "jsonl"), "save_freq": 5})
    c.model = mlc.ConfigDict({"path": "x", "tokenizer_path": mlc.FieldReference(None, field_type=str)})
    paths = run_files.save_run_config(c, str(tmp_path / "run"))
    want = {"model": {"path": "x", "tokenizer_path": None}, "trainer": {"logger": ["console", "jsonl"], "save_freq": 5}}
    with open(paths[0]) as f:
        assert json.load(f) == want
    with open(paths[1]) as f:
        assert yaml.safe_load(f) == want
    # the command line's --config.trainer.logger=console,tensorboard is stored as the list of names
    c.trainer.logger = ("console,tensorboard",)
    run_files.save_run_config(c, str(tmp_path / "run"))
    with open(paths[0]) as f:
        assert json.load(f)["trainer"]["logger"] == ["console", "tensorboard"]
    assert run_files.config_to_dict({"trainer": {"logger": "console, jsonl"}}) == {
        "trainer": {"logger": ["console", "jsonl"]}
    }
