"""The supervised trainers on the shared engine: SFT (`trainer.SFTTrainer`, `sft_step`), DPO (`dpo.DPOTrainer`,
`dpo_step`) and reward models (`reward_model.RewardModelTrainer`, `rm_step`), with TRL's formats and metric
names.
"""
