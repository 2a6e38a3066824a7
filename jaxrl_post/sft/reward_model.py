"""`RewardModelTrainer`: Bradley-Terry reward-model training on preference pairs (TRL `RewardTrainer`).

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

Everything else is `SFTTrainer`'s (subclassed): mesh, optimizer and LR schedule, the shared loop, checkpoints
and exact resume, the non-finite guard, `metrics.jsonl`. Packing (chosen and rejected sharing one prompt copy)
is not implemented: `model.use_remove_padding` is ignored (padded rows).
"""

from __future__ import annotations

import json
import logging
import os
import time

import jax
import numpy as np
from flax import nnx

from jaxrl_post.errors import ConfigError
from jaxrl_post.rl import builders
from jaxrl_post.sft import rm_step
from jaxrl_post.sft.dpo import DPOTrainer, pair_config_errors, pair_tokens
from jaxrl_post.sft.trainer import HF_EXPORT_SUBDIR, SFTTrainer

log = logging.getLogger(__name__)


def validate_rm_config(cfg) -> None:
    """Raise one `ConfigError` naming every bad key (`dpo.pair_config_errors`, then the loss options)."""
    r, bad = cfg.rm, pair_config_errors(cfg)
    c = r.center_rewards_coefficient
    if c is not None and not (isinstance(c, (int, float)) and not isinstance(c, bool) and c >= 0):
        bad.append(f"rm.center_rewards_coefficient={c!r}: must be None or a number >= 0")
    if cfg.data.get("packing_strategy", "per_step") == "bfd":
        bad.append("data.packing_strategy='bfd': not built for reward-model training; use 'per_step'")
    if bad:
        raise ConfigError("invalid reward-model config:\n  " + "\n  ".join(f"config.{b}" for b in bad))


def _is_seq_cls_dir(path) -> bool:
    cfg_file = os.path.join(os.path.expanduser(str(path or "")), "config.json")
    if not os.path.isfile(cfg_file):
        return False
    with open(cfg_file) as f:
        archs = json.load(f).get("architectures") or []
    return any(a.endswith("ForSequenceClassification") for a in archs)


class RewardModelTrainer(SFTTrainer):
    """Bradley-Terry reward-model training driven by a job ConfigDict (configs/reward_model.py).

    Args: as `SFTTrainer` (config, tracker, console_write).

    Raises:
      ConfigError: invalid config (`validate_rm_config`), an unusable working directory, a missing data file,
        fewer pairs than `data.train_batch_size`; LoRA on a `*ForSequenceClassification` start.
      MalformedRowError: a malformed preference row (a non-numeric `margin` included) or an overlong pair
        (file and row named), before the model loads.
      CheckpointError: the checkpoint to resume from cannot be read or was not written by this trainer.
    """

    TRAINER_TYPE = "reward_model"
    validate_config = staticmethod(validate_rm_config)
    _load_data = DPOTrainer._load_data
    _head = staticmethod(DPOTrainer._head)

    def _build_model(self):
        """`RewardModel` from `model.path`: an HF `*ForSequenceClassification` dir as it is, else the causal
        LM's backbone with a fresh `score` head (seeded by `trainer.seed`). LoRA: `score` trains too."""
        from jaxrl_post.models.hf_io import load_reward_model
        from jaxrl_post.models.reward_model import RewardModel

        cfg = self.config
        if not cfg.model.random_init and _is_seq_cls_dir(cfg.model.path):
            if cfg.model.lora_rank:
                raise ConfigError("model.lora_rank: LoRA on a *ForSequenceClassification start is not supported")
            mesh = self.mesh if self.mesh.size > 1 else None
            rm = load_reward_model(cfg.model.path, cfg.model.dtype, mesh, param_dtype=cfg.model.param_dtype)
        else:
            backbone = builders.build_actor_and_tokenizer(cfg, self.mesh)[0]
            rm = RewardModel(rngs=nnx.Rngs(int(cfg.trainer.seed) + 1), backbone=backbone)
            if cfg.model.lora_rank:  # PEFT modules_to_save=["score"]: the head trains with the adapters
                rm.train_score_with_adapters()
        rm.pad_token_id = self.tokenizer.pad_token_id  # pooled as transformers will with the exported config
        if self.pack:
            log.warning("reward model: packed pairs are not implemented; model.use_remove_padding is ignored")
        return rm

    def _build_steps(self, graphdef, rest) -> None:
        c = self.config.rm.center_rewards_coefficient
        kw = dict(center_coef=None if c is None else float(c))
        update = rm_step.make_rm_update(graphdef, rest, self.tx, on_trace=self.placement.tracer("update"), **kw)
        self._update = self.placement.jit_update(update, self.actor_params, self.actor_opt_state)
        self._eval = jax.jit(rm_step.make_rm_eval(graphdef, rest, on_trace=self.placement.tracer("eval"), **kw))
        self.pairs_per_micro = int(self.config.data.micro_batch_size)

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
            row_len=self.row_len,
            pad_id=int(self.tokenizer.pad_token_id or 0),
        )
        return self._on_mesh(arrays, row_keys=rm_step.RM_TOKEN_KEYS)

    # ------------------------------------------------------------------------------------ steps
    def train_step(self) -> dict[str, float]:
        """One optimizer step on the next `data.train_batch_size` pairs; returns its metrics."""
        t0 = time.perf_counter()
        idx = next(self.train_loader)
        pairs = [self.train_data.pairs[i] for i in idx]
        batch = self._layout(pairs)
        return self._apply_update(
            batch,
            self._frozen(),
            pair_tokens(pairs),
            t0,
        )

    def validate(self) -> dict[str, float]:
        """`val/loss`, `val/accuracy` (held-out pair accuracy), `val/margin`, `val/mean_reward`,
        `val/min_reward`, `val/max_reward` over every pair of `data.val_files` (first `data.max_val_samples`),
        and `timing_s/testing`. Raises RuntimeError without validation data."""
        if self.val_data is None:
            raise RuntimeError("no validation data: set data.val_files")
        t0 = time.perf_counter()
        v = self.val_data
        loss = acc = margin = rsum = 0.0
        lo_r, hi_r = np.inf, -np.inf
        for lo in range(0, len(v), self.batch_size):
            chunk = v.pairs[lo : lo + self.batch_size]
            if len(chunk) % self.pairs_per_micro:  # a ragged last batch: score its pairs one micro-batch at a time
                parts = [chunk[i : i + 1] * self.pairs_per_micro for i in range(len(chunk))]
                scale = 1.0 / self.pairs_per_micro
            else:
                parts, scale = [chunk], 1.0
            for part in parts:
                l_sum, s = jax.device_get(self._eval(self.actor_params, self._layout(part), *self._frozen()))
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

    def export_hf(self, out_dir: str | None = None) -> str:
        """Write the reward model as an HF `*ForSequenceClassification` directory (default
        `<run dir>/huggingface/`; LoRA: merged weights) with the tokenizer; returns its path."""
        from jaxrl_post.models.hf_io import save_reward_model

        out_dir = out_dir or os.path.join(self.workdir, HF_EXPORT_SUBDIR)
        self.sync_weights()
        save_reward_model(self.actor_model, self.tokenizer, out_dir)
        self._say(f"exported the reward model to {out_dir} (use it as reward_model.model.path={self.workdir})")
        return out_dir

    @staticmethod
    def progress_postfix(metrics) -> dict[str, str]:
        return {"loss": f"{metrics['loss']:.4f}", "acc": f"{metrics.get('accuracy', float('nan')):.3f}"}
