"""The RL trainer: host loop (`RLTrainer`), jitted forward/update steps, config validation, metrics.

Public API (imported lazily, so `jaxrl_post.trainer.<module>` stays cheap to import):
  RLTrainer                 trainer.py: verl's fit() loop driven by a job ConfigDict
  validate_config, ConfigError   config_check.py
"""

__all__ = ["RLTrainer", "validate_config", "ConfigError"]


def __getattr__(name):
    if name == "RLTrainer":
        from jaxrl_post.trainer.trainer import RLTrainer

        return RLTrainer
    if name in ("validate_config", "ConfigError"):
        from jaxrl_post.trainer import config_check

        return getattr(config_check, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
