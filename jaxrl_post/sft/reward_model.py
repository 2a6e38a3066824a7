"""Bradley-Terry reward-model training on preference pairs (TRL `RewardTrainer`) as a task of the supervised trainer
(`RewardModelTask`; `RewardModelTrainer` builds `SupervisedTrainer` with it).

    python -m jaxrl_post.main --config=configs/reward_model.py          (config key trainer_type = 'reward_model')

Per training step: the next `data.train_batch_size` preference pairs (`data/preference.py`, the DPO trainer's
data: TRL prompt / chosen / rejected rows, plain or conversational, an optional numeric `margin` column; grain:
shuffled each epoch, the position is checkpointed) -> `rm_step.layout_pairs` (right-padded `prompt + chosen`
and `prompt + rejected` rows per micro-batch) -> one jitted update (`rm_step.make_rm_update`: the
Bradley-Terry loss, mean over the step's pairs, micro-batches accumulated inside the jit) -> metrics (TRL
names: `loss`, `accuracy`, `margin`, `min_reward`, `mean_reward`, `max_reward`, `grad_norm`,
`learning_rate`, `num_tokens`, `epoch`). Validation: the same over `data.val_files` as `val/loss`,
`val/accuracy`, ... (held-out pair accuracy).

The model is a `models.RewardModel`: the backbone of `model.path` (a causal LM: the policy or its SFT; its LM
head is dropped, the `score` head starts at normal(0, 0.02) as transformers') or an HF
`*ForSequenceClassification` reward model to train further. With LoRA the adapters and the `score` head
train (PEFT's `modules_to_save=["score"]`, as TRL does for reward models). After the last step the model is
exported as an HF `<Family>ForSequenceClassification` directory `<run dir>/huggingface/`, which
`reward_model.model.path` of an RL run reads (`rewards/rm_scorer.py`).

Everything else is `SupervisedTrainer`'s (sft/trainer.py): mesh, optimizer and LR schedule, the shared loop,
checkpoints and exact resume, the non-finite guard, `metrics.jsonl`. Packing (chosen and rejected sharing one
prompt copy) is not implemented: `model.use_remove_padding` is ignored (padded rows).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable

import jax
import numpy as np
from flax import nnx

from jaxrl_post.engine.placement import Placement
from jaxrl_post.engine.run.tracking import Tracking
from jaxrl_post.engine.train_state import OptimizedParams
from jaxrl_post.engine.trained_model import TrainedModel
from jaxrl_post.errors import Checker, ConfigError
from jaxrl_post.models.hf_io import load_reward_model, save_reward_model
from jaxrl_post.models.reward_model import RewardModel
from jaxrl_post.rl import builders
from jaxrl_post.sft import rm_step
from jaxrl_post.sft.batches import SupervisedData, on_mesh
from jaxrl_post.sft.dpo import check_pair_config, head_pairs, load_pairs, pair_tokens
from jaxrl_post.sft.trainer import SupervisedTrainer

log = logging.getLogger(__name__)


def validate_rm_config(cfg) -> None:
    """Raise one `ConfigError` naming every bad key (`dpo.check_pair_config`, then the loss options).

    Raises:
      ConfigError: `invalid reward-model config:` and one `config.<key>...` line per problem.
    """
    c = Checker(cfg)
    check_pair_config(c)
    c.check(
        "rm.center_rewards_coefficient",
        lambda v: v is None or (isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0),
        "must be None or a number >= 0",
    )
    if cfg.data.get("packing_strategy", "per_step") == "bfd":
        c.err("data.packing_strategy", "not built for reward-model training; use 'per_step'")
    c.raise_if_any("invalid reward-model config")


def _is_seq_cls_dir(path) -> bool:
    cfg_file = os.path.join(os.path.expanduser(str(path or "")), "config.json")
    if not os.path.isfile(cfg_file):
        return False
    with open(cfg_file) as f:
        archs = json.load(f).get("architectures") or []
    return any(a.endswith("ForSequenceClassification") for a in archs)


class RewardModelTask:
    """Reward-model training as a task of `SupervisedTrainer` (module docstring; the task interface in
    sft/trainer.py)."""

    trainer_type = "reward_model"
    trainer_name = "RewardModelTrainer"
    validate_config = staticmethod(validate_rm_config)
    load_data = staticmethod(load_pairs)
    head = staticmethod(head_pairs)

    def __init__(self, config, tokenizer):
        self.config, self.tokenizer = config, tokenizer
        self.data: SupervisedData | None = None
        self.placement: Placement | None = None
        self.pairs_per_micro = int(config.data.micro_batch_size)
        self.eval_fn = None

    @staticmethod
    def pack_dataset(cfg, data, row_len: int) -> None:
        """Always None: packed pairs are not built for reward models (`validate_rm_config` refuses bfd)."""
        return None

    def build_model(self, mesh):
        """`RewardModel` from `model.path`: an HF `*ForSequenceClassification` dir as it is, else the causal
        LM's backbone with a fresh `score` head (seeded by `trainer.seed`). LoRA: `score` trains too.
        Raises ConfigError: LoRA on a `*ForSequenceClassification` start."""
        cfg = self.config
        if not cfg.model.random_init and _is_seq_cls_dir(cfg.model.path):
            if cfg.model.lora_rank:
                raise ConfigError("model.lora_rank: LoRA on a *ForSequenceClassification start is not supported")
            rm = load_reward_model(
                cfg.model.path, cfg.model.dtype, mesh if mesh.size > 1 else None, param_dtype=cfg.model.param_dtype
            )
        else:
            backbone = builders.build_actor_and_tokenizer(cfg, mesh)[0]
            rm = RewardModel(rngs=nnx.Rngs(int(cfg.trainer.seed) + 1), backbone=backbone)
            if cfg.model.lora_rank:  # PEFT modules_to_save=["score"]: the head trains with the adapters
                rm.train_score_with_adapters()
        rm.pad_token_id = self.tokenizer.pad_token_id  # pooled as transformers will with the exported config
        if cfg.model.use_remove_padding:
            log.warning("reward model: packed pairs are not implemented; model.use_remove_padding is ignored")
        return rm

    def build_steps(
        self, model: TrainedModel, state: OptimizedParams, placement: Placement, data: SupervisedData, say
    ) -> None:
        """The jitted update (on `model`) and eval functions."""
        self.data, self.placement = data, placement
        c = self.config.rm.center_rewards_coefficient
        kw = dict(center_coef=None if c is None else float(c))
        g, r = model.graphdef, model.rest
        update = rm_step.make_rm_update(g, r, model.tx, on_trace=placement.tracer("update"), **kw)
        model.set_update(update, placement, state)
        self.eval_fn = jax.jit(rm_step.make_rm_eval(g, r, on_trace=placement.tracer("eval"), **kw))

    # ------------------------------------------------------------------------------------ batches
    def _layout(self, pairs) -> dict[str, jax.Array]:
        n_micro = -(-len(pairs) // self.pairs_per_micro)
        pad = n_micro * self.pairs_per_micro - len(pairs)
        if pad:  # a last validation batch: pairs repeated, their sums removed by the caller
            pairs = list(pairs) + [pairs[0]] * pad
        arrays = rm_step.layout_pairs(
            pairs,
            n_micro=n_micro,
            pairs_per_micro=self.pairs_per_micro,
            row_len=self.data.row_len,
            pad_id=int(self.tokenizer.pad_token_id or 0),
        )
        return on_mesh(self.placement, arrays, self.config.data.micro_batch_size, row_keys=rm_step.RM_TOKEN_KEYS)

    # ------------------------------------------------------------------------------------ steps
    def train_batch(self, idx, plan, params, frozen: tuple) -> tuple[dict[str, jax.Array], tuple, int]:
        """One step's batch of the pairs `idx`, the update's trailing arguments (LoRA base) and the step's input
        tokens (`pair_tokens`)."""
        pairs = [self.data.train.pairs[i] for i in idx]
        return self._layout(pairs), frozen, pair_tokens(pairs)

    def validate(self, params, frozen: tuple) -> dict[str, float]:
        """`val/loss`, `val/accuracy` (held-out pair accuracy), `val/margin`, `val/mean_reward`,
        `val/min_reward`, `val/max_reward` over every pair of `data.val_files` (first `data.max_val_samples`),
        and `timing_s/testing`. Raises RuntimeError without validation data."""
        v, size = self.data.val, self.data.batch_size
        if v is None:
            raise RuntimeError("no validation data: set data.val_files")
        t0 = time.perf_counter()
        loss = acc = margin = rsum = 0.0
        lo_r, hi_r = np.inf, -np.inf
        for lo in range(0, len(v), size):
            chunk = v.pairs[lo : lo + size]
            if len(chunk) % self.pairs_per_micro:  # a ragged last batch: score its pairs one micro-batch at a time
                parts = [chunk[i : i + 1] * self.pairs_per_micro for i in range(len(chunk))]
                scale = 1.0 / self.pairs_per_micro
            else:
                parts, scale = [chunk], 1.0
            for part in parts:
                l_sum, s = jax.device_get(self.eval_fn(params, self._layout(part), *frozen))
                loss += float(l_sum) * scale
                acc += float(s["accuracy"]) * scale
                margin += float(s["margin"]) * scale
                rsum += float(s["reward_sum"]) * scale
                lo_r, hi_r = min(lo_r, float(s["min_reward"])), max(hi_r, float(s["max_reward"]))
        n = max(len(v), 1)
        return {
            "val/loss": loss / n,
            "val/accuracy": acc / n,
            "val/margin": margin / n,
            "val/mean_reward": rsum / (2 * n),
            "val/min_reward": lo_r,
            "val/max_reward": hi_r,
            "timing_s/testing": time.perf_counter() - t0,
        }

    def compile_counts(self) -> dict[str, int]:
        """Compiled executables of the task's own jitted fns (besides the update)."""
        return {"eval": self.eval_fn._cache_size()}

    @staticmethod
    def progress_postfix(metrics) -> dict[str, str]:
        return {"loss": f"{metrics['loss']:.4f}", "acc": f"{metrics.get('accuracy', float('nan')):.3f}"}

    @staticmethod
    def export(module, tokenizer, out_dir: str, workdir: str) -> str:
        """Write the reward model as an HF `*ForSequenceClassification` directory (LoRA: merged weights) with
        the tokenizer; returns the console line."""
        save_reward_model(module, tokenizer, out_dir)
        return f"exported the reward model to {out_dir} (use it as reward_model.model.path={workdir})"


def RewardModelTrainer(config, *, tracker: Tracking | None = None, console_write: Callable[[str], None] | None = None):
    """Bradley-Terry reward-model training (configs/reward_model.py): `SupervisedTrainer` with `RewardModelTask`.
    Args as `SupervisedTrainer`.

    Raises:
      ConfigError: invalid config (`validate_rm_config`), an unusable working directory, a missing data file,
        fewer pairs than `data.train_batch_size`; LoRA on a `*ForSequenceClassification` start.
      MalformedRowError: a malformed preference row (a non-numeric `margin` included) or an overlong pair
        (file and row named), before the model loads.
      CheckpointError: the checkpoint to resume from cannot be read or was not written by this trainer.
    """
    return SupervisedTrainer(RewardModelTask, config, tracker=tracker, console_write=console_write)
