"""The RL math, as pure array functions (arrays and scalars in, arrays out; no model, no config object).

Advantage estimators (`advantages`), policy losses (`policy_losses/`, one file per family), KL penalties (`kl`),
loss aggregation (`loss_agg`), masked ops and log-prob / entropy helpers (`functional`), reward shaping,
rollout correction (`rollout_corr`: truncated importance sampling, rejection), distillation losses, and the
registries that map config names to them (`registry`: `register_adv_est`, `register_policy_loss`, ...).
`core_algos` gathers verl's `trainer/ppo/core_algos.py` names in one import path for verl readers.
"""
