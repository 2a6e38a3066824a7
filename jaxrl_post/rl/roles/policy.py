"""The policy role (verl's actor worker) and the reference policy (verl's ref worker).

`PolicyRole` owns the actor's `TrainedModel` (`engine/trained_model.py`: graph, trainable params, a LoRA actor's
frozen base, optimizer and LR schedule, and the jitted update, `ppo_update.make_actor_update` on the padded or
packed layout; params and optimizer state donated), its pack specs and the jitted `old_log_prob_fn`
(`update_core.make_log_prob_fn` on the same layout), each built once and compiled once per run.
The arrays it trains are `TrainState.actor` (train_state.py): `PolicyRole.build` returns them beside the role.

`ReferencePolicy` is the frozen initial policy: a copy of the initial actor params in the compute dtype
(`builders.reference_params`), or with LoRA no copy at all: the actor's own model with its adapters off.
"""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx

from jaxrl_post.batch.keys import FORWARD_KEYS, REPLAY_KEYS
from jaxrl_post.engine import packed_steps, packing, steps, update_core
from jaxrl_post.engine.placement import Placement
from jaxrl_post.engine.train_state import OptimizedParams
from jaxrl_post.engine.trained_model import TrainedModel
from jaxrl_post.models.lora import lora_config_of
from jaxrl_post.rl import builders, ppo_update
from jaxrl_post.rl.config_features import dynamic_bsz, router_replay_mode
from jaxrl_post.rl.geometry import StepGeometry
from jaxrl_post.runtime.sharding import batch_shards


def pack_spec(
    cfg, role: str, n_seqs: int, micro: int, *, mesh, response_length: int, attention_impl: str
) -> packing.PackSpec | None:
    """Static packing geometry of one pass (None when `model.use_remove_padding` is off); see
    `packing.micro_geometry` for how `*.use_dynamic_bsz` / `*_max_token_len_per_gpu` map to rows. Shared
    prompts (`model.pack_shared_prompts`) only when `rollout.n > 1` and `attention_impl` is not splash."""
    if not cfg.model.use_remove_padding:
        return None
    p, r = int(cfg.data.max_prompt_length), int(response_length)
    dyn, max_tok = dynamic_bsz(cfg, role)
    dp = batch_shards(mesh)
    rows, row_len = packing.micro_geometry(
        micro_batch_size=micro,
        use_dynamic_bsz=dyn,
        max_token_len_per_gpu=max_tok,
        seq_len=p + r,
        seqs_per_row=int(cfg.model.seqs_per_packed_row),
        dp=dp,
        n_seqs=n_seqs,
    )
    share = bool(cfg.model.pack_shared_prompts) and int(cfg.rollout.n) > 1  # only samples of a prompt repeat it
    share = share and attention_impl != "splash"  # splash: equal segment ids only (logged)
    # slots in per-shard blocks, so the LM head runs on each device's own rows (`packing.PackSpec.shards`)
    return packing.make_pack_spec(n_seqs, rows, p, r, row_len=row_len, share_prompts=share, shards=dp)


class PolicyRole:
    """The actor: layout, optimizer, jitted log-prob and update fns (see the module docstring).

    Build with `PolicyRole.build`. Attributes: `model` (the nnx module; always holds the live params, see
    `sync_model`), `lora` (`LoraConfig` or None: full fine-tuning), `trained` (`TrainedModel`; read through
    `graphdef` / `rest` / `frozen` (a LoRA actor's base params, an argument of every jitted actor fn; None
    otherwise) / `tx` / `lr` (optax optimizer and schedule); `trained.update` is the jitted update), `loss_cfg`
    (`ppo_update.ActorLossConfig`), `spec` / `old_log_prob_spec` (`packing.PackSpec` of the update and of the
    old-log-prob forward; None when padded), `old_log_prob_fn`, `router_replay` (`actor.router_replay.mode`:
    'disabled', 'R2', 'R3'; MoE routing replay, docs/moe.md).
    """

    def __init__(self, cfg, model, placement: Placement, geometry: StepGeometry):
        self.config, self.placement, self.geometry = cfg, placement, geometry
        self.model = model
        self.lora = lora_config_of(model)  # None: full fine-tuning

    @classmethod
    def build(cls, cfg, model, placement: Placement, geometry: StepGeometry) -> tuple[PolicyRole, OptimizedParams]:
        """The role and its initial arrays: params (master weights in `model.param_dtype`; LoRA: the adapters)
        committed to their shardings, and a fresh optimizer state sharded like them."""
        self = cls(cfg, model, placement, geometry)
        a = cfg.actor
        self.optim_cfg = builders.optim_config(
            a.optim,
            grad_clip=a.grad_clip,
            total_training_steps=geometry.total_training_steps,
            updates_per_step=geometry.actor_updates_per_step,
        )
        offload = bool(a.fsdp_config.optimizer_offload)  # the state in host memory between updates
        self.trained, state = TrainedModel.build(model, placement, self.optim_cfg, offload=offload)
        t = self.trained
        if t.frozen is not None:
            nnx.update(model, t.frozen)
        nnx.update(model, state.params)
        self.loss_cfg = builders.actor_loss_config(cfg, geometry.on_policy)
        self.router_replay = router_replay_mode(cfg, model.config, geometry.on_policy)  # ConfigError: dense model
        self.spec = self.pack_spec("actor", geometry.actor_mini, int(a.ppo_micro_batch_size))
        self.old_log_prob_micro = int(cfg.rollout.log_prob_micro_batch_size)
        self.old_log_prob_spec = self.pack_spec("rollout", geometry.batch_size, self.old_log_prob_micro)
        if self.spec is not None:
            layout = packed_steps.PACKED
        else:
            layout = steps.padded_layout(n_micro=geometry.actor_mini // int(a.ppo_micro_batch_size))
        on_trace = placement.tracer("update_actor")
        t.set_update(
            ppo_update.make_actor_update(layout, t.graphdef, t.rest, t.tx, self.loss_cfg, on_trace=on_trace),
            placement,
            state,
        )
        r2 = self.router_replay == "R2"  # the old-log-prob forward records its routes for the update
        self.old_log_prob_fn = jax.jit(
            self.log_prob_fn(self.old_log_prob_spec, self.old_log_prob_micro, "old_log_prob", record_routes=r2)
        )
        return self, state

    # the model's layout and optimizer (`engine/trained_model.py`)
    graphdef = property(lambda self: self.trained.graphdef)
    rest = property(lambda self: self.trained.rest)
    frozen = property(lambda self: self.trained.frozen)  # a LoRA actor's base params, else None
    tx = property(lambda self: self.trained.tx)
    lr = property(lambda self: self.trained.lr)

    def pack_spec(self, role: str, n_seqs: int, micro: int):
        """`placement.pack_spec` of one pass of this policy (None when padded)."""
        return pack_spec(
            self.config,
            role,
            n_seqs,
            micro,
            mesh=self.placement.mesh,
            response_length=self.geometry.response_length,
            attention_impl=self.model.attention_impl,
        )

    def log_prob_fn(self, spec, micro: int, name: str, adapters: bool = True, record_routes: bool = False):
        """A log-prob fn of this policy's graph (not jitted): packed when `spec`, else padded micro-batches;
        `adapters=False`: a LoRA actor with its adapters off (the reference); `record_routes`: also returns the
        MoE routes it chose (`update_core.make_log_prob_fn`)."""
        kw = dict(temperature=self.loss_cfg.temperature, with_entropy=False, adapters=adapters)
        kw["record_routes"] = record_routes
        on_trace = self.placement.tracer(name)
        layout = packed_steps.PACKED if spec is not None else steps.padded_layout(micro_batch_size=micro)
        return update_core.make_log_prob_fn(layout, self.graphdef, self.rest, **kw, on_trace=on_trace)

    def old_log_probs(self, params, batch: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray | None]:
        """`(old_log_probs [B, R] float32, routes)` of the batch's response tokens under `params` (host numpy;
        `batch` is read only). Routing replay: 'R3' forces the rollout's `batch["routed_experts"]`; 'R2' returns
        the routes this forward chose, `[B, T, M, k]` (the caller's `routed_experts`, replayed by the updates);
        routes is None otherwise. Raises ValueError under 'R3' without `routed_experts`."""
        fn, micro, spec = self.old_log_prob_fn, self.old_log_prob_micro, self.old_log_prob_spec
        mode = self.router_replay
        keys = (*FORWARD_KEYS, *REPLAY_KEYS) if mode == "R3" else FORWARD_KEYS
        if mode == "R3" and "routed_experts" not in batch:
            raise ValueError("actor.router_replay.mode='R3': the rollout batch has no routed_experts")
        out = self.placement.forward(fn, params, batch, micro, spec, self.frozen, keys=keys, token_output=mode == "R2")
        return out[0], (out[-1] if mode == "R2" else None)

    def update(self, actor: OptimizedParams, minibatch: dict[str, np.ndarray]):
        """One optimizer step on a host mini-batch (`ACTOR_UPDATE_KEYS`, `[M, ...]`): returns
        `(OptimizedParams, metrics)` with the metrics still on device (no host sync). Donates `actor`."""
        put = self.placement.put_minibatch(minibatch, self.spec)
        return self.trained.step(actor, put, *self.trained.frozen_args())  # LoRA: the frozen base, last

    def sync_model(self, params) -> None:
        """Put `params` into the nnx module (it always holds the live params)."""
        nnx.update(self.model, params)


class ReferencePolicy:
    """The frozen reference policy (only with a KL term, `config_check.kl_in_use`).

    Attributes: `params` (the frozen copy; None with LoRA: the actor with its adapters off), `is_initial`
    (True: the params are the initial actor's, saved as a pointer, not as arrays), `spec`, `log_prob_fn`.
    """

    def __init__(self, cfg, policy: PolicyRole, actor_params):
        self.policy = policy
        self.params = None
        if policy.lora is None:
            self.params = builders.reference_params(actor_params, policy.model.dtype)
        self.is_initial = True  # the reference never changes here
        self.micro = int(cfg.ref.log_prob_micro_batch_size)
        self.spec = policy.pack_spec("ref", policy.geometry.batch_size, self.micro)
        self.log_prob_fn = jax.jit(policy.log_prob_fn(self.spec, self.micro, "ref", adapters=policy.lora is None))

    def log_probs(self, actor_params, batch: dict[str, np.ndarray]) -> np.ndarray:
        """`ref_log_prob [B, R] float32` of the batch's response tokens (LoRA: `actor_params` with the adapters
        off)."""
        params = actor_params if self.params is None else self.params
        p = self.policy
        return p.placement.forward(self.log_prob_fn, params, batch, self.micro, self.spec, p.frozen)[0]
