"""Shared base config for every jaxrl_post job (GRPO, PPO, ...).

Key names follow verl's `ppo_trainer.yaml` where verl has one (with `actor_rollout_ref.*` flattened to
`model.*`, `actor.*`, `rollout.*`, `ref.*`), and such a key means what it means in verl: `VERL_KEYS` lists
them and `verl_key` gives verl's full name. Units, as in verl:

- `data.train_batch_size`, `actor.ppo_mini_batch_size` and `critic.ppo_mini_batch_size` count *prompts*
  (each prompt brings `rollout.n` responses, so a mini-batch holds `ppo_mini_batch_size * rollout.n`
  responses);
- `*.ppo_micro_batch_size`, `*.log_prob_micro_batch_size` and `critic.forward_micro_batch_size` count
  *responses* (samples), as verl's deprecated global keys do.

Every batch size here is *global* (summed over all devices of the mesh); verl's `*_per_gpu` micro-batch
keys have no counterpart. The token budgets `*_max_token_len_per_gpu` (dynamic batch size) are per device,
as in verl. `docs/config.md` lists every key with its default and meaning; it is generated from this file
(the section headers and each key's comment) by `python scripts/gen_config_docs.py`, so every key needs
a comment.

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


def _auto(default="auto"):
    """A field that is "auto" (resolved by platform, `jaxrl_post/runtime/platform_defaults.py`) or any explicit value;
    command-line values are parsed as Python literals (True, 8, a policy name)."""
    return mlc.FieldReference(default, field_type=object)


def _optim(lr: float) -> mlc.ConfigDict:
    """Optimizer settings (verl `*.optim`): AdamW after global-norm gradient clipping."""
    o = mlc.ConfigDict()
    o.lr = lr  # peak learning rate (AdamW)
    # The schedule advances once per training step (as verl's scheduler), not per optimizer update. Warmup
    # gives lr*(s+1)/warmup at steps s = 0..warmup-1 (verl's ramp starts at 0: lr*s/warmup).
    o.lr_warmup_steps = -1  # linear warmup, in training steps; -1 -> lr_warmup_steps_ratio * total steps
    o.lr_warmup_steps_ratio = 0.0  # warmup as a fraction of the total training steps (when lr_warmup_steps < 0)
    o.warmup_style = "constant"  # schedule after warmup: 'constant' or 'cosine' (verl's lr_scheduler_type)
    o.min_lr_ratio = 0.0  # cosine: final lr = min_lr_ratio * lr (half a cosine period, as verl)
    o.weight_decay = 0.01  # AdamW decoupled weight decay
    o.betas = (0.9, 0.999)  # AdamW (b1, b2)
    o.eps = 1e-8  # AdamW epsilon (verl has no key: torch's default 1e-8)
    return o


def get_base_config() -> mlc.ConfigDict:
    """Returns the base ConfigDict (a GRPO-shaped default on SmolLM2-135M-Instruct)."""
    c = mlc.ConfigDict()

    # ---------------------------------------------------------------- model
    c.model = mlc.ConfigDict()  # the actor (the reference and the critic start from it)
    c.model.path = "smollm2-135m-instruct"  # HF dir / .gguf / alias; ignored when random_init
    c.model.tokenizer_path = _opt_str()  # tokenizer source ('char': toy character tokenizer); None -> model.path
    # "auto" keys resolve by platform (jaxrl_post/runtime/platform_defaults.py; logged at start); explicit values win.
    # compute dtype of actor/ref/critic (verl: mixed_precision.param_dtype); auto: float32 on CPU, bf16 on GPU/TPU
    c.model.dtype = "auto"
    c.model.param_dtype = "float32"  # dtype of master weights and AdamW moments (verl's FSDP masters: fp32)
    # rematerialise decoder blocks in the backward pass (verl: enable_gradient_checkpointing): False, True or a
    # jax.checkpoint_policies name; auto: False on CPU, 'nothing_saveable' on GPU/TPU
    c.model.remat = _auto()
    # lax.scan over repeated layers in training forwards (MaxText; decoder.py); auto: False on CPU, True on GPU/TPU
    c.model.scan_layers = _auto()
    # Attention of forwards without a KV cache (updates, old/ref log-probs, values); the rollout's cached decode
    # is always dense. 'auto': 'splash' on TPU, 'cudnn' on GPU with bf16/fp16 compute and no logit soft-cap,
    # else 'xla'. 'splash' turns model.pack_shared_prompts off; 'chunked' is exact attention in query blocks on
    # any platform, for rows whose dense scores do not fit (docs/performance.md "Attention backends").
    c.model.attention_impl = "auto"  # 'auto' | 'xla' (dense) | 'cudnn' (GPU) | 'splash' (TPU) | 'chunked' (ours)
    # Grouped matmul of the MoE layers (training and rollout): 'ragged_dot' = jax.lax.ragged_dot (any platform),
    # 'megablox' = the Pallas TPU kernel gmm (MaxText's megablox; TPU only), 'auto' = 'ragged_dot' until a TPU
    # measurement shows megablox faster (docs/moe.md "Grouped matmul implementations").
    c.model.moe_impl = "auto"  # 'auto' | 'ragged_dot' | 'megablox' (TPU)
    # Packing (verl: actor_rollout_ref.model.use_remove_padding, default False there; the critic follows it):
    # the actor update, old/ref log-probs and the critic run on rows of real tokens (prompt + response, no
    # padding) with per-sequence attention, static shapes, empty micro-batches skipped. False = padded rows.
    c.model.use_remove_padding = True  # train/score on packed real tokens (engine/packing.py)
    # Packed row length in max-length sequences (max_prompt_length + max_response_length tokens each): longer
    # rows pack tighter (responses longer than half of max_response_length fill one-sequence rows badly) but
    # attention over a row costs row_len^2 (masked across sequences, not skipped). On SmolLM2, 1 was 5-7% faster
    # with responses of 40-128 tokens (P + R = 184) but slower in the default run (P + R = 104, short answers:
    # a sequence over half a row takes the whole row); see docs/performance.md.
    c.model.seqs_per_packed_row = 2  # packed rows of this many max-length sequences (ours; 1 = rows of P + R)
    # Sequences with equal prompts (the rollout.n samples of a prompt) share one copy of the prompt per packed
    # row chunk: their responses attend to it, so the prompt is computed once per chunk, not once per sample.
    # Same losses and gradients (float roundoff, tested). Takes effect only with rollout.n > 1 (with n = 1 no
    # prompt repeats and the shared layout's larger LM-head slot count would only cost). An actor update on
    # SmolLM2 (32 x (P 56 + R <= 48), 8 samples per prompt) took 9.9 s shared vs 15.7 s with the default run's
    # 10-30-token answers, 16.7 vs 19.3 s with 40-48-token ones (scripts/bench_update.py, docs/performance.md).
    c.model.pack_shared_prompts = True  # one prompt copy per packed row chunk when rollout.n > 1 (ours; packed only)
    # LoRA (verl's keys): adapters on the decoder projections; only they (and their AdamW moments) are trained
    # and checkpointed, the reference policy is the same model with the adapters off, the rollout runs with
    # them (a rollout.dtype copy gets merged kernels). Export writes merged weights and a PEFT adapter.
    c.model.lora_rank = 0  # LoRA rank r; 0 = off (full fine-tuning)
    c.model.lora_alpha = 16.0  # LoRA alpha: the update is scaled by lora_alpha / lora_rank
    c.model.target_modules = "all-linear"  # adapted projections: 'all-linear' or comma-separated (q_proj,v_proj,...)
    # Start from a PEFT LoRA adapter dir (adapter_config.json + adapter_model.safetensors); its r, lora_alpha and
    # target modules are used (as verl / PEFT do); lora_rank must be 0 or the adapter's r.
    c.model.lora_adapter_path = _opt_str()  # PEFT adapter to start from (turns LoRA on); None = fresh adapters
    c.model.random_init = False  # True: random weights from `model.preset` + `model.arch` (tests)
    c.model.preset = "smollm2_135m"  # jaxrl_post.models.PRESETS key used when random_init
    c.model.arch = mlc.ConfigDict()  # ModelConfig field overrides applied to the preset (random_init); None = keep
    c.model.arch.hidden_size = _opt_int()  # model width D
    c.model.arch.intermediate_size = _opt_int()  # MLP hidden width
    c.model.arch.num_layers = _opt_int()  # decoder blocks L
    c.model.arch.num_heads = _opt_int()  # query heads H
    c.model.arch.num_kv_heads = _opt_int()  # key/value heads (grouped-query attention)
    c.model.arch.head_dim = _opt_int()  # per-head width K
    c.model.arch.vocab_size = _opt_int()  # vocabulary size V (>= the tokenizer's)
    c.model.arch.num_experts = _opt_int()  # MoE experts E per MoE layer (HF name; docs/moe.md)
    c.model.arch.num_experts_per_tok = _opt_int()  # MoE experts k each token is routed to (HF name)
    c.model.arch.moe_intermediate_size = _opt_int()  # MoE expert MLP width (HF name)
    c.model.arch.shared_expert_intermediate_size = _opt_int()  # Qwen2-MoE's shared expert width (HF name)
    c.model.arch.sliding_window = _opt_int()  # keys a sliding layer sees (HF name; with layer_types)
    # per layer 'sliding_attention' / 'full_attention' (HF name; as many as num_layers), e.g. for a tiny GPT-OSS
    c.model.arch.layer_types = mlc.FieldReference(None, field_type=tuple)
    # MoE: add the load-balancing loss to the actor loss (HF's switch)
    c.model.arch.output_router_logits = mlc.FieldReference(None, field_type=bool)
    c.model.arch.router_aux_loss_coef = mlc.FieldReference(None, field_type=float)  # MoE: its weight (HF: 0.001)
    # MoE capacity factor (MaxText's capacity_factor): each expert takes <= ceil(cf * T * k / E) tokens per sequence,
    # the rest dropped (residual only); None = dropless (ours; docs/moe.md)
    c.model.arch.moe_capacity_factor = mlc.FieldReference(None, field_type=float)

    # ---------------------------------------------------------------- data
    c.data = mlc.ConfigDict()
    # Data specs (jaxrl_post.data.sources.load_rows): a verl jsonl/parquet path, a raw GSM8K jsonl, or
    # 'reasoning_gym:<task>' (procedural), 'gsm8k:<path>', 'hf:<path>[:<name>]', 'tfds:<name>'; comma-separated
    # to concatenate.
    c.data.train_files = "reasoning_gym:basic_arithmetic"  # training prompts
    c.data.val_files = "reasoning_gym:basic_arithmetic"  # held-out prompts (validation); same spec syntax
    c.data.reasoning_gym = mlc.ConfigDict()  # options of 'reasoning_gym:' specs
    c.data.reasoning_gym.size = 2000  # procedurally generated training problems
    c.data.reasoning_gym.seed = 42  # generator seed of the training problems
    c.data.reasoning_gym.val_size = 200  # held-out problems (questions seen in training are replaced)
    c.data.reasoning_gym.val_seed = _opt_int()  # held-out generator seed; None -> seed + size (disjoint items)
    # Task generator options (difficulty); None entries are left at the task's defaults. These fit
    # basic_arithmetic: two 1-2 digit terms with + and - (SmolLM2-135M greedy accuracy: 17% on 64 held-out
    # problems with prompt_format 'number' and 48 response tokens, 7% on 200 with 'plain' and 64 tokens).
    c.data.reasoning_gym.config = mlc.ConfigDict()
    c.data.reasoning_gym.config.min_terms = _opt_int(2)  # fewest terms per expression
    c.data.reasoning_gym.config.max_terms = _opt_int(2)  # most terms per expression
    c.data.reasoning_gym.config.min_digits = _opt_int(1)  # fewest digits per term
    c.data.reasoning_gym.config.max_digits = _opt_int(2)  # most digits per term
    c.data.reasoning_gym.config.operators = ("+", "-")  # operators to draw from
    c.data.reasoning_gym.config.allow_parentheses = False  # allow parenthesised sub-expressions
    c.data.reasoning_gym.config.allow_negation = False  # allow negative terms
    # instruction appended to each question (jaxrl_post.data.sources.PROMPT_FORMATS): answer_tag, number, plain, ...
    c.data.reasoning_gym.prompt_format = "number"  # how the answer is asked for
    c.data.system_prompt = _opt_str()  # optional system message prepended to every prompt
    c.data.skip_malformed = False  # skip (and count) malformed rows instead of raising
    c.data.train_batch_size = 16  # prompts per training step, global (responses per step: x rollout.n)
    c.data.val_batch_size = _opt_int()  # prompts per validation generate call, global; None -> whole set
    c.data.max_prompt_length = 128  # prompt tokens: prompts are left-padded (and filtered/truncated) to this
    c.data.max_response_length = 128  # most tokens generated per response
    c.data.filter_overlong_prompts = True  # drop prompts longer than max_prompt_length, counted (verl default: False)
    c.data.truncation = "error"  # overlong prompts when not filtered: error | left | right (verl also: middle)
    c.data.shuffle = True  # shuffle the training prompts every epoch
    c.data.seed = 1  # seed of the training-prompt shuffle
    c.data.max_val_samples = _opt_int()  # cap on held-out problems (None -> all)

    # ---------------------------------------------------------------- actor
    c.actor = mlc.ConfigDict()
    c.actor.ppo_mini_batch_size = 4  # prompts per optimizer step, global: ppo_mini_batch_size * rollout.n responses
    c.actor.ppo_micro_batch_size = 8  # responses per accumulated micro-batch (lax.scan in a step), global
    # Micro-batches by token budget (needs model.use_remove_padding). Off: a packed micro-batch has the token
    # budget of a padded one (ppo_micro_batch_size rows of max_prompt_length + max_response_length tokens).
    c.actor.use_dynamic_bsz = False  # micro-batches of ppo_max_token_len_per_gpu tokens per device (verl meaning)
    c.actor.ppo_max_token_len_per_gpu = 16384  # tokens per device per micro-batch when use_dynamic_bsz
    c.actor.ppo_epochs = 1  # passes over the rollout batch per training step
    c.actor.shuffle = True  # shuffle responses into mini-batches each epoch (verl default: False)
    c.actor.clip_ratio = 0.2  # PPO clip epsilon (default for low and high)
    c.actor.clip_ratio_low = mlc.FieldReference(None, field_type=float)  # lower clip epsilon; None -> clip_ratio
    c.actor.clip_ratio_high = mlc.FieldReference(None, field_type=float)  # upper; None -> clip_ratio (DAPO: 0.28)
    c.actor.clip_ratio_c = 3.0  # dual-clip lower bound for negative advantages
    c.actor.loss_agg_mode = (
        "token-mean"  # token-mean | seq-mean-token-sum | seq-mean-token-mean | seq-mean-token-sum-norm
    )
    c.actor.policy_loss = mlc.ConfigDict()
    c.actor.policy_loss.loss_mode = "vanilla"  # a registered policy loss (docs/algorithms.md)
    c.actor.policy_loss.clip_cov_ratio = 0.0002  # clip_cov: fraction of tokens whose gradient is cut
    c.actor.policy_loss.clip_cov_lb = 1.0  # clip_cov: lower bound of the covariance of candidate tokens
    c.actor.policy_loss.clip_cov_ub = 5.0  # clip_cov: upper bound of the covariance of candidate tokens
    c.actor.policy_loss.kl_cov_ratio = 0.0002  # kl_cov: fraction of tokens given the KL penalty
    c.actor.policy_loss.ppo_kl_coef = 0.1  # kl_cov: coefficient of the |log ratio| penalty
    c.actor.policy_loss.tau_pos = 1.0  # sapo: gate temperature where A > 0 (verl: actor.tau_pos)
    c.actor.policy_loss.tau_neg = 1.05  # sapo: gate temperature where A <= 0 (verl: actor.tau_neg)
    c.actor.entropy_coeff = 0.0  # loss -= entropy_coeff * entropy
    c.actor.use_kl_loss = False  # add kl_loss_coef * KL(actor || ref) to the loss (GRPO style)
    c.actor.kl_loss_coef = 0.001  # weight of the KL loss
    c.actor.kl_loss_type = "low_var_kl"  # kl | abs | mse | low_var_kl (k1, k2, k3 aliases)
    c.actor.grad_clip = 1.0  # clip_by_global_norm threshold
    c.actor.drop_truncated = False  # drop responses that hit max_response_length from the loss
    c.actor.optim = _optim(1e-6)
    # MoE routing replay (verl: actor.router_replay; docs/moe.md): 'R3' forces the experts the rollout routed each
    # token to in the old-log-prob and update forwards; 'R2' forces the old-log-prob forward's in the update
    c.actor.router_replay = mlc.ConfigDict()
    c.actor.router_replay.mode = "disabled"  # 'disabled' | 'R2' | 'R3'
    c.actor.fsdp_config = mlc.ConfigDict()  # memory placement of the actor's training state
    # AdamW moments in host RAM (memory kind pinned_host) between updates, moved to the device inside each update;
    # frees 8 bytes/param of device memory for a host<->device copy per update. Same numbers (docs/accelerators.md).
    c.actor.fsdp_config.optimizer_offload = False  # keep the actor's optimizer state in host memory

    # ---------------------------------------------------------------- rollout
    c.rollout = mlc.ConfigDict()
    c.rollout.n = 8  # responses sampled per prompt (group size G)
    c.rollout.dtype = (
        _opt_str()
    )  # weights + compute dtype of the rollout copy; None = model.dtype (verl default: bfloat16)
    c.rollout.temperature = 1.0  # sampling temperature (training log-probs use the same temperature)
    c.rollout.top_k = -1  # sample from the k most likely tokens; -1 = off
    c.rollout.top_p = 1.0  # nucleus sampling mass; 1.0 = off
    c.rollout.min_p = 0.0  # drop tokens below min_p * the top probability; 0.0 = off
    c.rollout.do_sample = True  # False = greedy
    # Mask replay: with top-k/top-p/min-p, rollout and training log-probs are those of the truncated distribution
    # the sampler drew from (its per-token threshold replayed on the training logits), so on-policy ratios are 1.
    c.rollout.sampling_mask_replay = False  # False: full-softmax log-probs, as verl (biased ratio with truncation)
    # Rollout engine (verl: rollout.name picks the inference engine; docs/paged_rollout.md): 'dense' = today's
    # Generator (a dense KV cache of B x (P + R) slots, compaction); 'paged' = the paged, continuously batched engine
    # (jaxrl_post/rollout/paged, single- or multi-turn; one device, or devices / tp data-parallel replicas of a
    # tp-device engine with rollout.tensor_model_parallel_size). Keys below: 'paged' only, per replica (vLLM's are
    # per DP rank).
    c.rollout.name = "dense"  # 'dense' | 'paged'
    c.rollout.max_num_seqs = 256  # paged: sequences decoded at once per replica (slots of the decode batch)
    c.rollout.max_num_batched_tokens = 2048  # paged: prompt tokens per prefill dispatch per replica (chunked prefill)
    # paged: fraction of the device memory the KV page pool may use after the weights (vLLM / verl); None = enough
    # pages for every slot to hold a longest sequence (no preemption)
    c.rollout.gpu_memory_utilization = mlc.FieldReference(None, field_type=float)
    c.rollout.num_gpu_blocks_override = _opt_int()  # paged: pages of the pool, overrides the above (vLLM)
    c.rollout.block_size = 16  # paged: tokens per KV page (vLLM)
    c.rollout.num_scheduler_steps = 16  # paged: decode steps per dispatch between scheduling rounds (vLLM)
    c.rollout.max_model_len = _opt_int()  # paged: prompt + response tokens a page table holds (None = P + R)
    # paged: sequences of a call (a multi-turn session) share the KV pages of their common prefix by content, full
    # pages only; a prompt prefills from its first token after them (vLLM's automatic prefix caching, on by default
    # in vLLM and verl; docs/paged_rollout.md). Off under routing replay (actor.router_replay.mode='R3').
    c.rollout.enable_prefix_caching = True
    # paged: the decode batch sizes compiled (verl's / vLLM's name; a jitted program each here): a decode dispatch
    # runs the running sequences padded to the smallest that holds them. None: powers of two from 8 and max_num_seqs
    c.rollout.cudagraph_capture_sizes = mlc.FieldReference(None, field_type=tuple)
    # Placement (verl fully-async's top-level rollout.* names): devices of the rollout's own mesh
    c.rollout.n_gpus_per_node = 0  # devices given to the rollout (its own mesh, the first N); 0 = colocated
    c.rollout.nnodes = 1  # hosts given to the rollout (with n_gpus_per_node > 0; only 1 for now)
    # The rollout's own tensor-parallel layout (verl's name; docs/performance.md): None = the training mesh's layout
    # (no extra copy); an int tp = a rollout mesh with 'tensor' = tp, the rest of its devices on 'data' (colocated:
    # the training devices, the copy resharded by one jitted program; split: the n_gpus_per_node devices)
    c.rollout.tensor_model_parallel_size = _opt_int()  # tensor-parallel size of the rollout; None = training's
    # Asynchronous training (docs/async.md; verl's fully-async recipe names, `mode` is ours)
    c.async_training = mlc.ConfigDict()
    c.async_training.mode = "sync"  # 'sync' | 'one_step_off' | 'fully_async'
    c.async_training.staleness_threshold = 1  # fully_async: a group of version v trains at step t iff t - v <= this
    c.async_training.trigger_parameter_sync_step = 1  # fully_async: training steps between weight publications
    c.async_training.require_batches = 1  # fully_async: generation batches per training step (prompts split evenly)
    c.async_training.partial_rollout = False  # fully_async: stop generation at a weight update, resume (paged only)
    c.async_training.partial_rollout_dispatches = 2  # ours: engine dispatches the batch in flight runs before that
    c.async_training.background_producer = True  # ours: split placement, generation ahead on a thread during updates
    c.rollout.log_prob_micro_batch_size = 16  # responses per micro-batch when recomputing old log-probs, global
    c.rollout.log_prob_use_dynamic_bsz = mlc.FieldReference(None, field_type=bool)  # None -> actor.use_dynamic_bsz
    c.rollout.log_prob_max_token_len_per_gpu = _opt_int()  # None -> actor.ppo_max_token_len_per_gpu
    # Multi-turn rollouts (verl: actor_rollout_ref.rollout.multi_turn; docs/agents.md): each trajectory talks to an
    # environment (a tool set, or a game) turn by turn; only the model's tokens are trained (loss_mask), tool and
    # environment tokens stay in the context. data.max_response_length is the budget over all turns.
    c.rollout.multi_turn = mlc.ConfigDict()
    c.rollout.multi_turn.enable = False  # roll out with the agent loop (jaxrl_post.rollout.agent_loop)
    c.rollout.multi_turn.env = "tools"  # 'tools' (the tool set below) | 'guess_number' (number-guessing game)
    # comma-separated: built-in tools (calculator, python) and/or 'path/to/file.py:function' (type hints + docstring)
    c.rollout.multi_turn.tools = "calculator"  # the tools of env 'tools' (passed to the chat template as tools=)
    c.rollout.multi_turn.max_assistant_turns = _opt_int()  # model turns per trajectory; None = no limit
    c.rollout.multi_turn.max_user_turns = _opt_int()  # tool/environment turns per trajectory; None = no limit
    c.rollout.multi_turn.max_parallel_calls = 1  # tool calls run per turn (later ones are dropped)
    c.rollout.multi_turn.max_tool_response_length = 256  # characters of a tool response kept
    c.rollout.multi_turn.tool_response_truncate_side = "middle"  # cut long tool responses: left | middle | right
    c.rollout.multi_turn.format = "hermes"  # tool-call format (<tool_call>{json}</tool_call>)
    c.rollout.multi_turn.tool_num_workers = 2  # tool worker processes (ours)
    c.rollout.multi_turn.tool_timeout_s = 10.0  # per-call wall-time limit; a hung call's worker is killed (ours)
    c.rollout.multi_turn.tool_memory_mb = 2048  # address-space cap of each tool worker, MiB; 0 = none (ours)
    c.rollout.multi_turn.tool_max_output_chars = 8192  # a tool result is cut to this many characters (ours)
    # file tools (names, comma-separated) whose calls run in the sandbox, as the `python` tool's (ours)
    c.rollout.multi_turn.sandboxed_tools = ""
    c.rollout.multi_turn.tool_max_processes = 16  # processes of one sandboxed call (python, sandboxed_tools) (ours)
    # True: where the sandbox is unavailable, run the python tool and sandboxed_tools without file and process
    # isolation instead of refusing the run (the explicit opt-out; ours)
    c.rollout.multi_turn.allow_unsandboxed_tools = False
    c.rollout.multi_turn.max_error_fraction = 0.5  # stop when more of a step's executed tool calls fail (ours)
    c.rollout.val_kwargs = mlc.ConfigDict()  # sampling for validation
    c.rollout.val_kwargs.n = 1  # responses per held-out prompt
    c.rollout.val_kwargs.do_sample = False  # greedy validation
    c.rollout.val_kwargs.temperature = 0.0  # only used when do_sample
    c.rollout.val_kwargs.top_k = -1  # only used when do_sample; -1 = off
    c.rollout.val_kwargs.top_p = 1.0  # only used when do_sample; 1.0 = off

    # ---------------------------------------------------------------- reference policy
    c.ref = mlc.ConfigDict()
    c.ref.log_prob_micro_batch_size = 16  # responses per micro-batch for reference log-probs, global
    c.ref.log_prob_use_dynamic_bsz = mlc.FieldReference(None, field_type=bool)  # None -> actor.use_dynamic_bsz
    c.ref.log_prob_max_token_len_per_gpu = _opt_int()  # None -> actor.ppo_max_token_len_per_gpu

    # ---------------------------------------------------------------- critic (PPO with GAE)
    c.critic = mlc.ConfigDict()
    c.critic.enable = mlc.FieldReference(None, field_type=bool)  # None -> on iff adv_estimator needs values
    # verl's default is the actor's value; here it has its own.
    c.critic.ppo_mini_batch_size = 4  # prompts per critic update, global: ppo_mini_batch_size * rollout.n responses
    c.critic.ppo_micro_batch_size = 8  # responses per accumulated micro-batch, global
    c.critic.forward_micro_batch_size = 16  # responses per micro-batch when computing values, global
    c.critic.use_dynamic_bsz = mlc.FieldReference(None, field_type=bool)  # None -> actor.use_dynamic_bsz
    c.critic.ppo_max_token_len_per_gpu = 32768  # tokens per device per critic micro-batch when use_dynamic_bsz
    c.critic.forward_max_token_len_per_gpu = _opt_int()  # values pass; None -> critic.ppo_max_token_len_per_gpu
    c.critic.ppo_epochs = 1  # critic passes over the rollout batch per training step (verl default: the actor's)
    c.critic.shuffle = True  # shuffle responses into critic mini-batches each epoch (verl default: the actor's)
    c.critic.cliprange_value = 0.5  # value clipping range around the old values
    c.critic.loss_agg_mode = "token-mean"  # value-loss averaging, as actor.loss_agg_mode (verl default: the actor's)
    c.critic.grad_clip = 1.0  # clip_by_global_norm threshold
    c.critic.optim = _optim(1e-5)
    c.critic.fsdp_config = mlc.ConfigDict()  # memory placement of the critic's training state
    # verl: critic.model.fsdp_config.optimizer_offload
    c.critic.fsdp_config.optimizer_offload = False  # keep the critic's optimizer state in host memory (as the actor's)

    # ---------------------------------------------------------------- algorithm
    c.algorithm = mlc.ConfigDict()
    c.algorithm.adv_estimator = "grpo"  # a registered advantage estimator (docs/algorithms.md)
    c.algorithm.gamma = 1.0  # GAE discount
    c.algorithm.lam = 1.0  # GAE lambda
    c.algorithm.norm_adv_by_std_in_grpo = True  # GRPO: divide by group std (False = Dr.GRPO)
    c.algorithm.use_kl_in_reward = False  # subtract beta * KL(actor || ref) from token rewards
    c.algorithm.kl_penalty = "kl"  # KL estimator in the reward: kl | abs | mse | low_var_kl
    c.algorithm.kl_ctrl = mlc.ConfigDict()  # controller of beta (KL in reward)
    c.algorithm.kl_ctrl.type = "fixed"  # fixed | adaptive
    c.algorithm.kl_ctrl.kl_coef = 0.001  # initial beta
    # Each step multiplies beta by 1 + clip(kl / target_kl - 1, +-0.2) * (responses in the step) / horizon
    c.algorithm.kl_ctrl.horizon = 10000  # adaptive controller horizon, in responses
    c.algorithm.kl_ctrl.target_kl = 0.1  # adaptive controller target
    c.algorithm.filter_groups = mlc.ConfigDict()  # DAPO dynamic sampling
    # After scoring, groups whose `metric` is the same for all rollout.n responses are dropped and new prompt
    # batches (data.train_batch_size prompts each) are generated until data.train_batch_size groups are kept;
    # surplus kept groups are dropped, so every update sees data.train_batch_size x rollout.n responses.
    c.algorithm.filter_groups.enable = False  # drop zero-variance groups and generate more (DAPO dynamic sampling)
    # acc: the reward function's `acc`, else its score before the overlong penalty; score: that score;
    # seq_reward: the score after the penalty; seq_final_reward: the same (needs no KL in reward); any other
    # name: that extra key of the reward function's dict results.
    c.algorithm.filter_groups.metric = "acc"  # value that must vary inside a group (verl default: None)
    c.algorithm.filter_groups.max_num_gen_batches = 0  # error after this many generation batches in a step; <= 0: never
    # Rollout correction (jaxrl_post.algos.rollout_corr): IS weights / rejection from log(pi_old / pi_rollout), the
    # training policy's log-probs over the sampler's. Both off by default. verl's bypass_mode/loss_type: not here.
    c.algorithm.rollout_correction = mlc.ConfigDict()
    c.algorithm.rollout_correction.rollout_is = _opt_str()  # IS weights: None (off) | token | sequence (product)
    c.algorithm.rollout_correction.rollout_is_threshold = 2.0  # truncate IS weights from above at this value (> 0)
    c.algorithm.rollout_correction.rollout_is_batch_normalize = False  # divide IS weights by their batch mean
    # comma-separated, all must pass: token_k{1,2,3}, seq_sum_k{1,2,3}, seq_mean_k{1,2,3} (k1 = geo), seq_max_k{2,3}
    c.algorithm.rollout_correction.rollout_rs = _opt_str()  # rejection sampling options; None = off
    # one entry per option (or one shared), e.g. '0.5_2.0,0.01': k1 takes 'lower_upper' bounds (a single number
    # u means lower = 1/u), k2/k3 an upper bound. A string: write numbers as '2.0'.
    c.algorithm.rollout_correction.rollout_rs_threshold = _opt_str()  # rejection thresholds (required with rollout_rs)

    # ---------------------------------------------------------------- on-policy distillation (docs/distillation.md)
    # verl's `distillation.*`: the student (the actor) samples, a frozen teacher scores its tokens
    # (`teacher_log_prob`) and the actor loss gets a distillation term. One teacher (multi-teacher routing by
    # data_source is not implemented); it must share the student's tokenizer.
    c.distillation = mlc.ConfigDict()
    c.distillation.enabled = False  # add the teacher and the distillation loss to the RL trainer
    c.distillation.teacher_models = mlc.ConfigDict()  # one entry, `teacher_model` (verl's single-teacher name)
    c.distillation.teacher_models.teacher_model = mlc.ConfigDict()
    # teacher: HF dir / .gguf / alias / exported run dir (ignored when random_init)
    c.distillation.teacher_models.teacher_model.model_path = _opt_str()
    # teacher tokenizer source ('char': toy tokenizer); None -> model_path (ours)
    c.distillation.teacher_models.teacher_model.tokenizer_path = _opt_str()
    # teacher weights + compute dtype; None -> model.dtype (verl: inference.dtype)
    c.distillation.teacher_models.teacher_model.dtype = _opt_str()
    # responses per micro-batch of the teacher forward, global (ours)
    c.distillation.teacher_models.teacher_model.log_prob_micro_batch_size = 16
    # True: random teacher from preset + arch (tests) (ours)
    c.distillation.teacher_models.teacher_model.random_init = False
    # jaxrl_post.models.PRESETS key used when random_init (ours)
    c.distillation.teacher_models.teacher_model.preset = "smollm2_135m"
    c.distillation.teacher_models.teacher_model.seed = 1  # init seed of a random teacher (ours)
    # ModelConfig overrides of a random teacher, as model.arch; None = keep (ours)
    c.distillation.teacher_models.teacher_model.arch = mlc.ConfigDict()
    c.distillation.teacher_models.teacher_model.arch.hidden_size = _opt_int()  # as model.arch.hidden_size
    c.distillation.teacher_models.teacher_model.arch.intermediate_size = _opt_int()  # as model.arch.intermediate_size
    c.distillation.teacher_models.teacher_model.arch.num_layers = _opt_int()  # as model.arch.num_layers
    c.distillation.teacher_models.teacher_model.arch.num_heads = _opt_int()  # as model.arch.num_heads
    c.distillation.teacher_models.teacher_model.arch.num_kv_heads = _opt_int()  # as model.arch.num_kv_heads
    c.distillation.teacher_models.teacher_model.arch.head_dim = _opt_int()  # as model.arch.head_dim
    c.distillation.teacher_models.teacher_model.arch.vocab_size = _opt_int()  # as model.arch.vocab_size
    c.distillation.distillation_loss = mlc.ConfigDict()
    # Per-token loss D: a reverse-KL estimator of log pi_student vs log pi_teacher on the sampled token: k1 (kl),
    # k3 (low_var_kl), abs, k2 (mse); or verl's GKD-style forward KL on the teacher's top-k tokens:
    # forward_kl_topk, forward_kl_topk_tail (+ a tail bucket), supervised (use_policy_gradient=False).
    # per-token divergence: k1 | k3 | kl | low_var_kl | abs | k2 | mse | forward_kl_topk | forward_kl_topk_tail
    c.distillation.distillation_loss.loss_mode = "k3"
    # K of the top-k modes: the teacher's K most likely tokens per response position
    c.distillation.distillation_loss.topk = 32
    # top-k modes: student and teacher log-probs clamped from below at this value (verl); None = off
    c.distillation.distillation_loss.log_prob_min_clamp = mlc.FieldReference(None, field_type=float)
    # loss = task policy loss + distillation_loss_coef * distillation loss; False: distillation only
    c.distillation.distillation_loss.use_task_rewards = True
    # weight of the distillation loss when use_task_rewards
    c.distillation.distillation_loss.distillation_loss_coef = 1.0
    # clamp D to [-c, c] (verl #5041); None = off
    c.distillation.distillation_loss.loss_max_clamp = mlc.FieldReference(None, field_type=float)
    # True: PG OPD, D is a reward: advantage -sg(D) through a clipped PPO loss (use with k1). False: GKD-style,
    # D is aggregated with actor.loss_agg_mode and differentiated (k3; k1 is refused: no teacher gradient).
    # apply D as a policy-gradient reward (True) or as a supervised loss (False)
    c.distillation.distillation_loss.use_policy_gradient = False
    # policy loss of the PG mode (only 'vanilla', as verl)
    c.distillation.distillation_loss.policy_loss_mode = "vanilla"
    c.distillation.distillation_loss.clip_ratio = 0.2  # PPO clip epsilon of the PG mode (default for low and high)
    # lower clip epsilon; None -> clip_ratio
    c.distillation.distillation_loss.clip_ratio_low = mlc.FieldReference(None, field_type=float)
    # upper clip epsilon; None -> clip_ratio
    c.distillation.distillation_loss.clip_ratio_high = mlc.FieldReference(None, field_type=float)

    # ---------------------------------------------------------------- rewards
    c.reward_model = mlc.ConfigDict()
    c.reward_model.reward_manager = "naive"  # only 'naive' (rule-based, dispatch by data_source)
    c.reward_model.num_workers = 2  # worker processes scoring decoded responses; 0 = in process (helper thread)
    c.reward_model.timeout_s = 10.0  # per-call timeout; errors/timeouts score 0 and are counted
    c.reward_model.max_error_fraction = 0.5  # stop the run when more of a batch's reward calls fail (1.0 = never)
    c.reward_model.overlong_buffer = mlc.ConfigDict()  # DAPO overlong reward shaping
    # A response of L tokens gets min(0, penalty_factor * ((M - len) - L) / len) added to its score
    # (M = data.max_response_length): 0 up to M - len tokens, then linearly down to -penalty_factor at M.
    # Applied in training and validation (as verl); the reward function's own score is logged as `acc`.
    c.reward_model.overlong_buffer.enable = False  # penalise responses longer than max_response_length - len
    c.reward_model.overlong_buffer.len = 0  # buffer tokens before data.max_response_length (enabled: 0 < len <= it)
    c.reward_model.overlong_buffer.penalty_factor = 0.0  # penalty at data.max_response_length tokens (DAPO: 1.0)
    c.reward_model.overlong_buffer.log = False  # also log the extra infos overlong_reward and overlong (penalty < 0)
    c.reward_model.remote = mlc.ConfigDict()  # remote reward service over HTTP (docs/reward_service.md)
    c.reward_model.remote.url = _opt_str()  # e.g. http://127.0.0.1:8000/get_reward; set: it scores every response
    c.reward_model.remote.batch_size = 32  # trajectories per request
    c.reward_model.remote.max_concurrency = 4  # requests in flight at once
    c.reward_model.remote.timeout_s = 30.0  # connect/read timeout of one request (seconds)
    c.reward_model.remote.max_retries = 3  # extra attempts of a failed request / of items with a bad score
    c.reward_model.remote.backoff_s = 0.5  # sleep before retry k: min(backoff_s * 2**k, backoff_max_s)
    c.reward_model.remote.backoff_max_s = 8.0  # longest sleep between attempts
    c.reward_model.remote.max_error_fraction = 0.0  # stop when more items fail after retries (0: any failure)
    c.reward_model.judge = mlc.ConfigDict()  # generative judge, LLM-as-judge (docs/reward_service.md)
    c.reward_model.judge.path = _opt_str()  # judge model (any model.path); set: the judge scores every response
    c.reward_model.judge.tokenizer_path = _opt_str()  # its tokenizer ('char': toy one); None -> judge.path
    c.reward_model.judge.dtype = "bfloat16"  # the judge's compute and storage dtype
    c.reward_model.judge.prompt_template = _opt_str()  # {question} {response} {ground_truth}; None: built-in
    c.reward_model.judge.use_chat_template = True  # render the judge prompt as one user turn of the chat template
    c.reward_model.judge.max_new_tokens = 32  # verdict length limit (greedy, our sampler)
    c.reward_model.judge.max_prompt_length = 1024  # longer judge prompts are failed calls (reward/num_errors)
    c.reward_model.judge.min_score = 0.0  # the verdict's scale; a number outside it is unparseable
    c.reward_model.judge.max_score = 10.0  # top of the verdict's scale
    c.reward_model.judge.normalize = True  # reward = parsed score / max_score
    c.reward_model.judge.default_score = 0.0  # reward of an unparseable verdict (counted: judge/num_unparseable)
    c.reward_model.judge.batch_size = 64  # judge prompts per generate call
    # A reward model (docs/rlhf.md) scores every trajectory; its score reaches the reward function as
    # extra_info['rm_score'], and is the reward itself when custom_reward_function.path is unset.
    c.reward_model.enable = False  # score trajectories with the reward model at reward_model.model.path
    c.reward_model.model = mlc.ConfigDict()
    c.reward_model.model.path = _opt_str()  # HF *ForSequenceClassification dir, or a reward_model run directory
    c.reward_model.model.dtype = _opt_str()  # the RM's params and compute dtype; None -> model.dtype
    c.reward_model.micro_batch_size_per_gpu = 8  # sequences per device per RM forward micro-batch
    c.reward_model.max_length = _opt_int()  # RM tokens of a re-rendered trajectory (other tokenizer); None -> P + R
    c.custom_reward_function = mlc.ConfigDict()
    c.custom_reward_function.path = _opt_str()  # python file with a scoring function (overrides dispatch)
    c.custom_reward_function.name = "compute_score"  # function name inside that file

    # ---------------------------------------------------------------- trainer
    c.trainer = mlc.ConfigDict()
    c.trainer.project_name = "jaxrl_post"  # project name for the loggers (wandb project)
    c.trainer.experiment_name = "grpo"  # run name for the loggers
    # verl saves checkpoints directly in this dir; here they go to its checkpoints/ subdir, next to the logs.
    c.trainer.default_local_dir = "runs/grpo"  # working dir: metrics.jsonl, config.json, checkpoints/
    c.trainer.total_epochs = 1  # passes over the training prompts (when total_training_steps is None)
    c.trainer.total_training_steps = _opt_int()  # training steps to run (overrides total_epochs)
    c.trainer.logger = ("console", "jsonl")  # any of console | jsonl (always on) | tensorboard | wandb
    c.trainer.val_before_train = True  # validate at step 0
    c.trainer.val_at_end = True  # validate after the last step
    c.trainer.test_freq = -1  # validate every k training steps (-1 = only before/after)
    c.trainer.validation_data_dir = _opt_str()  # write each validation's responses to <dir>/<step>.jsonl (None = off)
    c.trainer.rollout_data_dir = _opt_str()  # write each step's scored training responses to <dir>/<step>.jsonl
    # verl documents the same meaning; its loop (steps counted from 1, actor updated when critic_warmup <= step)
    # gives k-1 critic-only steps for k >= 1.
    c.trainer.critic_warmup = 0  # number of training steps, from the first, that update only the critic
    # Checkpoints (<default_local_dir>/checkpoints/global_step_<N>) are on by default, so rerunning the same
    # command resumes (resume_mode auto) and Ctrl-C / SIGTERM saves the last completed step.
    c.trainer.save_freq = 10  # checkpoint every k training steps and after the last step (-1 = off)
    c.trainer.resume_mode = "auto"  # auto (latest checkpoint in the working dir) | disable | resume_path
    c.trainer.resume_from_path = _opt_str()  # resume_path: a global_step_<N> dir or a checkpoints/run dir
    # SmolLM2-135M float32: ~1.4 GB per checkpoint (330 MB of weights, 1.1 GB of AdamW moments).
    c.trainer.max_actor_ckpt_to_keep = _opt_int(2)  # keep the newest k checkpoints, actor and critic (None = all)
    c.trainer.async_save = True  # write checkpoints in a background thread
    c.trainer.max_consecutive_nonfinite = 10  # stop after k skipped (non-finite) updates in a row (0 = never)
    c.trainer.seed = 0  # seeds params init (random models), sampling, mini-batch shuffles
    c.trainer.progress_bar = True  # tqdm over steps
    c.trainer.print_every = 1  # console metrics every k steps
    # JAX's persistent compilation cache (runtime/compile_cache.py): None = $JAX_COMPILATION_CACHE_DIR, else
    # ~/.cache/jaxrl_post/xla; '' = off. A restart loads the programs compiled before instead of compiling them.
    c.trainer.compilation_cache_dir = _opt_str()  # compiled-program cache dir (None = user cache dir, '' = off)
    c.trainer.device_peak_flops = mlc.FieldReference(None, field_type=float)  # per device, for perf/mfu/*
    c.trainer.mesh = mlc.ConfigDict()  # device mesh axes ('data', 'fsdp', 'expert', 'tensor'); -1 = remaining devices
    c.trainer.mesh.data = 1  # data-parallel axis (batch split, params replicated)
    c.trainer.mesh.fsdp = -1  # fully sharded data-parallel axis (batch and params split)
    c.trainer.mesh.tensor = 1  # tensor-parallel axis (heads / MLP width split)
    c.trainer.mesh.expert = 1  # expert-parallel axis (MoE experts split, tokens all-to-all; else batch split)
    # Multi-slice / multi-host: data and fsdp above are then per slice (ICI); the dcn factors multiply them across
    # slices (TPU slice_index; GPU/CPU: one process = one slice). Mesh size = data*dcn_data x fsdp*dcn_fsdp x tensor.
    c.trainer.mesh.dcn_data = 1  # slices along the data axis (1 = one slice, today's mesh)
    c.trainer.mesh.dcn_fsdp = 1  # slices along the fsdp axis (1 = one slice)
    c.trainer.distributed = (
        mlc.ConfigDict()
    )  # jax.distributed (multi-host); all None = auto-detect, see docs/multihost.md
    c.trainer.distributed.coordinator_address = _opt_str()  # 'host:port' of process 0 (None = auto-detect)
    c.trainer.distributed.num_processes = _opt_int()  # JAX processes in the run (None = auto-detect)
    c.trainer.distributed.process_id = _opt_int()  # this process's index, 0..num_processes-1 (None = auto-detect)
    # keep each process's rows of the scored batch on it and exchange only statistics (docs/multihost.md)
    c.trainer.distributed.process_local_rows = False
    return c


# Keys whose name and meaning are verl's (units included: see the module docstring); the others are ours.
_VERL_KEYS_TEXT = """
    model.path model.use_remove_padding model.lora_rank model.lora_alpha model.target_modules model.lora_adapter_path
    data.train_files data.val_files data.train_batch_size data.val_batch_size data.max_prompt_length
    data.max_response_length data.filter_overlong_prompts data.truncation data.shuffle data.seed
    actor.ppo_mini_batch_size actor.ppo_micro_batch_size actor.ppo_epochs actor.shuffle actor.clip_ratio
    actor.router_replay.mode
    actor.clip_ratio_low actor.clip_ratio_high actor.clip_ratio_c actor.loss_agg_mode actor.policy_loss.loss_mode
    actor.policy_loss.clip_cov_ratio actor.policy_loss.clip_cov_lb actor.policy_loss.clip_cov_ub
    actor.policy_loss.kl_cov_ratio actor.policy_loss.ppo_kl_coef
    actor.entropy_coeff actor.use_kl_loss actor.kl_loss_coef actor.kl_loss_type actor.grad_clip
    actor.optim.lr actor.optim.lr_warmup_steps actor.optim.lr_warmup_steps_ratio actor.optim.warmup_style
    actor.optim.min_lr_ratio actor.optim.weight_decay actor.optim.betas actor.fsdp_config.optimizer_offload
    actor.use_dynamic_bsz actor.ppo_max_token_len_per_gpu
    rollout.log_prob_use_dynamic_bsz rollout.log_prob_max_token_len_per_gpu
    ref.log_prob_use_dynamic_bsz ref.log_prob_max_token_len_per_gpu
    critic.use_dynamic_bsz critic.ppo_max_token_len_per_gpu critic.forward_max_token_len_per_gpu
    rollout.n rollout.dtype rollout.temperature rollout.top_k rollout.top_p rollout.do_sample rollout.name
    rollout.max_num_seqs rollout.max_num_batched_tokens rollout.gpu_memory_utilization rollout.max_model_len
    rollout.enable_prefix_caching rollout.cudagraph_capture_sizes
    rollout.tensor_model_parallel_size
    rollout.log_prob_micro_batch_size
    rollout.multi_turn.enable rollout.multi_turn.max_assistant_turns rollout.multi_turn.max_user_turns
    rollout.multi_turn.max_parallel_calls rollout.multi_turn.max_tool_response_length
    rollout.multi_turn.tool_response_truncate_side rollout.multi_turn.format
    rollout.val_kwargs.n rollout.val_kwargs.do_sample rollout.val_kwargs.temperature rollout.val_kwargs.top_k
    rollout.val_kwargs.top_p
    ref.log_prob_micro_batch_size
    critic.enable critic.ppo_mini_batch_size critic.ppo_micro_batch_size critic.forward_micro_batch_size
    critic.ppo_epochs critic.shuffle critic.cliprange_value critic.loss_agg_mode critic.grad_clip
    critic.optim.lr critic.optim.lr_warmup_steps critic.optim.lr_warmup_steps_ratio critic.optim.warmup_style
    critic.optim.min_lr_ratio critic.optim.weight_decay critic.optim.betas
    algorithm.adv_estimator algorithm.gamma algorithm.lam algorithm.norm_adv_by_std_in_grpo
    algorithm.use_kl_in_reward algorithm.kl_penalty algorithm.kl_ctrl.type algorithm.kl_ctrl.kl_coef
    algorithm.kl_ctrl.horizon algorithm.kl_ctrl.target_kl
    algorithm.filter_groups.enable algorithm.filter_groups.metric algorithm.filter_groups.max_num_gen_batches
    reward_model.overlong_buffer.enable reward_model.overlong_buffer.len reward_model.overlong_buffer.penalty_factor
    reward_model.overlong_buffer.log
    reward_model.enable reward_model.model.path reward_model.micro_batch_size_per_gpu reward_model.max_length
    algorithm.rollout_correction.rollout_is algorithm.rollout_correction.rollout_is_threshold
    algorithm.rollout_correction.rollout_is_batch_normalize algorithm.rollout_correction.rollout_rs
    algorithm.rollout_correction.rollout_rs_threshold
    reward_model.reward_manager custom_reward_function.path custom_reward_function.name
    trainer.project_name trainer.experiment_name trainer.default_local_dir trainer.logger trainer.total_epochs
    trainer.total_training_steps trainer.val_before_train trainer.test_freq trainer.critic_warmup trainer.save_freq
    trainer.validation_data_dir trainer.rollout_data_dir
    trainer.resume_mode trainer.resume_from_path trainer.max_actor_ckpt_to_keep
    distillation.enabled distillation.teacher_models.teacher_model.model_path
    distillation.distillation_loss.loss_mode distillation.distillation_loss.use_task_rewards
    distillation.distillation_loss.topk distillation.distillation_loss.log_prob_min_clamp
    distillation.distillation_loss.distillation_loss_coef distillation.distillation_loss.loss_max_clamp
    distillation.distillation_loss.use_policy_gradient distillation.distillation_loss.policy_loss_mode
    distillation.distillation_loss.clip_ratio distillation.distillation_loss.clip_ratio_low
    distillation.distillation_loss.clip_ratio_high
"""
VERL_KEYS = tuple(_VERL_KEYS_TEXT.split())

# Our sections that verl nests under `actor_rollout_ref`.
_VERL_PREFIX = {s: f"actor_rollout_ref.{s}" for s in ("model", "actor", "rollout", "ref")}


def verl_key(key: str) -> str | None:
    """verl's full name of our dotted `key` (e.g. 'actor.ppo_mini_batch_size' ->
    'actor_rollout_ref.actor.ppo_mini_batch_size'), or None when the key is ours (not in `VERL_KEYS`)."""
    if key not in VERL_KEYS:
        return None
    head, _, rest = key.partition(".")
    return f"{_VERL_PREFIX.get(head, head)}.{rest}"
