"""The RL trainer (`trainer.RLTrainer`, verl's `fit()`): the roles it composes (`roles/`: policy, reference,
critic, teacher, rollout), the per-step update stages (`updates`), the PPO/GRPO losses on micro-batches
(`losses`), DAPO's dynamic sampling (`dynamic_sampling`), step metrics with verl's names (`metrics`),
validation (`validation`, `validation_loop`), the config checks (`config_check`, `config_features`,
`preflight`) and the config -> objects builders (`builders`).
"""
