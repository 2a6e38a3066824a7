"""`DPOTrainer`: direct preference optimization on the SFT trainer's models, loop, checkpoints and export.

    python -m jaxrl_post.main --config=configs/dpo.py              (config key trainer_type = 'dpo')

Per training step: the next `data.train_batch_size` preference pairs (`data/preference.py`; grain: shuffled
each epoch, the position is checkpointed) -> `dpo_step.layout_pairs` (`model.use_remove_padding`: prompt |
chosen | rejected packed per pair with one prompt copy, many pairs per row; else TRL's padded layout) -> one
jitted update (`dpo_step.make_dpo_update`: the DPO loss, mean over the batch's pairs, micro-batches
accumulated inside the jit) -> metrics (TRL names: `loss`, `rewards/chosen`, `rewards/rejected`,
`rewards/accuracies`, `rewards/margins`, `logps/chosen`, `logps/rejected`, `grad_norm`, `learning_rate`,
`num_tokens`, `epoch`). Validation: the same quantities over `data.val_files` as `val/loss`, `val/rewards/...`.

The reference policy is the initial model and never trains: with LoRA the same model with its adapters off (no
copy), else a frozen copy of the initial params in the compute dtype (`builders.reference_params`). Its
log-probs are computed per step inside the update (`dpo.precompute_ref_log_probs=False`, default) or once for
the whole dataset before the first step (True; TRL's `precompute_ref_log_probs`). A resumed run rebuilds the
reference from `model.path` (it is not checkpointed).

Everything else is `SFTTrainer`'s (this class subclasses it): model / LoRA / mesh / optimizer building, the
shared loop (`engine/loop.py`), checkpoints and exact resume, the non-finite guard, `metrics.jsonl`, the HF
export after the last step (`<run dir>/huggingface/`, a `model.path` for RL or another DPO round).
"""

from __future__ import annotations

import logging
import time

import jax
import numpy as np

from jaxrl_post.engine.run import checkpoint as ckpt
from jaxrl_post.errors import ConfigError
from jaxrl_post.rl import builders
from jaxrl_post.sft import dpo_step, sft_step
from jaxrl_post.sft.trainer import SFTTrainer

log = logging.getLogger(__name__)

DPO_KEYS = ("beta", "loss_type", "label_smoothing", "precompute_ref_log_probs")


def pair_tokens(pairs) -> int:
    """Input tokens of `pairs` as the two sequences of a pair (prompt + chosen, prompt + rejected)."""
    return int(sum(2 * len(x.prompt_ids) + len(x.chosen_ids) + len(x.rejected_ids) for x in pairs))


def pair_config_errors(cfg) -> list[str]:
    """The checks DPO and reward-model training share (they read the same preference pairs): batch geometry,
    lengths, truncation, training files, epochs, resume mode. Returns one `key=value: what is wrong` per bad key."""
    from jaxrl_post.data.preference import TRUNCATIONS

    d, bad = cfg.data, []
    is_pos = lambda v: isinstance(v, int) and not isinstance(v, bool) and v > 0
    for key in ("train_batch_size", "micro_batch_size", "max_length"):
        if not is_pos(d[key]):
            bad.append(f"data.{key}={d[key]!r}: must be an int > 0")
    if not bad and d.train_batch_size % d.micro_batch_size:
        bad.append(
            f"data.train_batch_size={d.train_batch_size} must be a multiple of data.micro_batch_size="
            f"{d.micro_batch_size}"
        )
    if d.max_prompt_length is not None and not (is_pos(d.max_prompt_length) and d.max_prompt_length < d.max_length):
        bad.append(f"data.max_prompt_length={d.max_prompt_length!r}: must be None or an int in [1, data.max_length)")
    if d.get("packing_strategy", "per_step") not in sft_step.PACKING_STRATEGIES:
        bad.append(f"data.packing_strategy={d.packing_strategy!r}: must be one of {list(sft_step.PACKING_STRATEGIES)}")
    elif d.get("packing_strategy") == "bfd" and not cfg.model.use_remove_padding:
        bad.append("data.packing_strategy='bfd' packs pairs into rows: it needs model.use_remove_padding=True")
    if d.truncation not in TRUNCATIONS:
        bad.append(f"data.truncation={d.truncation!r}: must be one of {list(TRUNCATIONS)} for preference data")
    if not d.train_files:
        bad.append("data.train_files: no training data given (a .jsonl of prompt / chosen / rejected rows)")
    if cfg.trainer.total_training_steps is None and not is_pos(cfg.trainer.total_epochs):
        bad.append(f"trainer.total_epochs={cfg.trainer.total_epochs!r}: must be an int > 0")
    if cfg.trainer.resume_mode not in ckpt.RESUME_MODES:
        bad.append(f"trainer.resume_mode={cfg.trainer.resume_mode!r}: must be one of {list(ckpt.RESUME_MODES)}")
    return bad


def validate_dpo_config(cfg) -> None:
    """Raise one `ConfigError` naming every bad DPO key (`pair_config_errors`, then the loss options)."""
    p, bad = cfg.dpo, pair_config_errors(cfg)
    if p.loss_type not in dpo_step.LOSS_TYPES:
        bad.append(f"dpo.loss_type={p.loss_type!r}: must be one of {list(dpo_step.LOSS_TYPES)}")
    if not (isinstance(p.beta, (int, float)) and p.beta > 0):
        bad.append(f"dpo.beta={p.beta!r}: must be > 0")
    if not 0.0 <= float(p.label_smoothing) < 0.5:
        bad.append(f"dpo.label_smoothing={p.label_smoothing!r}: must be in [0, 0.5)")
    elif p.loss_type == "ipo" and p.label_smoothing:
        bad.append("dpo.label_smoothing: not used by loss_type='ipo'; set it to 0 (or use 'sigmoid' / 'robust')")
    if bad:
        raise ConfigError("invalid DPO config:\n  " + "\n  ".join(f"config.{b}" for b in bad))


class DPOTrainer(SFTTrainer):
    """DPO driven by a job ConfigDict (configs/dpo.py).

    Args: as `SFTTrainer` (config, tracker, console_write).

    Raises:
      ConfigError: invalid config (`validate_dpo_config`), an unusable working directory, a missing data file,
        fewer pairs than `data.train_batch_size`.
      MalformedRowError: a malformed preference row or an overlong pair (file and row named), before the model
        loads.
      CheckpointError: the checkpoint to resume from cannot be read or was not written by a DPO run.
    """

    TRAINER_TYPE = "dpo"
    validate_config = staticmethod(validate_dpo_config)

    # ------------------------------------------------------------------------------------ hooks
    def _load_data(self, spec: str, key: str):
        """The preference pairs of `spec`. Raises ConfigError naming `config.data.<key>` for a missing file."""
        from jaxrl_post.data.preference import load_preference_pairs

        d = self.config.data
        try:
            return load_preference_pairs(
                spec,
                self.tokenizer,
                max_length=int(d.max_length),
                max_prompt_length=None if d.max_prompt_length is None else int(d.max_prompt_length),
                truncation=d.truncation,
                filter_overlong=bool(d.filter_overlong),
                skip_malformed=bool(d.skip_malformed),
            )
        except FileNotFoundError as e:
            raise ConfigError(f"config.data.{key}={spec!r}: {e}") from e

    @staticmethod
    def _head(data, k: int):
        data.pairs = data.pairs[:k]
        return data

    def _pack_dataset(self) -> list[list[int]] | None:
        """`data.packing_strategy='bfd'`: the training pairs (each `prompt | chosen | rejected`, one chunk) packed
        once into rows of 2 * `data.max_length` tokens by best-fit decreasing (`sft_step.best_fit_decreasing`);
        batch sizes then count packed rows. None for per-step packing."""
        if self.config.data.get("packing_strategy", "per_step") != "bfd":
            return None
        need = [len(x.prompt_ids) + len(x.chosen_ids) + len(x.rejected_ids) for x in self.train_data.pairs]
        return sft_step.best_fit_decreasing(need, 2 * self.row_len)

    def _build_steps(self, graphdef, rest) -> None:
        """Reference, layout geometry and the jitted update / eval / reference log-prob functions."""
        cfg = self.config
        p = cfg.dpo
        if self.pack and self.actor_model.attention_impl == "splash":
            log.warning("DPO: shared-prompt packing needs segment masks that splash lacks; using the padded layout")
            self.pack = False
        m = int(cfg.data.micro_batch_size)
        self.pairs_per_micro = m
        # bfd: a micro-batch is m packed rows; its pair slots cover the m fullest rows of the dataset (and a
        # per-step layout of batch_size pairs: validation, precomputed reference log-probs)
        fullest = sorted((len(r) for r in self.packed_rows or ()), reverse=True)[:m]
        self.pair_slots = None if self.packed_rows is None else max(sum(fullest), self.n_micro * m)
        self.pair_row_len = 2 * self.row_len if self.pack else self.row_len  # packed: any pair fits one row
        self.ref_params = None
        if self.lora is None:
            self.ref_params = self.placement.commit(
                builders.reference_params(self.actor_params, self.actor_model.dtype)
            )
        self.precompute = bool(p.precompute_ref_log_probs)
        kw = dict(
            beta=float(p.beta),
            loss_type=p.loss_type,
            label_smoothing=float(p.label_smoothing),
            precomputed=self.precompute,
        )
        update = dpo_step.make_dpo_update(graphdef, rest, self.tx, on_trace=self.placement.tracer("update"), **kw)
        self._update = self.placement.jit_update(update, self.actor_params, self.actor_opt_state)
        self._eval = jax.jit(dpo_step.make_dpo_eval(graphdef, rest, on_trace=self.placement.tracer("eval"), **kw))
        self._ref_fn = jax.jit(dpo_step.make_ref_logps(graphdef, rest, on_trace=self.placement.tracer("ref")))
        self._ref_cache: dict[str, np.ndarray] = {}

    # ------------------------------------------------------------------------------------ batches
    def _layout(self, pairs, ref_logps=None, plan=None) -> dict[str, jax.Array]:
        arrays = dpo_step.layout_pairs(
            pairs,
            n_micro=self.n_micro,
            pairs_per_micro=self.pairs_per_micro,
            row_len=self.pair_row_len,
            pack=self.pack,
            ref_logps=ref_logps,
            plan=plan,
            pair_slots=self.pair_slots,
        )
        return self._on_mesh(arrays, row_keys=dpo_step.TOKEN_KEYS)

    def _ref_args(self) -> tuple:
        return (self.ref_params,) + self._frozen()

    def reference_logps(self, name: str) -> np.ndarray:
        """`[N, 2] float32`: the reference's (chosen, rejected) log-probs of every pair of the train ('train') or
        validation ('val') data, computed once (`dpo.precompute_ref_log_probs`) in batches of the train layout."""
        if name not in self._ref_cache:
            t0 = time.perf_counter()
            data = self.train_data if name == "train" else self.val_data
            out = np.zeros((len(data), 2), np.float32)
            for lo in range(0, len(data), self.batch_size):
                chunk = data.pairs[lo : lo + self.batch_size]
                batch = self._layout(chunk)
                logps = np.asarray(jax.device_get(self._ref_fn(self.actor_params, batch, *self._ref_args())))
                idx = np.asarray(jax.device_get(batch["pair_index"]))
                q = idx.shape[1]
                for k in range(idx.shape[0]):
                    for j in np.flatnonzero(idx[k] >= 0):
                        out[lo + idx[k, j]] = logps[k, j], logps[k, q + j]
            self._ref_cache[name] = out
            self._say(f"reference log-probs of {len(data)} {name} pairs: {time.perf_counter() - t0:.1f} s")
        return self._ref_cache[name]

    # ------------------------------------------------------------------------------------ steps
    def train_step(self) -> dict[str, float]:
        """One optimizer step on the next `data.train_batch_size` pairs; returns its metrics."""
        t0 = time.perf_counter()
        idx, plan = next(self.train_loader), None
        if self.packed_rows is not None:  # bfd: rows -> their pairs
            idx, plan = self._unpack_rows(idx)
        pairs = [self.train_data.pairs[i] for i in idx]
        ref = self.reference_logps("train")[idx] if self.precompute else None
        batch = self._layout(pairs, ref, plan)
        return self._apply_update(
            batch,
            self._ref_args(),
            pair_tokens(pairs),
            t0,
        )

    def validate(self) -> dict[str, float]:
        """`val/loss` and `val/<metric>` (`dpo_step.METRIC_KEYS`): means over every pair of `data.val_files`
        (first `data.max_val_samples`), `timing_s/testing`. Raises RuntimeError without validation data."""
        if self.val_data is None:
            raise RuntimeError("no validation data: set data.val_files")
        t0 = time.perf_counter()
        v = self.val_data
        ref = self.reference_logps("val") if self.precompute else None
        totals = dict.fromkeys(("loss",) + dpo_step.METRIC_KEYS, 0.0)
        for lo in range(0, len(v), self.batch_size):
            chunk = v.pairs[lo : lo + self.batch_size]
            batch = self._layout(chunk, None if ref is None else ref[lo : lo + self.batch_size])
            loss, sums = jax.device_get(self._eval(self.actor_params, batch, *self._ref_args()))
            for k, x in {"loss": loss, **sums}.items():
                totals[k] += float(x) * len(chunk)
        out = {f"val/{k}": x / max(len(v), 1) for k, x in totals.items()}
        out["timing_s/testing"] = time.perf_counter() - t0
        return out

    def compile_counts(self) -> dict[str, int]:
        """Compiled executables per jitted function (1 each after any number of same-shaped steps)."""
        return {
            "update": self._update._cache_size(),
            "eval": self._eval._cache_size(),
            "ref": self._ref_fn._cache_size(),
        }
