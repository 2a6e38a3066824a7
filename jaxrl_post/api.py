"""The Python API: what `python -m jaxrl_post.main` and the `scripts/` do, as functions for notebooks and scripts.

    from jaxrl_post import api

    cfg = api.load_config("configs/grpo.py:gsm8k", {"trainer.total_training_steps": 20})
    result = api.train(cfg)                               # build, fit (resumes like the CLI), close
    metrics = api.evaluate(cfg, "runs/grpo_gsm8k")        # held-out metrics of the latest checkpoint
    api.export("runs/grpo_gsm8k", "exported/")            # Hugging Face directory (LoRA: merged + PEFT adapter)
    chat = api.Chat(*api.load_model("exported/")[:2], temperature=0)
    print(chat.reply("What is 17 * 23?"))

`build_trainer(cfg)` gives the trainer itself (`fit()`, `validate()`, `close()`, `global_steps`, its roles) for
step-by-step use. The config file's top-level `trainer_type` picks the trainer (`TRAINERS`).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping

from jaxrl_post.chat import Chat
from jaxrl_post.chat import load_chat_model as load_model
from jaxrl_post.config import UnknownConfigKeyError, _all_keys, _load_config_file, _suggest
from jaxrl_post.errors import ConfigError
from jaxrl_post.evaluate import evaluate
from jaxrl_post.export import export, load_actor

__all__ = ["TRAINERS", "Chat", "build_trainer", "evaluate", "export", "load_actor", "load_config", "load_model"]
__all__ += ["train", "trainer_class"]

# config.trainer_type -> "module:name" of its class or factory (imported on use: an RL job imports no other)
TRAINERS = {
    "rl": "jaxrl_post.rl.trainer:RLTrainer",
    "sft": "jaxrl_post.sft.trainer:SFTTrainer",
    "dpo": "jaxrl_post.sft.dpo:DPOTrainer",
    "reward_model": "jaxrl_post.sft.reward_model:RewardModelTrainer",
}


def load_config(spec: str, overrides: Mapping[str, object] | None = None):
    """The `ConfigDict` of a config file, as `--config=spec` and `--config.KEY=VALUE` give it on the command line.

    Args:
      spec: `path/to/config.py` or `path/to/config.py:variant` (the file's `get_config(variant)`).
      overrides: `{"actor.optim.lr": 1e-6, "rollout.n": 8}`: dotted keys, Python values (None allowed where
        the field may be None); each checked as the command line checks it.

    Raises:
      FileNotFoundError: no such config file.
      ConfigFileError: its `get_config(variant)` refused the variant.
      UnknownConfigKeyError: an override names no field (with a suggestion, verl names included).
      ConfigError: an override's value has the wrong type for its field (names the key and both types).
    """

    cfg = _load_config_file(spec)
    valid = set(_all_keys(cfg))
    for key, value in (overrides or {}).items():
        if key not in valid:
            raise UnknownConfigKeyError(f"unknown config key config.{key}{_suggest(key, valid)}")
        *path, leaf = key.split(".")
        node = cfg
        for part in path:
            node = node[part]
        if value is None:
            with node.ignore_type():
                node[leaf] = None
        else:
            try:
                node[leaf] = value
            except TypeError as e:
                raise ConfigError(f"config.{key}={value!r}: {e}") from e
    return cfg


def trainer_class(cfg) -> Callable:
    """What builds the trainer `cfg.trainer_type` names (`TRAINERS`; "rl" when the key is absent): the class
    `RLTrainer`, or the factory `SFTTrainer` / `DPOTrainer` / `RewardModelTrainer` (each a `SupervisedTrainer`
    with its task). Called as `trainer_class(cfg)(cfg)`.

    Raises:
      ConfigError: an unknown `trainer_type`.
    """

    kind = cfg.get("trainer_type", "rl")
    if kind not in TRAINERS:
        raise ConfigError(f"config.trainer_type={kind!r}: must be one of {sorted(TRAINERS)}")
    module, _, name = TRAINERS[kind].partition(":")
    return getattr(importlib.import_module(module), name)


def build_trainer(cfg):
    """The trainer for `cfg`, built (models loaded or restored, data read, nothing compiled yet); call
    `fit()`, then `close()`. Raises what the trainer raises for a bad config, data or checkpoint (ConfigError,
    MalformedRowError, CheckpointError), with a message naming the key, file or row."""
    return trainer_class(cfg)(cfg)


def train(cfg) -> dict:
    """Build the trainer for `cfg`, `fit()` it and close it (the checkpoint save finished, reward workers
    stopped, also when fit raises); returns fit's result (`{"last": metrics, "val_before": ..., ...}`).
    Resumes from the run directory as the command line does (`trainer.resume_mode`)."""
    trainer = build_trainer(cfg)
    try:
        return trainer.fit()
    finally:
        trainer.close()
