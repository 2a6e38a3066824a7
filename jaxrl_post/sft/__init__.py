"""The supervised trainers on the shared engine: one `trainer.SupervisedTrainer` and three tasks, each its data, model,
layout and loss step: SFT (`sft_task.SFTTask`, `sft_step`), DPO (`dpo.DPOTask`, `dpo_step`) and reward models
(`reward_model.RewardModelTask`, `rm_step`), with TRL's formats and metric names; `batches` holds the shared data
order and batch placement. `trainer.SFTTrainer`, `dpo.DPOTrainer` and `reward_model.RewardModelTrainer` build the
trainer with their task.
"""
