"""The SFT task of the supervised trainer: its config checks, data, model, batch layout and loss step.

`SFTTask` is what `SupervisedTrainer` (sft/trainer.py) needs to run supervised fine-tuning: the examples of
`data.train_files` (`data/sft.py`: messages, prompt / completion or plain text; loss mask on the assistant /
completion tokens), the causal LM of `model.path` (`builders.build_actor_and_tokenizer`), the layout
(`sft_step.layout_batch`: one example per row, or packed rows with segment ids) and the jitted token-mean NLL
update and held-out evaluation (`sft_step.make_sft_update`, `sft_step.make_sft_eval`). Metrics: TRL's names
(`loss`, `mean_token_accuracy`, `num_loss_tokens`; validation `val/loss`, `val/perplexity`,
`val/mean_token_accuracy`).
"""

from __future__ import annotations

import math
import time

import jax

from jaxrl_post.data.sft import FORMATS, TRUNCATIONS, SFTKeys, load_sft_data
from jaxrl_post.engine.placement import Placement
from jaxrl_post.engine.row_packer import pack_rows
from jaxrl_post.engine.run import checkpoint as ckpt
from jaxrl_post.engine.train_state import OptimizedParams
from jaxrl_post.engine.trained_model import TrainedModel
from jaxrl_post.errors import Checker, ConfigError, pos_int
from jaxrl_post.models import save_pretrained
from jaxrl_post.rl import builders
from jaxrl_post.sft import sft_step
from jaxrl_post.sft.batches import SupervisedData, on_mesh


def is_positive_int(v) -> bool:
    """An int (not a bool) > 0."""
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


def check_batch(c: Checker) -> None:
    """`data.{train_batch_size, micro_batch_size, max_length}` positive ints, the batch a multiple of the
    micro-batch (SFT, DPO and the reward model share these)."""
    d = c.cfg.data
    keys = ("train_batch_size", "micro_batch_size", "max_length")
    ok = [c.check(f"data.{key}", pos_int, "must be an int > 0") for key in keys]
    if all(ok) and d.train_batch_size % d.micro_batch_size:
        c.add(
            f"data.train_batch_size={d.train_batch_size} must be a multiple of data.micro_batch_size="
            f"{d.micro_batch_size}"
        )


def check_run_length(c: Checker) -> None:
    """`trainer.total_epochs` (when no step count is set) and `trainer.resume_mode`."""
    cfg = c.cfg
    if cfg.trainer.total_training_steps is None and not is_positive_int(cfg.trainer.total_epochs):
        c.err("trainer.total_epochs", "must be an int > 0")
    if cfg.trainer.resume_mode not in ckpt.RESUME_MODES:
        c.err("trainer.resume_mode", f"must be one of {list(ckpt.RESUME_MODES)}")


def validate_sft_config(cfg) -> None:
    """Raise one `ConfigError` naming every bad SFT key (batch geometry, lengths, formats).

    Raises:
      ConfigError: `invalid SFT config:` and one `config.<key>...` line per problem.
    """
    c, d = Checker(cfg), cfg.data
    check_batch(c)
    c.check("data.format", lambda v: v in FORMATS, f"must be one of {list(FORMATS)}")
    if d.packing_strategy not in sft_step.PACKING_STRATEGIES:
        c.err("data.packing_strategy", f"must be one of {list(sft_step.PACKING_STRATEGIES)}")
    elif d.packing_strategy == "bfd" and not cfg.model.use_remove_padding:
        c.add("data.packing_strategy='bfd' packs examples into rows: it needs model.use_remove_padding=True")
    c.check("data.truncation", lambda v: v in TRUNCATIONS, f"must be one of {list(TRUNCATIONS)} for SFT")
    if not d.train_files:
        c.add("data.train_files: no training data given")
    check_run_length(c)
    c.raise_if_any("invalid SFT config")


class SFTTask:
    """Supervised fine-tuning as a task of `SupervisedTrainer` (see the module docstring and the task interface in
    sft/trainer.py). Built with the job config; `build_steps` makes its jitted fns once the model exists."""

    trainer_type = "sft"  # main.py's trainer_type; checkpoints record it (a DPO run cannot resume an SFT one)
    trainer_name = "SFTTrainer"  # the public name (api.TRAINERS), in error messages
    validate_config = staticmethod(validate_sft_config)

    def __init__(self, config, tokenizer):
        self.config, self.tokenizer = config, tokenizer
        self.data: SupervisedData | None = None
        self.placement: Placement | None = None
        self.eval_fn = None

    # ------------------------------------------------------------------------------------ data
    @staticmethod
    def load_data(cfg, tokenizer, spec: str, key: str):
        """The examples of `spec` (`data.load_sft_data`). Raises ConfigError naming `config.data.<key>` when a
        file does not exist; MalformedRowError for a malformed row or an overlong example."""
        d = cfg.data
        try:
            return load_sft_data(
                spec,
                tokenizer,
                fmt=d.format,
                keys=SFTKeys(d.messages_key, d.prompt_key, d.response_key),
                max_length=int(d.max_length),
                truncation=d.truncation,
                filter_overlong=bool(d.filter_overlong),
                skip_malformed=bool(d.skip_malformed),
            )
        except FileNotFoundError as e:
            raise ConfigError(f"config.data.{key}={spec!r}: {e}") from e

    @staticmethod
    def head(data, k: int):
        """The first `k` examples of `data` (`data.max_val_samples`)."""
        data.input_ids, data.loss_mask, data.where = data.input_ids[:k], data.loss_mask[:k], data.where[:k]
        return data

    @staticmethod
    def pack_dataset(cfg, data, row_len: int) -> list[list[int]] | None:
        """`data.packing_strategy='bfd'`: the training examples packed once into rows of `data.max_length`
        by best-fit decreasing (`row_packer.pack_rows(strategy="bfd")`, TRL's BFD); None for per-step packing."""
        if cfg.data.get("packing_strategy", "per_step") != "bfd":
            return None
        return pack_rows([len(x) for x in data.input_ids], row_len, strategy="bfd", skip_empty=True).rows()

    # ------------------------------------------------------------------------------------ model, steps
    def build_model(self, mesh):
        """The trained causal LM (`builders.build_actor_and_tokenizer`; the task's tokenizer already made the data)."""
        return builders.build_actor_and_tokenizer(self.config, mesh)[0]

    def build_steps(
        self, model: TrainedModel, state: OptimizedParams, placement: Placement, data: SupervisedData, say
    ) -> None:
        """The jitted update (on `model`) and eval functions, before a resume loads the checkpoint."""
        self.data, self.placement = data, placement
        update = sft_step.make_sft_update(model.graphdef, model.rest, model.tx, on_trace=placement.tracer("update"))
        model.set_update(update, placement, state)
        on_trace = placement.tracer("eval")
        self.eval_fn = jax.jit(sft_step.make_sft_eval(model.graphdef, model.rest, on_trace=on_trace))

    def _batch(self, ids, masks, plan=None) -> dict[str, jax.Array]:
        """Layout (`sft_step.layout_batch`; `plan`: rows already packed) placed on the mesh: rows over
        ('data', 'fsdp', 'expert')."""
        d = self.data
        arrays = sft_step.layout_batch(
            ids, masks, n_micro=d.n_micro, rows=d.rows, row_len=d.row_len, pack=d.pack, plan=plan
        )
        return on_mesh(self.placement, arrays, self.config.data.micro_batch_size)

    # ------------------------------------------------------------------------------------ steps
    def train_batch(self, idx, plan, params, frozen: tuple) -> tuple[dict[str, jax.Array], tuple, int]:
        """One step's batch of the examples `idx` (bfd: `plan`), the update's trailing arguments and the step's
        input tokens."""
        t = self.data.train
        ids = [t.input_ids[i] for i in idx]
        batch = self._batch(ids, [t.loss_mask[i] for i in idx], plan)
        return batch, frozen, int(sum(len(x) for x in ids))

    def validate(self, params, frozen: tuple) -> dict[str, float]:
        """Held-out `val/loss` (NLL per loss token over all of `data.val_files`), `val/perplexity`,
        `val/mean_token_accuracy`, `timing_s/testing`. Raises RuntimeError without validation data."""
        v, size = self.data.val, self.data.batch_size
        if v is None:
            raise RuntimeError("no validation data: set data.val_files")
        t0 = time.perf_counter()
        nll = hits = n = 0.0
        for lo in range(0, len(v), size):
            batch = self._batch(v.input_ids[lo : lo + size], v.loss_mask[lo : lo + size])
            a, b, c = (float(x) for x in jax.device_get(self.eval_fn(params, batch, *frozen)))
            nll, hits, n = nll + a, hits + b, n + c
        loss = nll / max(n, 1.0)
        return {
            "val/loss": loss,
            "val/perplexity": math.exp(min(loss, 700.0)),
            "val/mean_token_accuracy": hits / max(n, 1.0),
            "timing_s/testing": time.perf_counter() - t0,
        }

    def compile_counts(self) -> dict[str, int]:
        """Compiled executables of the task's own jitted fns (besides the update)."""
        return {"eval": self.eval_fn._cache_size()}

    @staticmethod
    def progress_postfix(metrics) -> dict[str, str]:
        return {"loss": f"{metrics['loss']:.4f}"}

    @staticmethod
    def export(module, tokenizer, out_dir: str, workdir: str) -> str:
        """Write `module` as a Hugging Face causal-LM directory with the tokenizer; returns the console line."""
        save_pretrained(module, tokenizer, out_dir)
        return f"exported the model to {out_dir} (use it as model.path={workdir})"
