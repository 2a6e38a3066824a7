"""`SFTTrainer`: supervised fine-tuning on the RL trainer's models, packing, sharding and checkpoints.

    python -m jaxrl_post.main --config=configs/sft.py:gsm8k      (config key trainer_type = 'sft')

Per training step: the next `data.train_batch_size` examples (grain: shuffled each epoch, the position is
checkpointed) -> `sft_step.layout_batch` (packed rows with segment ids when `model.use_remove_padding`, else one
example per row; `data.packing_strategy='bfd'`: the dataset is packed into rows once, TRL's best-fit decreasing,
and a step takes the next `data.train_batch_size` packed rows) -> one jitted update (`sft_step.make_sft_update`:
token-mean NLL over the whole batch's loss tokens, micro-batches accumulated inside the jit, params and optimizer
state donated) -> metrics (TRL names: `loss`, `mean_token_accuracy`, `grad_norm`, `learning_rate`, `num_tokens`,
`epoch`) -> console + metrics.jsonl (`Tracking`). Validation (`trainer.test_freq`, before / after training):
`val/loss`, `val/perplexity` = exp(val/loss), `val/mean_token_accuracy` over `data.val_files` (all held-out loss
tokens).

What is shared with `RLTrainer` (not copied): the model, tokenizer, LoRA and mesh (`builders`), the
optimizer and LR schedule (`steps.make_optimizer`, `builders.optim_config`), the non-finite guard, the jit
helpers (`placement.Placement`: `commit` / `jit_update` / `tracer`), checkpoints and resume (`run_dir.RunDir`:
`<trainer.default_local_dir>/checkpoints/global_step_<N>`, `trainer.resume_mode`; this class supplies
`state_dict` / `load_state_dict` / `load_checkpoint`), `metrics.jsonl` / `config.json` handling and the
SIGINT/SIGTERM stop of `main.py`. Resuming is exact: params, optimizer state, step, data position and the
`num_tokens` count.

A model source for RL: after the last step (`trainer.export_hf`) the model is written as a Hugging Face
directory `<trainer.default_local_dir>/huggingface/` (LoRA: merged weights); `model.path=<that run dir>`
loads it (`models.resolve`). Multi-host: every process loads the same data and builds the same global batch,
placed on the mesh (rows over the batch axes, `_on_mesh`); process 0 alone logs and writes files.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Collection
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl_post.engine import loop, steps
from jaxrl_post.engine.nonfinite import NonFiniteGuard
from jaxrl_post.engine.placement import Placement
from jaxrl_post.engine.run import checkpoint as ckpt
from jaxrl_post.engine.run.run_dir import RunDir
from jaxrl_post.engine.run.run_files import config_to_dict
from jaxrl_post.engine.run.tracking import Tracking
from jaxrl_post.errors import ConfigError
from jaxrl_post.models.lora import lora_config_of
from jaxrl_post.rl import builders, preflight
from jaxrl_post.runtime import distributed
from jaxrl_post.runtime.platform_defaults import log_resolved, resolve_config
from jaxrl_post.runtime.sharding import init_opt_state
from jaxrl_post.sft import sft_step

HF_EXPORT_SUBDIR = "huggingface"  # <run dir>/huggingface/: the exported model (verl's checkpoint subdir name)


def validate_sft_config(cfg) -> None:
    """Raise one `ConfigError` naming every bad SFT key (batch geometry, lengths, formats)."""
    from jaxrl_post.data.sft import FORMATS, TRUNCATIONS

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
    if d.format not in FORMATS:
        bad.append(f"data.format={d.format!r}: must be one of {list(FORMATS)}")
    if d.packing_strategy not in sft_step.PACKING_STRATEGIES:
        bad.append(f"data.packing_strategy={d.packing_strategy!r}: must be one of {list(sft_step.PACKING_STRATEGIES)}")
    elif d.packing_strategy == "bfd" and not cfg.model.use_remove_padding:
        bad.append("data.packing_strategy='bfd' packs examples into rows: it needs model.use_remove_padding=True")
    if d.truncation not in TRUNCATIONS:
        bad.append(f"data.truncation={d.truncation!r}: must be one of {list(TRUNCATIONS)} for SFT")
    if not d.train_files:
        bad.append("data.train_files: no training data given")
    if cfg.trainer.total_training_steps is None and not is_pos(cfg.trainer.total_epochs):
        bad.append(f"trainer.total_epochs={cfg.trainer.total_epochs!r}: must be an int > 0")
    if cfg.trainer.resume_mode not in ckpt.RESUME_MODES:
        bad.append(f"trainer.resume_mode={cfg.trainer.resume_mode!r}: must be one of {list(ckpt.RESUME_MODES)}")
    if bad:
        raise ConfigError("invalid SFT config:\n  " + "\n  ".join(f"config.{b}" for b in bad))


class SFTBatches:
    """Example indices of each training step, `[train_batch_size] int64`: grain `MapDataset` shuffled per epoch
    (`data.shuffle`, `data.seed`), remainder dropped, repeated forever; `get_state` / `set_state` are the
    checkpointed position."""

    def __init__(self, n: int, batch_size: int, *, seed: int, shuffle: bool):
        import grain

        ds = grain.MapDataset.range(n)
        if shuffle:
            ds = ds.shuffle(seed=seed)
        ds = ds.batch(batch_size, drop_remainder=True, batch_fn=lambda xs: np.asarray(xs, np.int64))
        self.batches_per_epoch = len(ds)
        opts = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)
        self._iter = iter(ds.repeat(None).to_iter_dataset(opts))

    def __next__(self) -> np.ndarray:
        return next(self._iter)

    def get_state(self) -> dict[str, Any]:
        return dict(self._iter.get_state())

    def set_state(self, state: dict[str, Any]) -> None:
        self._iter.set_state(dict(state))


class SFTTrainer:
    """Supervised fine-tuning driven by a job ConfigDict (configs/sft.py).

    Args:
      config: the job ConfigDict (validated first). tracker: optional `Tracking` (default: console + jsonl in
        `trainer.default_local_dir`). console_write: optional callable for console lines (tests capture it).

    Raises:
      ConfigError: invalid config (`validate_sft_config`), an unusable working directory, fewer examples than
        `data.train_batch_size`.
      MalformedRowError: a malformed row or an overlong example (file and row named), before the model loads.
      FileNotFoundError: a data file that does not exist.
      CheckpointError: the checkpoint to resume from cannot be read or does not match the config.
    """

    TRAINER_TYPE = "sft"  # main.py's trainer_type; checkpoints record it (a DPO run cannot resume an SFT one)

    def __init__(self, config, *, tracker: Tracking | None = None, console_write: Callable[[str], None] | None = None):
        self.validate_config(config)  # accepts "auto"; errors come before any other line
        resolved = resolve_config(config, log_line=False)  # "auto" values by platform (platform_defaults.py)
        self.config = cfg = config
        self.workdir = cfg.trainer.default_local_dir
        preflight.check_workdir(cfg)
        preflight.check_model_path(cfg)  # one line naming model.path, before anything loads

        # ---- data first (errors name file and row before the slow model load)
        self.tokenizer = builders.load_tokenizer(cfg.model.tokenizer_path or cfg.model.path)
        self.train_data = self._load_data(cfg.data.train_files, "train_files")
        d = cfg.data
        self.batch_size = int(d.train_batch_size)
        self.row_len, self.pack = int(d.max_length), bool(cfg.model.use_remove_padding)
        self.packed_rows = self._pack_dataset()  # bfd: example indices of each packed row; else None
        n_items = len(self.train_data) if self.packed_rows is None else len(self.packed_rows)
        if n_items < self.batch_size:
            unit = "examples (after skipping)" if self.packed_rows is None else "packed rows"
            raise ConfigError(
                f"config.data.train_files={d.train_files!r}: {n_items} {unit} for "
                f"data.train_batch_size={self.batch_size}; lower the batch size or add data"
            )
        self.val_data = None
        if d.val_files:
            self.val_data = self._load_data(d.val_files, "val_files")
            if d.max_val_samples:
                self.val_data = self._head(self.val_data, int(d.max_val_samples))
        self.train_loader = SFTBatches(n_items, self.batch_size, seed=int(d.seed), shuffle=bool(d.shuffle))
        self.total_training_steps = int(
            cfg.trainer.total_training_steps or int(cfg.trainer.total_epochs) * self.train_loader.batches_per_epoch
        )
        self.n_micro, self.rows = sft_step.micro_geometry(self.batch_size, int(d.micro_batch_size))

        log_resolved(resolved)  # after the run-directory, model-path and data checks (an error there is one line)
        # ---- devices, model (LoRA: adapters trained, base frozen), optimizer, jitted fns
        self.mesh = builders.build_mesh(cfg)
        self.n_devices = jax.device_count()
        self.placement = Placement(self.mesh, self.n_devices)  # commit / jit helpers, trace counts
        self.trace_counts = self.placement.trace_counts
        self.actor_model = self._build_model()
        self.lora = lora_config_of(self.actor_model)
        if self.lora is not None:
            graphdef, params, frozen, rest = steps.split_lora_model(self.actor_model)
            self.actor_frozen = self.placement.commit(frozen)
        else:
            graphdef, params, rest = steps.split_model(self.actor_model)
            self.actor_frozen = None
        self.actor_graphdef, self.actor_rest = graphdef, rest
        self.actor_params = self.placement.commit(params)
        self.optim_cfg = builders.optim_config(
            cfg.optim,
            grad_clip=float(cfg.optim.clip_grad),
            total_training_steps=self.total_training_steps,
            updates_per_step=1,
        )
        self.tx = steps.make_optimizer(self.optim_cfg)
        self.lr_fn = steps.make_lr_schedule(self.optim_cfg)
        self.actor_opt_state = self.placement.commit(
            init_opt_state(self.tx, self.actor_params, self.placement.opt_mesh())
        )
        self._build_steps(graphdef, rest)

        # ---- host state, loggers, checkpoints / resume
        self.global_steps = 0
        self.num_tokens = 0  # TRL `num_tokens`: input tokens trained on so far
        self.guard = NonFiniteGuard(int(cfg.trainer.max_consecutive_nonfinite), "actor")
        self._say = console_write or (lambda line: print(line, flush=True))
        os.makedirs(self.workdir, exist_ok=True)
        if not distributed.is_main():  # process 0 alone prints, logs and writes metrics files (as RLTrainer)
            self._say, tracker = (lambda line: None), tracker or distributed.NullTracker()
        self.tracker = tracker or Tracking(
            self.workdir,
            cfg.trainer.logger,
            int(cfg.trainer.print_every),
            console_write=console_write,
            project=cfg.trainer.project_name,
            experiment=cfg.trainer.experiment_name,
            config=config_to_dict(cfg),
        )
        self.val_before_metrics: dict[str, float] | None = None  # the run's step-0 validation (kept on resume)
        self.run = RunDir(cfg, self._say, self.tracker)
        self.run.open(self)  # lock, resume (`load_checkpoint`), metrics.jsonl, config.json
        self.checkpointer = self.run.checkpointer

    # ------------------------------------------------------------------------------------ hooks (DPOTrainer)
    validate_config = staticmethod(validate_sft_config)

    def _build_model(self):
        """The trained model (`builders.build_actor_and_tokenizer`; `self.tokenizer` already made the data);
        the reward-model trainer wraps it in a `RewardModel`."""
        return builders.build_actor_and_tokenizer(self.config, self.mesh)[0]

    @staticmethod
    def _head(data, k: int):
        """The first `k` examples of `data` (`data.max_val_samples`)."""
        data.input_ids, data.loss_mask, data.where = data.input_ids[:k], data.loss_mask[:k], data.where[:k]
        return data

    def _build_steps(self, graphdef, rest) -> None:
        """The jitted update and eval functions (before a resume loads the checkpoint)."""
        update = sft_step.make_sft_update(graphdef, rest, self.tx, on_trace=self.placement.tracer("update"))
        self._update = self.placement.jit_update(update, self.actor_params, self.actor_opt_state)
        self._eval = jax.jit(sft_step.make_sft_eval(graphdef, rest, on_trace=self.placement.tracer("eval")))

    # ------------------------------------------------------------------------------------ data
    def _load_data(self, spec: str, key: str):
        """The examples of `spec`. Raises ConfigError naming `config.data.<key>` when a file does not exist."""
        from jaxrl_post.data.sft import SFTKeys

        d = self.config.data
        try:
            return self._read_data(spec, SFTKeys(d.messages_key, d.prompt_key, d.response_key))
        except FileNotFoundError as e:
            raise ConfigError(f"config.data.{key}={spec!r}: {e}") from e

    def _read_data(self, spec: str, keys):
        from jaxrl_post.data.sft import load_sft_data

        d = self.config.data
        return load_sft_data(
            spec,
            self.tokenizer,
            fmt=d.format,
            keys=keys,
            max_length=int(d.max_length),
            truncation=d.truncation,
            filter_overlong=bool(d.filter_overlong),
            skip_malformed=bool(d.skip_malformed),
        )

    def _pack_dataset(self) -> list[list[int]] | None:
        """`data.packing_strategy='bfd'`: the training examples packed once into rows of `data.max_length`
        (`sft_step.best_fit_decreasing`, TRL's BFD); None for per-step packing (and for DPO / RM)."""
        if self.config.data.get("packing_strategy", "per_step") != "bfd":
            return None
        return sft_step.best_fit_decreasing([len(x) for x in self.train_data.input_ids], self.row_len)

    def _batch(self, ids, masks, plan=None) -> dict[str, jax.Array]:
        """Layout (`sft_step.layout_batch`; `plan`: rows already packed) placed on the mesh: rows over
        ('data', 'fsdp')."""
        arrays = sft_step.layout_batch(
            ids, masks, n_micro=self.n_micro, rows=self.rows, row_len=self.row_len, pack=self.pack, plan=plan
        )
        return self._on_mesh(arrays)

    def _on_mesh(self, arrays: dict[str, np.ndarray], row_keys: Collection[str] | None = None) -> dict[str, jax.Array]:
        """Host arrays on the mesh: those named in `row_keys` (default: all; `[n_micro, rows, ...]`) with rows
        over the batch axes ('data', 'fsdp'), the rest replicated. Every process passes the same arrays
        (multi-process runs).

        Raises: ConfigError: a micro-batch's rows do not divide over the batch axes' devices."""
        if self.n_devices == 1:
            return {k: jnp.asarray(v) for k, v in arrays.items()}
        from jax.sharding import NamedSharding, PartitionSpec

        from jaxrl_post.runtime.sharding import LOGICAL_AXIS_RULES

        row_keys = arrays.keys() if row_keys is None else arrays.keys() & set(row_keys)
        batch_axes = LOGICAL_AXIS_RULES["batch"]
        shards = math.prod(self.mesh.shape[a] for a in batch_axes)
        n_rows = {int(arrays[k].shape[1]) for k in row_keys}
        bad = sorted(n for n in n_rows if n % shards)
        if bad:
            raise ConfigError(
                f"data.micro_batch_size={self.config.data.micro_batch_size}: a micro-batch of {bad[0]} "
                f"rows cannot be split over the {shards} devices of the mesh's batch axes {batch_axes} "
                f"(trainer.mesh.*); use a micro-batch whose row count they divide, or fewer batch devices"
            )
        rows = NamedSharding(self.mesh, PartitionSpec(None, batch_axes, None))
        rep = NamedSharding(self.mesh, PartitionSpec())
        return {k: jax.device_put(v, rows if k in row_keys else rep) for k, v in arrays.items()}

    def _frozen(self) -> tuple:
        return () if self.actor_frozen is None else (self.actor_frozen,)

    # ------------------------------------------------------------------------------------ steps
    def train_step(self) -> dict[str, float]:
        """One optimizer step on the next `data.train_batch_size` examples (`bfd`: packed rows); returns its
        metrics."""
        t0 = time.perf_counter()
        idx, plan = next(self.train_loader), None
        if self.packed_rows is not None:
            idx, plan = self._unpack_rows(idx)
        ids = [self.train_data.input_ids[i] for i in idx]
        batch = self._batch(ids, [self.train_data.loss_mask[i] for i in idx], plan)
        return self._apply_update(batch, self._frozen(), int(sum(len(x) for x in ids)), t0)

    def _apply_update(self, batch, extra_args: tuple, n_tokens: int, t0: float) -> dict[str, float]:
        """One jitted update on `batch` (the learning rate of this step: one update per step), then the step's
        metrics: the update's, the non-finite guard's, `learning_rate`, `num_tokens` (input tokens so far,
        `n_tokens` of them this step), `epoch` and `timing_s/step` (since `t0`). Shared by SFT, DPO and RM."""
        lr = float(self.lr_fn(self.global_steps))
        self.actor_params, self.actor_opt_state, out = self._update(
            self.actor_params, self.actor_opt_state, batch, *extra_args
        )
        m = {k: float(v) for k, v in jax.device_get(out).items()}
        self.global_steps += 1
        self.num_tokens += n_tokens
        m.update(self.guard.observe([m.pop("update_skipped")], step=self.global_steps))
        m.update(
            learning_rate=lr,
            num_tokens=float(self.num_tokens),
            epoch=self.global_steps / self.train_loader.batches_per_epoch,
        )
        m["timing_s/step"] = time.perf_counter() - t0
        return m

    def validate(self) -> dict[str, float]:
        """Held-out `val/loss` (NLL per loss token over all of `data.val_files`), `val/perplexity`,
        `val/mean_token_accuracy`, `timing_s/testing`. Raises RuntimeError without validation data."""
        if self.val_data is None:
            raise RuntimeError("no validation data: set data.val_files")
        t0 = time.perf_counter()
        nll = hits = n = 0.0
        v = self.val_data
        for lo in range(0, len(v), self.batch_size):
            batch = self._batch(v.input_ids[lo : lo + self.batch_size], v.loss_mask[lo : lo + self.batch_size])
            a, b, c = (float(x) for x in jax.device_get(self._eval(self.actor_params, batch, *self._frozen())))
            nll, hits, n = nll + a, hits + b, n + c
        loss = nll / max(n, 1.0)
        return {
            "val/loss": loss,
            "val/perplexity": math.exp(min(loss, 700.0)),
            "val/mean_token_accuracy": hits / max(n, 1.0),
            "timing_s/testing": time.perf_counter() - t0,
        }

    # ------------------------------------------------------------------------------------ loop
    def fit(self, max_steps: int | None = None, stop=None) -> dict[str, Any]:
        """Train to `total_training_steps`, validating before (`trainer.val_before_train`), every
        `trainer.test_freq` steps and after the last (`trainer.val_at_end`), checkpointing every
        `trainer.save_freq` steps and after the last; then export the model (`trainer.export_hf`).

        Args / returns / stop handling as `RLTrainer.fit` (`max_steps`: stop after that many steps of this
        call; `stop`: `interrupt.GracefulStop`, the step is checkpointed and the loop returns).
        Raises NonFiniteError (`trainer.max_consecutive_nonfinite` skipped updates in a row), CheckpointError.
        """
        result = loop.fit(self, max_steps, stop=stop, desc=self.TRAINER_TYPE)
        cfg = self.config
        if self.global_steps >= self.total_training_steps and cfg.trainer.export_hf:
            result["exported_to"] = self.export_hf()
        return result

    # ---- the hooks of the shared loop (engine/loop.py)
    def has_validation(self) -> bool:
        return self.val_data is not None

    def console_tags(self) -> set[str]:
        """Which lines of the console legend apply: this trainer's (`TRAINER_TYPE`)."""
        return {self.TRAINER_TYPE}

    def on_fit_start(self) -> None:
        packed = {} if self.packed_rows is None else {"data/num_packed_rows": len(self.packed_rows)}  # bfd
        self.tracker.log({**self.train_data.stats, **packed}, step=self.global_steps)

    def _unpack_rows(self, rows) -> tuple[np.ndarray, list[list[int]]]:
        """bfd: packed row indices -> (the example indices of those rows in order `[N] int64`, each row's members as
        positions into them: the `plan` the layout takes)."""
        members = [self.packed_rows[r] for r in rows]
        at = np.cumsum([0] + [len(row) for row in members])
        return np.asarray([i for row in members for i in row], np.int64), [
            list(range(a, b)) for a, b in zip(at, at[1:])
        ]

    def run_step(self) -> dict[str, float]:
        return self.train_step()

    @staticmethod
    def progress_postfix(metrics) -> dict[str, str]:
        return {"loss": f"{metrics['loss']:.4f}"}

    def export_hf(self, out_dir: str | None = None) -> str:
        """Write the current model as a Hugging Face directory (default `<run dir>/huggingface/`; LoRA: merged
        weights) with the tokenizer; returns its path. `model.path=<run dir>` then loads it."""
        from jaxrl_post.models import save_pretrained

        out_dir = out_dir or os.path.join(self.workdir, HF_EXPORT_SUBDIR)
        self.sync_weights()
        save_pretrained(self.actor_model, self.tokenizer, out_dir)
        self._say(f"exported the model to {out_dir} (use it as model.path={self.workdir})")
        return out_dir

    def close(self) -> None:
        """Wait for a pending checkpoint save (raises `CheckpointError` if it failed), then close the loggers."""
        try:
            self.checkpointer.close()
        finally:
            self.tracker.close()

    # ------------------------------------------------------------------------------------ state
    def sync_weights(self) -> None:
        """The actor module holds the live params (export, evaluation)."""
        nnx.update(self.actor_model, self.actor_params)
        if self.actor_frozen is not None:
            nnx.update(self.actor_model, self.actor_frozen)

    resumed_from = property(lambda self: self.run.resumed_from, doc="The step directory resumed from, or None.")

    def save_checkpoint(self) -> bool:
        """Start an (async) checkpoint of the current state as step `global_steps`; False if one exists."""
        return self.checkpointer.save(self.global_steps, self.state_dict())

    def load_checkpoint(self, root: str, step: int) -> None:
        """Restore `<root>/global_step_<step>` into this trainer. Raises CheckpointError (`RunDir.restore`)."""
        like = lambda items: {k: v for k, v in self.state_dict().items() if k != "host"}
        self.load_state_dict(self.run.restore(root, step, like, model_config=self.actor_model.config, lora=self.lora))
        n, total = self.global_steps, self.total_training_steps
        self._say(f"resumed from step {n}{f' of {total}' if n < total else ''} ({self.run.resumed_from})")

    def compile_counts(self) -> dict[str, int]:
        """Compiled executables per jitted function (1 each after any number of same-shaped steps)."""
        return {"update": self._update._cache_size(), "eval": self._eval._cache_size()}

    def state_dict(self) -> dict[str, Any]:
        """Params (LoRA: the adapters), optimizer state, and host state: step, data position, `num_tokens`,
        non-finite counters, model metadata (`scripts/export_hf.py` reads it), config."""
        cfg = self.config
        base = ckpt.reference_pointer(
            model_path=None if cfg.model.random_init else cfg.model.path,
            random_init=bool(cfg.model.random_init),
            seed=int(cfg.trainer.seed),
        )
        return {
            "actor": {"params": self.actor_params, "opt_state": self.actor_opt_state},
            "host": {
                "trainer_type": self.TRAINER_TYPE,
                "global_steps": self.global_steps,
                "num_tokens": self.num_tokens,
                "data_iter": self.train_loader.get_state(),
                "nonfinite": {"actor": self.guard.state_dict()},
                "model": ckpt.model_metadata(
                    self.actor_model.config,
                    cfg.model.tokenizer_path or cfg.model.path,
                    lora=None if self.lora is None else self.lora.to_dict(),
                    base=base,
                ),
                "total_training_steps": self.total_training_steps,
                "config": config_to_dict(cfg),
            },
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Inverse of `state_dict` (arrays placed like the current ones). Raises CheckpointError for a
        checkpoint that is not an SFT one (an RL run's checkpoints hold other state)."""
        host = state["host"]
        if host.get("trainer_type") != self.TRAINER_TYPE:
            raise ckpt.CheckpointError(
                f"the checkpoint to resume from was not written by {type(self).__name__} (trainer_type "
                f"{host.get('trainer_type', 'rl')!r}); point "
                "trainer.default_local_dir at a new directory or pass --config.trainer.resume_mode=disable"
            )
        place = lambda new, like: jax.tree.map(lambda n, l: jax.device_put(n, l.sharding), new, like)
        self.actor_params = place(state["actor"]["params"], self.actor_params)
        self.actor_opt_state = place(state["actor"]["opt_state"], self.actor_opt_state)
        self.global_steps = int(host["global_steps"])
        self.num_tokens = int(host["num_tokens"])
        self.train_loader.set_state(host["data_iter"])
        self.guard.load_state_dict((host.get("nonfinite") or {}).get("actor", {}))
        self.sync_weights()
