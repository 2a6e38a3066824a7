"""DPO as a task of the supervised trainer (`DPOTask`; `DPOTrainer` builds `SupervisedTrainer` with it).

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

Everything else is `SupervisedTrainer`'s (sft/trainer.py): model / LoRA / mesh / optimizer building, the
shared loop (`engine/loop.py`), checkpoints and exact resume, the non-finite guard, `metrics.jsonl`, the HF
export after the last step (`<run dir>/huggingface/`, a `model.path` for RL or another DPO round). The
preference-pair reader and checks here (`load_pairs`, `head_pairs`, `check_pair_config`, `pair_tokens`) are the
reward-model task's too.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import jax
import numpy as np

from jaxrl_post.data.preference import TRUNCATIONS, load_preference_pairs
from jaxrl_post.engine.placement import Placement
from jaxrl_post.engine.row_packer import pack_rows
from jaxrl_post.engine.run.tracking import Tracking
from jaxrl_post.engine.train_state import OptimizedParams
from jaxrl_post.engine.trained_model import TrainedModel
from jaxrl_post.errors import Checker, ConfigError
from jaxrl_post.rl import builders
from jaxrl_post.sft import dpo_step, sft_step
from jaxrl_post.sft.batches import SupervisedData, on_mesh
from jaxrl_post.sft.sft_task import SFTTask, check_batch, check_run_length, is_positive_int
from jaxrl_post.sft.trainer import SupervisedTrainer

log = logging.getLogger(__name__)

DPO_KEYS = ("beta", "loss_type", "label_smoothing", "precompute_ref_log_probs")


def pair_tokens(pairs) -> int:
    """Input tokens of `pairs` as the two sequences of a pair (prompt + chosen, prompt + rejected)."""
    return int(sum(2 * len(x.prompt_ids) + len(x.chosen_ids) + len(x.rejected_ids) for x in pairs))


def check_pair_config(c: Checker) -> None:
    """The checks DPO and reward-model training share (they read the same preference pairs): batch geometry,
    lengths, truncation, training files, epochs, resume mode."""
    cfg, d = c.cfg, c.cfg.data
    check_batch(c)
    if d.max_prompt_length is not None and not (
        is_positive_int(d.max_prompt_length) and d.max_prompt_length < d.max_length
    ):
        c.err("data.max_prompt_length", "must be None or an int in [1, data.max_length)")
    if d.get("packing_strategy", "per_step") not in sft_step.PACKING_STRATEGIES:
        c.err("data.packing_strategy", f"must be one of {list(sft_step.PACKING_STRATEGIES)}")
    elif d.get("packing_strategy") == "bfd" and not cfg.model.use_remove_padding:
        c.add("data.packing_strategy='bfd' packs pairs into rows: it needs model.use_remove_padding=True")
    c.check("data.truncation", lambda v: v in TRUNCATIONS, f"must be one of {list(TRUNCATIONS)} for preference data")
    if not d.train_files:
        c.add("data.train_files: no training data given (a .jsonl of prompt / chosen / rejected rows)")
    check_run_length(c)


def validate_dpo_config(cfg) -> None:
    """Raise one `ConfigError` naming every bad DPO key (`check_pair_config`, then the loss options).

    Raises:
      ConfigError: `invalid DPO config:` and one `config.<key>...` line per problem.
    """
    c, p = Checker(cfg), cfg.dpo
    check_pair_config(c)
    c.check("dpo.loss_type", lambda v: v in dpo_step.LOSS_TYPES, f"must be one of {list(dpo_step.LOSS_TYPES)}")
    if not (isinstance(p.beta, (int, float)) and p.beta > 0):
        c.err("dpo.beta", "must be > 0")
    if not 0.0 <= float(p.label_smoothing) < 0.5:
        c.err("dpo.label_smoothing", "must be in [0, 0.5)")
    elif p.loss_type == "ipo" and p.label_smoothing:
        c.add("dpo.label_smoothing: not used by loss_type='ipo'; set it to 0 (or use 'sigmoid' / 'robust')")
    c.raise_if_any("invalid DPO config")


def load_pairs(cfg, tokenizer, spec: str, key: str):
    """The preference pairs of `spec` (`data.load_preference_pairs`). Raises ConfigError naming
    `config.data.<key>` for a missing file; MalformedRowError for a malformed row or an overlong pair."""
    d = cfg.data
    try:
        return load_preference_pairs(
            spec,
            tokenizer,
            max_length=int(d.max_length),
            max_prompt_length=None if d.max_prompt_length is None else int(d.max_prompt_length),
            truncation=d.truncation,
            filter_overlong=bool(d.filter_overlong),
            skip_malformed=bool(d.skip_malformed),
        )
    except FileNotFoundError as e:
        raise ConfigError(f"config.data.{key}={spec!r}: {e}") from e


def head_pairs(data, k: int):
    """The first `k` pairs of `data` (`data.max_val_samples`)."""
    data.pairs = data.pairs[:k]
    return data


class DPOTask:
    """DPO as a task of `SupervisedTrainer` (module docstring; the task interface in sft/trainer.py)."""

    trainer_type = "dpo"
    trainer_name = "DPOTrainer"
    validate_config = staticmethod(validate_dpo_config)
    load_data = staticmethod(load_pairs)
    head = staticmethod(head_pairs)
    build_model = SFTTask.build_model  # the policy's causal LM
    export = staticmethod(SFTTask.export)

    def __init__(self, config, tokenizer):
        self.config, self.tokenizer = config, tokenizer
        self.data: SupervisedData | None = None
        self.placement: Placement | None = None
        self.geometry: dict = {}  # layout_pairs' keyword arguments (`build_steps`)
        self.ref_params = None  # the frozen reference (None with LoRA: the adapters off)
        self.fns: dict[str, Callable] = {}  # jitted `eval` and `ref` (the update is the model's)
        self._ref_cache: dict[str, np.ndarray] = {}
        self._say: Callable[[str], None] = print

    @staticmethod
    def pack_dataset(cfg, data, row_len: int) -> list[list[int]] | None:
        """`data.packing_strategy='bfd'`: the training pairs (each `prompt | chosen | rejected`, one chunk) packed
        once into rows of 2 * `data.max_length` tokens by best-fit decreasing (`row_packer.pack_rows(strategy="bfd")`);
        batch sizes then count packed rows. None for per-step packing."""
        if cfg.data.get("packing_strategy", "per_step") != "bfd":
            return None
        need = [len(x.prompt_ids) + len(x.chosen_ids) + len(x.rejected_ids) for x in data.pairs]
        return pack_rows(need, 2 * row_len, strategy="bfd", skip_empty=True).rows()

    def build_steps(
        self, model: TrainedModel, state: OptimizedParams, placement: Placement, data: SupervisedData, say
    ) -> None:
        """Reference, layout geometry and the jitted update (on `model`) / eval / reference log-prob functions."""
        self.data, self.placement, self._say = data, placement, say
        p = self.config.dpo
        pack = data.pack
        if pack and model.module.attention_impl == "splash":
            log.warning("DPO: shared-prompt packing needs segment masks that splash lacks; using the padded layout")
            pack = False
        m = int(self.config.data.micro_batch_size)
        # bfd: a micro-batch is m packed rows; its pair slots cover the m fullest rows of the dataset (and a
        # per-step layout of batch_size pairs: validation, precomputed reference log-probs)
        fullest = sorted((len(r) for r in data.packed_rows or ()), reverse=True)[:m]
        self.geometry = dict(
            n_micro=data.n_micro,
            pairs_per_micro=m,
            row_len=2 * data.row_len if pack else data.row_len,  # packed: any pair fits one row
            pack=pack,
            pair_slots=None if data.packed_rows is None else max(sum(fullest), data.n_micro * m),
        )
        if model.lora is None:
            self.ref_params = placement.commit(builders.reference_params(state.params, model.module.dtype))
        kw = dict(
            beta=float(p.beta),
            loss_type=p.loss_type,
            label_smoothing=float(p.label_smoothing),
            precomputed=bool(p.precompute_ref_log_probs),
        )
        g, r, tr = model.graphdef, model.rest, placement.tracer
        model.set_update(dpo_step.make_dpo_update(g, r, model.tx, on_trace=tr("update"), **kw), placement, state)
        self.fns = {
            "eval": jax.jit(dpo_step.make_dpo_eval(g, r, on_trace=tr("eval"), **kw)),
            "ref": jax.jit(dpo_step.make_ref_logps(g, r, on_trace=tr("ref"))),
        }

    @property
    def precompute(self) -> bool:
        """`dpo.precompute_ref_log_probs`: the reference's log-probs computed once, before the first step."""
        return bool(self.config.dpo.precompute_ref_log_probs)

    # ------------------------------------------------------------------------------------ batches
    def _layout(self, pairs, ref_logps=None, plan=None) -> dict[str, jax.Array]:
        arrays = dpo_step.layout_pairs(pairs, ref_logps=ref_logps, plan=plan, **self.geometry)
        return on_mesh(self.placement, arrays, self.config.data.micro_batch_size, row_keys=dpo_step.TOKEN_KEYS)

    def _ref_args(self, frozen: tuple) -> tuple:
        return (self.ref_params,) + frozen

    def reference_logps(self, name: str, params, frozen: tuple) -> np.ndarray:
        """`[N, 2] float32`: the reference's (chosen, rejected) log-probs of every pair of the train ('train') or
        validation ('val') data, computed once (`dpo.precompute_ref_log_probs`) in batches of the train layout."""
        if name not in self._ref_cache:
            t0 = time.perf_counter()
            data = self.data.train if name == "train" else self.data.val
            size = self.data.batch_size
            out = np.zeros((len(data), 2), np.float32)
            for lo in range(0, len(data), size):
                batch = self._layout(data.pairs[lo : lo + size])
                logps = np.asarray(jax.device_get(self.fns["ref"](params, batch, *self._ref_args(frozen))))
                idx = np.asarray(jax.device_get(batch["pair_index"]))
                q = idx.shape[1]
                for k in range(idx.shape[0]):
                    for j in np.flatnonzero(idx[k] >= 0):
                        out[lo + idx[k, j]] = logps[k, j], logps[k, q + j]
            self._ref_cache[name] = out
            self._say(f"reference log-probs of {len(data)} {name} pairs: {time.perf_counter() - t0:.1f} s")
        return self._ref_cache[name]

    # ------------------------------------------------------------------------------------ steps
    def train_batch(self, idx, plan, params, frozen: tuple) -> tuple[dict[str, jax.Array], tuple, int]:
        """One step's batch of the pairs `idx` (bfd: `plan`), the update's trailing arguments (reference params,
        LoRA base) and the step's input tokens (`pair_tokens`)."""
        pairs = [self.data.train.pairs[i] for i in idx]
        ref = self.reference_logps("train", params, frozen)[idx] if self.precompute else None
        return self._layout(pairs, ref, plan), self._ref_args(frozen), pair_tokens(pairs)

    def validate(self, params, frozen: tuple) -> dict[str, float]:
        """`val/loss` and `val/<metric>` (`dpo_step.METRIC_KEYS`): means over every pair of `data.val_files`
        (first `data.max_val_samples`), `timing_s/testing`. Raises RuntimeError without validation data."""
        v, size = self.data.val, self.data.batch_size
        if v is None:
            raise RuntimeError("no validation data: set data.val_files")
        t0 = time.perf_counter()
        ref = self.reference_logps("val", params, frozen) if self.precompute else None
        totals = dict.fromkeys(("loss",) + dpo_step.METRIC_KEYS, 0.0)
        for lo in range(0, len(v), size):
            chunk = v.pairs[lo : lo + size]
            batch = self._layout(chunk, None if ref is None else ref[lo : lo + size])
            loss, sums = jax.device_get(self.fns["eval"](params, batch, *self._ref_args(frozen)))
            for k, x in {"loss": loss, **sums}.items():
                totals[k] += float(x) * len(chunk)
        out = {f"val/{k}": x / max(len(v), 1) for k, x in totals.items()}
        out["timing_s/testing"] = time.perf_counter() - t0
        return out

    def compile_counts(self) -> dict[str, int]:
        """Compiled executables of the task's own jitted fns (besides the update)."""
        return {k: f._cache_size() for k, f in self.fns.items()}

    progress_postfix = staticmethod(SFTTask.progress_postfix)


def DPOTrainer(config, *, tracker: Tracking | None = None, console_write: Callable[[str], None] | None = None):
    """DPO (configs/dpo.py): `SupervisedTrainer` with `DPOTask`. Args as `SupervisedTrainer`.

    Raises:
      ConfigError: invalid config (`validate_dpo_config`), an unusable working directory, a missing data file,
        fewer pairs than `data.train_batch_size`.
      MalformedRowError: a malformed preference row or an overlong pair (file and row named), before the model
        loads.
      CheckpointError: the checkpoint to resume from cannot be read or was not written by a DPO run.
    """
    return SupervisedTrainer(DPOTask, config, tracker=tracker, console_write=console_write)
