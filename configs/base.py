"""Shared base config for every jaxrl_post job (GRPO, PPO, ...).

Key names follow verl's `ppo_trainer.yaml` where verl has one (with `actor_rollout_ref.*` flattened to
`model.*`, `actor.*`, `rollout.*`, `ref.*`). Batch sizes are *global* (summed over all devices), counted
in prompts for `data.*` and in responses for `actor.*`/`critic.*`, as verl does after `rollout.n`.

`configs/grpo.py` and `configs/ppo.py` start from `get_base_config()` and change what they need.
Only `jaxrl_post/main.py` and `jaxrl_post/trainer/` read this ConfigDict.
"""

import ml_collections as mlc


def _opt_str(default=None):
    """An optional string field that can still be overridden from the command line."""
    return mlc.FieldReference(default, field_type=str)


def _opt_int(default=None):
    """An optional int field that can still be overridden from the command line."""
    return mlc.FieldReference(default, field_type=int)


def _optim(lr: float) -> mlc.ConfigDict:
    o = mlc.ConfigDict()
    o.lr = lr  # peak learning rate (AdamW)
    o.lr_warmup_steps = -1  # linear warmup steps; -1 -> use lr_warmup_steps_ratio * total steps
    o.lr_warmup_steps_ratio = 0.0  # warmup as a fraction of total training steps
    o.warmup_style = "constant"  # schedule after warmup: 'constant' or 'cosine'
    o.min_lr_ratio = 0.0  # cosine: final lr = min_lr_ratio * lr
    o.weight_decay = 0.01  # AdamW decoupled weight decay
    o.betas = (0.9, 0.999)  # AdamW (b1, b2)
    o.eps = 1e-8  # AdamW epsilon
    return o


def get_base_config() -> mlc.ConfigDict:
    """Returns the base ConfigDict (a GRPO-shaped default on SmolLM2-135M-Instruct)."""
    c = mlc.ConfigDict()

    # ---------------------------------------------------------------- model
    c.model = mlc.ConfigDict()
    c.model.path = "smollm2-135m-instruct"  # HF dir / .gguf / alias; ignored when random_init
    c.model.tokenizer_path = _opt_str()  # tokenizer source; None -> model.path
    c.model.dtype = "float32"  # compute/param dtype of actor, reference and critic
    c.model.remat = False  # rematerialise decoder blocks in the backward pass
    c.model.random_init = False  # True: random weights from `model.preset` + `model.arch` (tests)
    c.model.preset = "smollm2_135m"  # jaxrl_post.models.PRESETS key used when random_init
    c.model.arch = mlc.ConfigDict()  # ModelConfig field overrides applied to the preset (random_init)
    c.model.arch.hidden_size = _opt_int()
    c.model.arch.intermediate_size = _opt_int()
    c.model.arch.num_layers = _opt_int()
    c.model.arch.num_heads = _opt_int()
    c.model.arch.num_kv_heads = _opt_int()
    c.model.arch.head_dim = _opt_int()
    c.model.arch.vocab_size = _opt_int()

    # ---------------------------------------------------------------- data
    c.data = mlc.ConfigDict()
    # Data specs (jaxrl_post.data.sources.load_rows): a verl jsonl/parquet path, a raw GSM8K jsonl, or
    # 'reasoning_gym:<task>' (procedural), 'gsm8k:<path>', 'hf:<path>[:<name>]', 'tfds:<name>'; comma-separated
    # to concatenate.
    c.data.train_files = "reasoning_gym:basic_arithmetic"  # training prompts
    c.data.val_files = "reasoning_gym:basic_arithmetic"  # held-out prompts (validation)
    c.data.reasoning_gym = mlc.ConfigDict()  # options of 'reasoning_gym:' specs
    c.data.reasoning_gym.size = 2000  # procedurally generated training problems
    c.data.reasoning_gym.seed = 42  # generator seed of the training problems
    c.data.reasoning_gym.val_size = 200  # held-out problems (questions seen in training are replaced)
    c.data.reasoning_gym.val_seed = _opt_int()  # held-out generator seed; None -> seed + size (disjoint items)
    # Task generator options (difficulty); None entries are left at the task's defaults. These fit
    # basic_arithmetic: two 1-2 digit terms with + and - (SmolLM2-135M greedy accuracy: 17% on 64 held-out
    # problems with prompt_format 'number' and 48 response tokens, 7% on 200 with 'plain' and 64 tokens).
    c.data.reasoning_gym.config = mlc.ConfigDict()
    c.data.reasoning_gym.config.min_terms = _opt_int(2)
    c.data.reasoning_gym.config.max_terms = _opt_int(2)
    c.data.reasoning_gym.config.min_digits = _opt_int(1)
    c.data.reasoning_gym.config.max_digits = _opt_int(2)
    c.data.reasoning_gym.config.operators = ("+", "-")
    c.data.reasoning_gym.config.allow_parentheses = False
    c.data.reasoning_gym.config.allow_negation = False
    # instruction appended to each question (jaxrl_post.data.sources.PROMPT_FORMATS): answer_tag, number, plain, ...
    c.data.reasoning_gym.prompt_format = "number"
    c.data.system_prompt = _opt_str()  # optional system message prepended to every prompt
    c.data.skip_malformed = False  # skip (and count) malformed rows instead of raising
    c.data.train_batch_size = 16  # prompts per step (before rollout.n)
    c.data.val_batch_size = _opt_int()  # prompts per validation generate call; None -> whole set
    c.data.max_prompt_length = 128  # prompts are left-padded (and filtered) to this many tokens
    c.data.max_response_length = 128  # tokens generated per response
    c.data.filter_overlong_prompts = True  # drop prompts longer than max_prompt_length (counted)
    c.data.truncation = "error"  # overlong prompts when not filtered: error | left | right
    c.data.shuffle = True  # shuffle the training set every epoch
    c.data.seed = 1  # shuffle seed
    c.data.max_val_samples = _opt_int()  # cap on held-out problems (None -> all)

    # ---------------------------------------------------------------- actor
    c.actor = mlc.ConfigDict()
    c.actor.ppo_mini_batch_size = 32  # responses per optimizer step
    c.actor.ppo_micro_batch_size = 8  # responses per accumulated micro-batch (lax.scan inside a step)
    c.actor.ppo_epochs = 1  # passes over the rollout batch per training step
    c.actor.shuffle = True  # shuffle responses into mini-batches each epoch
    c.actor.clip_ratio = 0.2  # PPO clip epsilon (default for low and high)
    c.actor.clip_ratio_low = mlc.FieldReference(None, field_type=float)  # None -> clip_ratio
    c.actor.clip_ratio_high = mlc.FieldReference(None, field_type=float)  # None -> clip_ratio (DAPO: 0.28)
    c.actor.clip_ratio_c = 3.0  # dual-clip lower bound for negative advantages
    c.actor.loss_agg_mode = (
        "token-mean"  # token-mean | seq-mean-token-sum | seq-mean-token-mean | seq-mean-token-sum-norm
    )
    c.actor.policy_loss = mlc.ConfigDict()
    c.actor.policy_loss.loss_mode = "vanilla"  # core_algos.POLICY_LOSSES key (vanilla, gspo, clip_cov, ...)
    c.actor.entropy_coeff = 0.0  # loss -= entropy_coeff * entropy
    c.actor.use_kl_loss = False  # add kl_loss_coef * KL(actor || ref) to the loss (GRPO style)
    c.actor.kl_loss_coef = 0.001  # weight of the KL loss
    c.actor.kl_loss_type = "low_var_kl"  # kl | abs | mse | low_var_kl | full
    c.actor.grad_clip = 1.0  # clip_by_global_norm threshold
    c.actor.drop_truncated = False  # drop responses that hit max_response_length from the loss
    c.actor.optim = _optim(1e-6)

    # ---------------------------------------------------------------- rollout
    c.rollout = mlc.ConfigDict()
    c.rollout.n = 8  # responses sampled per prompt (group size G)
    c.rollout.temperature = 1.0  # sampling temperature (training log-probs use the same temperature)
    c.rollout.top_k = -1  # -1 = off
    c.rollout.top_p = 1.0  # 1.0 = off
    c.rollout.min_p = 0.0  # 0.0 = off
    c.rollout.do_sample = True  # False = greedy
    c.rollout.log_prob_micro_batch_size = 16  # rows per micro-batch when recomputing log-probs
    c.rollout.val_kwargs = mlc.ConfigDict()
    c.rollout.val_kwargs.n = 1  # responses per held-out prompt
    c.rollout.val_kwargs.do_sample = False  # greedy validation
    c.rollout.val_kwargs.temperature = 0.0  # only used when do_sample
    c.rollout.val_kwargs.top_k = -1
    c.rollout.val_kwargs.top_p = 1.0

    # ---------------------------------------------------------------- reference policy
    c.ref = mlc.ConfigDict()
    c.ref.log_prob_micro_batch_size = 16  # rows per micro-batch for reference log-probs

    # ---------------------------------------------------------------- critic (PPO with GAE)
    c.critic = mlc.ConfigDict()
    c.critic.enable = mlc.FieldReference(None, field_type=bool)  # None -> on iff adv_estimator needs values
    c.critic.ppo_mini_batch_size = 32  # responses per critic optimizer step
    c.critic.ppo_micro_batch_size = 8  # responses per accumulated micro-batch
    c.critic.forward_micro_batch_size = 16  # rows per micro-batch when computing values
    c.critic.ppo_epochs = 1  # critic passes over the rollout batch per step
    c.critic.shuffle = True
    c.critic.cliprange_value = 0.5  # value clipping range
    c.critic.loss_agg_mode = "token-mean"
    c.critic.grad_clip = 1.0
    c.critic.optim = _optim(1e-5)

    # ---------------------------------------------------------------- algorithm
    c.algorithm = mlc.ConfigDict()
    c.algorithm.adv_estimator = "grpo"  # core_algos.ADV_ESTIMATORS key (gae, grpo, rloo, reinforce_plus_plus, ...)
    c.algorithm.gamma = 1.0  # GAE discount
    c.algorithm.lam = 1.0  # GAE lambda
    c.algorithm.norm_adv_by_std_in_grpo = True  # GRPO: divide by group std (False = Dr.GRPO)
    c.algorithm.use_kl_in_reward = False  # subtract beta * KL(actor || ref) from token rewards
    c.algorithm.kl_penalty = "kl"  # KL estimator in the reward: kl | abs | mse | low_var_kl | full
    c.algorithm.kl_ctrl = mlc.ConfigDict()
    c.algorithm.kl_ctrl.type = "fixed"  # fixed | adaptive
    c.algorithm.kl_ctrl.kl_coef = 0.001  # initial beta
    c.algorithm.kl_ctrl.horizon = 10000  # adaptive controller horizon
    c.algorithm.kl_ctrl.target_kl = 0.1  # adaptive controller target

    # ---------------------------------------------------------------- rewards
    c.reward_model = mlc.ConfigDict()
    c.reward_model.reward_manager = "naive"  # only 'naive' (rule-based, dispatch by data_source)
    c.reward_model.num_workers = 2  # worker threads scoring decoded responses
    c.reward_model.timeout_s = 10.0  # per-call timeout; errors/timeouts score 0 and are counted
    c.custom_reward_function = mlc.ConfigDict()
    c.custom_reward_function.path = _opt_str()  # python file with a scoring function (overrides dispatch)
    c.custom_reward_function.name = "compute_score"  # function name inside that file

    # ---------------------------------------------------------------- trainer
    c.trainer = mlc.ConfigDict()
    c.trainer.project_name = "jaxrl_post"
    c.trainer.experiment_name = "grpo"
    c.trainer.default_local_dir = "runs/grpo"  # working dir: metrics.jsonl, config, checkpoints
    c.trainer.total_epochs = 1  # used when total_training_steps is None
    c.trainer.total_training_steps = _opt_int()  # steps to run (overrides total_epochs)
    c.trainer.logger = ("console", "jsonl")  # any of console | jsonl (always on) | tensorboard | wandb
    c.trainer.val_before_train = True  # validate at step 0
    c.trainer.val_at_end = True  # validate after the last step
    c.trainer.test_freq = -1  # validate every k steps (-1 = only before/after)
    c.trainer.critic_warmup = 0  # steps that update only the critic
    # Checkpoints (<default_local_dir>/checkpoints/global_step_<N>) are on by default, so rerunning the same
    # command resumes (resume_mode auto) and Ctrl-C / SIGTERM saves the last completed step.
    c.trainer.save_freq = 10  # checkpoint every k steps and after the last step (-1 = off)
    c.trainer.resume_mode = "auto"  # auto (latest checkpoint in the working dir) | disable | resume_path
    c.trainer.resume_from_path = _opt_str()  # resume_path: a global_step_<N> dir or a checkpoints/run dir
    # keep the newest k checkpoints, older ones are deleted (None = all). SmolLM2-135M float32: ~1.4 GB per
    # checkpoint (330 MB of weights, 1.1 GB of AdamW moments).
    c.trainer.max_actor_ckpt_to_keep = _opt_int(2)
    c.trainer.async_save = True  # write checkpoints in a background thread
    c.trainer.max_consecutive_nonfinite = 10  # stop after k skipped (non-finite) updates in a row (0 = never)
    c.trainer.seed = 0  # seeds params init (random models), sampling, mini-batch shuffles
    c.trainer.progress_bar = True  # tqdm over steps
    c.trainer.print_every = 1  # console metrics every k steps
    c.trainer.device_peak_flops = mlc.FieldReference(None, field_type=float)  # per device, for perf/mfu/*
    c.trainer.mesh = mlc.ConfigDict()
    c.trainer.mesh.data = 1  # mesh axis sizes ('data', 'fsdp', 'tensor'); -1 = remaining devices
    c.trainer.mesh.fsdp = -1
    c.trainer.mesh.tensor = 1
    return c
