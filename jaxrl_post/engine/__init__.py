"""What every trainer shares (the RL, SFT, DPO and reward-model trainers): the one train-state pytree
(`train_state`), where arrays live and how jitted functions are built (`placement`), the update core with its
padded and packed layouts (`update_core`, `steps`, `packed_steps`), the row packer (`packing`), the optimizer
(`steps.make_optimizer`), the non-finite guard (`nonfinite`), the host loop (`loop`), interrupts and progress,
and `run/` (run directory, lock, files, checkpoints, tracking and loggers).

`engine/` imports nothing from `rl/` or `sft/`.
"""
