"""The RL trainer (`trainer.RLTrainer`, verl's `fit()`): the roles it composes (`roles/`: policy, reference,
critic, teacher, rollout), the per-step update stages (`updates`), the PPO/GRPO losses on micro-batches
(`losses`), DAPO's dynamic sampling (`dynamic_sampling`), step metrics with verl's names (`metrics`),
validation (`validation`, `validation_loop`), the config checks (`config_check`: `validate_config` over the table
of per-section checks that live beside their features, plus the cross-section batch arithmetic; `config_features`:
what a config turns on; `preflight`) and the config -> objects builders (`builders`).
"""
